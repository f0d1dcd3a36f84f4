"""The attention kinds (device/kernels/attention_kinds.py): soft-capping, windows and learned
sinks, each against the plain definition (the whole T x T at once, written here) and its
gradient against central finite differences in float64; the tiled twin's window reads only
the keys its rows see; the fused op under every kind equals the definition."""
import numpy as np
import pytest

from hpcdist.autograd import ops
from hpcdist.autograd.tensor import Tensor
from hpcdist.device import kernels
from hpcdist.device.kernels import attention_kinds, flash
from hpcdist.device.kernels.attention_kinds import Scores


def definition(qkv, nh, nkv, scale, cap=0.0, window=0, sinks=None):
    """y (B, T, nh hs) by the textbook: every score, the mask, the cap, one softmax whose
    denominator holds exp(sink) where sinks are given."""
    B, T, W = qkv.shape
    hs = W // (nh + 2 * nkv)
    q = qkv[..., :nh * hs].reshape(B, T, nh, hs)
    k = qkv[..., nh * hs:(nh + nkv) * hs].reshape(B, T, nkv, hs)
    v = qkv[..., (nh + nkv) * hs:].reshape(B, T, nkv, hs)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    s = np.where(seen, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks[None, :, None, None] - m)
    return np.einsum("bhij,bjhd->bihd", e / den, v).reshape(B, T, nh * hs)


KINDS = [dict(cap=5.0), dict(window=3), dict(window=1), dict(cap=2.0, window=4),
         dict(sinks=True), dict(sinks=True, window=5), dict(scale=0.7, cap=3.0, sinks=True)]
SHAPES = [(2, 9, 4, 2, 3), (1, 13, 2, 1, 4), (1, 130, 2, 2, 2)]


def _case(shape, seed=0):
    B, T, nh, nkv, hs = shape
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, (nh + 2 * nkv) * hs)) * 1.5
    return qkv, rng.standard_normal(nh) * 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_the_fused_op_equals_the_definition_forward_and_backward(kind, shape):
    B, T, nh, nkv, hs = shape
    qkv, sinks = _case(shape)
    scores = Scores(**kind)
    scale = scores.softmax_scale(hs)
    s = sinks if scores.sinks else None
    ref = definition(qkv, nh, nkv, scale, scores.cap, scores.window, s)
    x = Tensor(qkv.copy(), requires_grad=True)
    st = Tensor(sinks.copy(), requires_grad=True) if scores.sinks else None
    y = ops.fused_attention(x, nh, nkv, scores, st)
    np.testing.assert_allclose(y.data, ref, rtol=1e-12, atol=1e-12)
    w = np.random.default_rng(1).standard_normal(y.shape)
    (y * Tensor(w)).sum().backward()

    def loss(a, sk):
        return float((definition(a, nh, nkv, scale, scores.cap, scores.window, sk) * w).sum())
    rng, eps = np.random.default_rng(2), 1e-6
    for idx in [tuple(rng.integers(0, n) for n in qkv.shape) for _ in range(12)]:
        up, dn = qkv.copy(), qkv.copy()
        up[idx] += eps
        dn[idx] -= eps
        fd = (loss(up, s) - loss(dn, s)) / (2 * eps)
        assert abs(x.grad[idx] - fd) < 1e-7 * max(1, abs(fd)), (idx, x.grad[idx], fd)
    if scores.sinks:
        for h in range(nh):
            up, dn = sinks.copy(), sinks.copy()
            up[h] += eps
            dn[h] -= eps
            fd = (loss(qkv, up) - loss(qkv, dn)) / (2 * eps)
            assert abs(st.grad[h] - fd) < 1e-7 * max(1, abs(fd)), (h, st.grad[h], fd)


def test_a_window_block_reads_only_the_keys_it_sees_and_equals_the_whole():
    """T 1,000 under a window of 64: blocks of 64 rows over at most 127 keys; the result
    equals the definition (so no tile the window skips held a seen key)."""
    assert flash._block_rows(1, 2, 1000, 64) == 64
    assert flash.key_range(640, 704, 64) == 577
    qkv, _ = _case((1, 1000, 2, 1, 4), seed=3)
    y, _ = flash.flash_twin(qkv, 2, 1, 0.5, window=64)
    np.testing.assert_allclose(y, definition(qkv, 2, 1, 0.5, window=64), rtol=1e-11,
                               atol=1e-12)


def test_sinks_merged_after_the_flash_kernels_equal_the_definition():
    """Plain scores with sinks run in the flash kernels (the CPU's numba + BLAS here), the
    sinks merged after them."""
    qkv, sinks = _case((2, 40, 4, 4, 8), seed=4)
    qkv, sinks = qkv.astype(np.float32), sinks.astype(np.float32)
    y, lse, _ = kernels.attention.kinded_attention_fwd(qkv, 4, 4, Scores(sinks=True), sinks)
    ref = definition(qkv.astype(np.float64), 4, 4, 8 ** -0.5, sinks=sinks.astype(np.float64))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_a_bad_kind_is_one_line():
    with pytest.raises(ValueError, match="cap and window are 0"):
        Scores(window=-1)
    assert attention_kinds.PLAIN.tiled_kernels_take and not Scores(cap=1.0).tiled_kernels_take


