"""Every op's gradient against central finite differences, in float64."""
import numpy as np
import pytest

import hpcdist as hd
from hpcdist.autograd import ops
from hpcdist.nn.attention import Llama3Rotary, Rotary
from hpcdist.nn.family import AttentionShape
from conftest import gradcheck

R = np.random.default_rng(42)


def pos(*shape):
    return R.uniform(0.5, 2.0, size=shape)


def sym(*shape):
    return R.standard_normal(shape)


def away_from_zero(*shape):
    x = R.uniform(0.2, 1.5, size=shape)
    return x * R.choice([-1, 1], size=shape)


_ORDER = np.array([3, 0, 5, 1, 2, 4])            # assignment t k + j at each sorted place
_INV = np.argsort(_ORDER)
_WEIGHTS = sym(6, 4)


def _dev(a):
    return hd.backend.to_device(a)


CASES = {
    "add": (lambda a, b: a + b, [sym(3, 4), sym(3, 4)]),
    "add_broadcast": (lambda a, b: a + b, [sym(2, 3, 4), sym(4)]),
    "add_broadcast_keepdim": (lambda a, b: a + b, [sym(3, 1), sym(1, 4)]),
    "sub_broadcast": (lambda a, b: a - b, [sym(3, 4), sym(3, 1)]),
    "rsub_scalar": (lambda a: 2.0 - a, [sym(3)]),
    "mul_broadcast": (lambda a, b: a * b, [sym(2, 3), sym(1, 3)]),
    "div": (lambda a, b: a / b, [sym(3, 4), pos(3, 4)]),
    "rdiv_scalar": (lambda a: 1.0 / a, [pos(5)]),
    "neg": (lambda a: -a, [sym(4)]),
    "pow_scalar": (lambda a: a ** 3, [sym(3, 2)]),
    "pow_fractional": (lambda a: a ** 0.5, [pos(3, 2)]),
    "pow_tensor": (lambda a, b: a ** b, [pos(3), sym(3)]),
    "exp": (lambda a: a.exp(), [sym(3, 3)]),
    "log": (lambda a: a.log(), [pos(3, 3)]),
    "sqrt": (lambda a: a.sqrt(), [pos(4)]),
    "tanh": (lambda a: a.tanh(), [sym(2, 5)]),
    "relu": (lambda a: a.relu(), [away_from_zero(3, 4)]),
    "gelu": (lambda a: a.gelu(), [sym(3, 4)]),
    "sigmoid": (lambda a: a.sigmoid(), [sym(3, 4)]),
    "matmul_2d": (lambda a, b: a @ b, [sym(3, 4), sym(4, 2)]),
    "matmul_batched": (lambda a, b: a @ b, [sym(2, 3, 4), sym(2, 4, 5)]),
    "matmul_broadcast_batch": (lambda a, b: a @ b, [sym(2, 1, 3, 4), sym(3, 4, 2)]),
    "matmul_3d_by_2d": (lambda a, b: a @ b, [sym(2, 3, 4), sym(4, 5)]),
    "matmul_vec_left": (lambda a, b: a @ b, [sym(4), sym(4, 3)]),
    "linear_3d_bias": (lambda x, w, b: ops.linear(x, w, b), [sym(2, 3, 4), sym(4, 5), sym(5)]),
    "linear_2d": (lambda x, w: ops.linear(x, w), [sym(3, 4), sym(4, 2)]),
    "attend_3d": (lambda x, w: ops.attend(x, w), [sym(2, 3, 4), sym(5, 4)]),
    "attend_tied": (lambda w: ops.attend(ops.embedding(w, np.array([[1, 0, 4]])), w),
                    [sym(5, 4)]),
    "linear_noncontiguous": (lambda x, w, b: ops.linear(x.transpose(1, 0, 2), w, b),
                             [sym(3, 2, 4), sym(4, 5), sym(5)]),
    "matmul_vec_right": (lambda a, b: a @ b, [sym(2, 4), sym(4)]),
    "sum_all": (lambda a: a.sum(), [sym(3, 4)]),
    "sum_axis": (lambda a: a.sum(axis=1), [sym(3, 4, 2)]),
    "sum_axes_keepdims": (lambda a: a.sum(axis=(0, 2), keepdims=True), [sym(3, 4, 2)]),
    "mean_axis": (lambda a: a.mean(axis=-1), [sym(3, 4)]),
    "mean_all": (lambda a: a.mean(), [sym(2, 3)]),
    "max_axis": (lambda a: a.max(axis=1), [R.permutation(12).reshape(3, 4) * 0.3]),
    "max_all_keepdims": (lambda a: a.max(axis=None, keepdims=True), [R.permutation(6).reshape(2, 3) * 1.0]),
    "reshape": (lambda a: a.reshape(6, 2), [sym(3, 4)]),
    "transpose": (lambda a: a.transpose(2, 0, 1), [sym(2, 3, 4)]),
    "T": (lambda a: a.T, [sym(2, 3)]),
    "getitem_slice": (lambda a: a[1:, ::2], [sym(4, 5)]),
    "getitem_int_array_repeats": (lambda a: a[np.array([0, 2, 0, 0])], [sym(3, 2)]),
    "getitem_mixed": (lambda a: a[np.array([1, 1]), 1:3], [sym(3, 4)]),
    "concat": (lambda a, b: ops.concat([a, b], axis=1), [sym(2, 3), sym(2, 2)]),
    "split": (lambda a: ops.split(a, [1, 3], axis=1)[1] * ops.split(a, [1, 3], axis=1)[0], [sym(2, 4)]),
    "embedding_repeats": (lambda w: ops.embedding(w, np.array([[0, 2, 2], [1, 0, 2]])), [sym(4, 3)]),
    "softmax": (lambda a: a.softmax(axis=-1), [sym(3, 5)]),
    "softmax_axis0": (lambda a: a.softmax(axis=0), [sym(3, 5)]),
    "log_softmax": (lambda a: a.log_softmax(axis=-1), [sym(3, 5)]),
    "cross_entropy": (lambda z: ops.cross_entropy(z, np.array([1, 0, 4, 2])), [sym(4, 5)]),
    "cross_entropy_ignore_3d": (lambda z: ops.cross_entropy(z, np.array([[1, -100, 2], [-100, 0, 3]])), [sym(2, 3, 4)]),
    "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), [sym(2, 3, 5), sym(5), sym(5)]),
    "layer_norm_no_affine": (lambda x: ops.layer_norm(x, None, None), [sym(4, 6)]),
    "masked_fill": (lambda a: a.masked_fill(np.triu(np.ones((3, 3), bool), 1), -5.0), [sym(2, 3, 3)]),
    "where": (lambda a, b: ops.where(np.array([[True, False, True]]), a, b), [sym(2, 3), sym(3)]),
    # the fused ops (hpcdist/device/kernels/): each one node, its own backward
    "causal_softmax": (lambda a: ops.causal_softmax(a, 0.7), [sym(2, 4, 4)]),
    "causal_softmax_past": (lambda a: ops.causal_softmax(a, 0.7, past=2), [sym(1, 3, 5)]),
    "fused_attention": (lambda qkv: ops.fused_attention(qkv, 2), [sym(2, 5, 12)]),
    "fused_attention_gqa": (lambda qkv: ops.fused_attention(qkv, 4, 2), [sym(2, 6, 32)]),
    "fused_attention_mqa": (lambda qkv: ops.fused_attention(qkv, 3, 1), [sym(1, 7, 20)]),
    # the rotary families' (hpcdist/device/kernels/rmsnorm.py, swiglu.py, rotary.py)
    "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-5), [sym(2, 3, 5), sym(5)]),
    "swiglu": (lambda h: ops.swiglu(h), [sym(2, 3, 8)]),
    "rotary": (lambda qkv: ops.rotary(qkv, _dev(np.arange(3, 8)), AttentionShape(2, 1, 4),
                                      Rotary(50.0)), [sym(2, 5, 16)]),
    "rotary_llama3": (lambda qkv: ops.rotary(qkv, _dev(np.arange(3, 8)), AttentionShape(2, 1, 4),
                                             Llama3Rotary(50.0, 4.0, 1.0, 4.0, 8)),
                      [sym(2, 5, 16)]),
    "geglu": (lambda h: ops.geglu(h), [sym(2, 3, 8)]),
    "linear_gelu": (lambda x, w, b: ops.linear_gelu(x, w, b), [sym(2, 3, 4), sym(4, 5), sym(5)]),
    "linear_residual": (lambda x, w, b, r: ops.linear(x, w, b, r),
                        [sym(2, 3, 4), sym(4, 5), sym(5), sym(2, 3, 5)]),
    # 3 tokens, k = 2 assignments each, sorted by a made-up expert order
    # (the order and its inverse live where the router makes them: on the device)
    "moe_permute": (lambda x: ops.moe_permute(x, _dev(_ORDER), _dev(_INV), 2) * _WEIGHTS,
                    [sym(3, 4)]),
    "moe_combine": (lambda ys, w: ops.moe_combine(ys, w, _dev(_ORDER), _dev(_INV), 2),
                    [sym(6, 4), sym(6)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_finite_differences(name, float64):
    f, inputs = CASES[name]
    gradcheck(f, *[x.copy() for x in inputs])


def test_dropout_gradient_uses_the_forward_mask(float64):
    def f(a):
        hd.backend.seed(7)  # same mask for every evaluation of f
        return ops.dropout(a, 0.3, training=True)
    out = gradcheck(f, sym(6, 7))
    kept = out.data != 0
    assert 0.4 < kept.mean() < 0.95
    assert ops.dropout(hd.tensor(sym(3)), 0.3, training=False).data.shape == (3,)


def test_reused_node_and_diamond(float64):
    # x feeds three paths, one of which reuses an intermediate twice.
    def f(x, w):
        h = (x @ w).tanh()
        return (h * h + h).sum(axis=1) + (x * x).sum(axis=1)
    gradcheck(f, sym(3, 4), sym(4, 2))


def test_gpt_block_gradients(float64):
    from hpcdist import nn
    nn.manual_seed(0)
    cfg = nn.GPTConfig(block_size=5, vocab_size=7, n_layer=1, n_head=2, n_embd=8)
    block = nn.Block(cfg)
    params = block.parameters()

    def f(x, w_attn):
        saved = block.attn.c_attn.weight
        block.attn.c_attn.weight = w_attn
        try:
            return block(x)
        finally:
            block.attn.c_attn.weight = saved
    gradcheck(f, sym(2, 5, 8), params[2].data.copy(), atol=1e-5)


def test_gradcheck_catches_a_wrong_backward(float64):
    from hpcdist.autograd.tensor import Tensor

    def bad_square(a):  # forward a*a, backward claims 3*a
        return Tensor._make(a.data * a.data, (a,), lambda g: (3 * g * a.data,))
    with pytest.raises(AssertionError):
        gradcheck(bad_square, sym(3))


@pytest.mark.parametrize("kernel_threads", [0, 1, 2])      # 0: NumPy's reduceat path
def test_scatter_add_matches_numpy_add_at_with_repeats_and_negative_indices(kernel_threads,
                                                                            monkeypatch):
    from hpcdist.device import backend
    if kernel_threads:
        pytest.importorskip("numba")
        from hpcdist.device.kernels import cpu
        from hpcdist.host import threads
        monkeypatch.setattr(cpu, "MIN_SIZE", 0)
        monkeypatch.setattr(threads, "threads", kernel_threads)
    rng = np.random.default_rng(1)
    for _ in range(200):
        V, C = int(rng.integers(1, 8)), int(rng.choice([1, 3, 64, 70]))
        idx = rng.integers(-V, V, size=int(rng.integers(0, 30)))
        vals = rng.standard_normal((idx.size, C))
        want, got = np.zeros((V, C)), np.zeros((V, C))
        np.add.at(want, idx, vals)
        backend.scatter_add(got, idx, vals)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for bad in ([0, 3], [-4, 0]):                    # out of range for 3 rows: refused
        with pytest.raises(IndexError):
            backend.scatter_add(np.zeros((3, 2)), np.array(bad), np.ones((2, 2)))