@pytest.mark.parametrize("kind", [dict(cap=3.0, sinks=True), dict(window=4, sinks=True),
                                  dict(scale=0.4, cap=2.0, window=5)], ids=str)
def test_a_layer_of_each_kind_decodes_through_its_cache_as_it_trains(kind):
    """nn.attention.SelfAttention with the kind: the whole sequence at once (the training
    path) equals the same rows fed one at a time through the KV cache (the block kernels,
    the cache kept to the window), and both equal the definition."""
    from hpcdist.nn.attention import SelfAttention
    from hpcdist.nn.family import AttentionShape
    shape = AttentionShape(4, 2, 4)
    layer = SelfAttention(shape, scores=Scores(**kind))
    if layer.scores.sinks:
        layer.sinks.data[...] = np.array([0.5, -1.0, 2.0, 0.0])
    qkv, _ = _case((1, 12, 4, 2, 4), seed=5)
    whole = layer(Tensor(qkv)).data
    s = layer.sinks.data if layer.scores.sinks else None
    np.testing.assert_allclose(whole, definition(qkv, 4, 2, layer.scores.softmax_scale(4),
                                                 layer.scores.cap, layer.scores.window, s),
                               rtol=1e-12, atol=1e-12)
    cache = {}
    rows = [layer(Tensor(qkv[:, t:t + 1]), cache=cache).data for t in range(12)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), whole, rtol=1e-11, atol=1e-12)
    if layer.window:
        assert cache["k"].shape[1] == layer.window


def test_the_final_logit_cap_in_the_loss_and_in_what_sampling_reads():
    """LMLoss(cap=c): the loss is cross-entropy of c tanh(z / c), its gradient the chain
    rule's (finite differences), and the logits it returns (sampling's) are the capped ones."""
    from hpcdist.nn.gpt import LMLoss
    rng = np.random.default_rng(6)
    z = rng.standard_normal((2, 3, 7)) * 20
    t = rng.integers(0, 7, (2, 3))
    loss = LMLoss(7, cap=5.0)
    x = Tensor(z.copy(), requires_grad=True)
    logits, value = loss(x, t)
    capped = 5.0 * np.tanh(z / 5.0)
    np.testing.assert_allclose(logits.data, capped, rtol=1e-13)
    lp = capped - np.log(np.exp(capped).sum(-1, keepdims=True))
    ref = -np.take_along_axis(lp, t[..., None], -1).mean()
    assert abs(float(value.data) - ref) < 1e-12
    value.backward()

    def f(a):
        c = 5.0 * np.tanh(a / 5.0)
        return -np.take_along_axis(c - np.log(np.exp(c).sum(-1, keepdims=True)),
                                   t[..., None], -1).mean()
    for idx in [(0, 0, 1), (1, 2, 6), (1, 1, int(t[1, 1]))]:
        up, dn = z.copy(), z.copy()
        up[idx] += 1e-6
        dn[idx] -= 1e-6
        assert abs(x.grad[idx] - (f(up) - f(dn)) / 2e-6) < 1e-8
    assert np.all(np.abs(LMLoss(7, cap=5.0).eval()(Tensor(z)).data) < 5.0)


def test_a_window_as_long_as_the_rows_runs_in_the_flash_kernels():
    """A window of T or more masks nothing: the flash kernels run (not the twin), equal to
    the definition."""
    qkv, _ = _case((1, 16, 2, 2, 4), seed=7)
    kernels.attention._chosen.clear()
    y, _, _ = kernels.attention.kinded_attention_fwd(qkv, 2, 2, Scores(window=16))
    assert kernels.attention.choice().startswith("flash")
    np.testing.assert_allclose(y, definition(qkv, 2, 2, 0.5), rtol=1e-12, atol=1e-12)
    kernels.attention._chosen.clear()
    kernels.attention.kinded_attention_fwd(qkv, 2, 2, Scores(window=15))
    assert "tiled twin" in kernels.attention.choice()
    kernels.attention._chosen.clear()


def test_the_planner_and_the_run_count_a_local_layers_attention_by_its_window():
    """FLOPs per token: 6N + 12 d sum over layers of min(T, window) (a global layer: T),
    in the planner's model and in the run's MFU alike."""
    from hpcdist import nn
    from hpcdist.plan.model import Model, layer_windows
    from hpcdist.run import mfu
    cfg = nn.family("gemma2").config(n_layer=4, n_head=2, n_embd=16, head_dim=8,
                                     vocab_size=50, block_size=64, local_window=16)
    assert layer_windows(cfg) == (16, 0, 16, 0)
    m = Model.of(cfg)
    d, T = 16, 64
    weights = 6 * (m.active_parameters - m.positions)
    assert m.flops(1, False) / T == pytest.approx(weights + 12 * d * (16 + 64 + 16 + 64))
    model = nn.build("gemma2", n_layer=4, n_head=2, n_embd=16, head_dim=8, vocab_size=50,
                     block_size=64, local_window=16)
    per_token = mfu.model_flops_per_token(model, cfg, T)
    n = model.logical_parameters()
    assert per_token == pytest.approx(6 * n + 12 * d * (16 + 64 + 16 + 64))
