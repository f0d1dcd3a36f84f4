"""The fused kernels' machinery: a kernel is used only after it equals its twin, a wrong one
is refused and said, the GPU stand-in counts a fused op as its launches, and an op that adds a
parameter's gradient straight into its buffer gives the gradients (and hooks) of the engine's
own addition."""
import numpy as np
import pytest

import hpcdist as hd
from hpcdist.device import backend, fused, kernels
from hpcdist import nn, optim

from cublas_standin import fake_cublas


def _fake(name, launch):
    """A Fused op whose "kernel" is ``launch`` (no GPU needed to test the self-check)."""
    return fused.Fused(f"test-{name}", "", [], lambda k, x: launch(x),
                       lambda x: x * 2.0, lambda xp, rng, dt: [(xp.arange(5.0).astype(dt),)])


def test_a_kernel_is_used_only_when_it_equals_its_twin():
    good = _fake("good", lambda x: x * 2.0)
    assert good.self_check("float32") and "test-good" not in fused.refusals()
    bad = _fake("bad", lambda x: x * 2.0 + 0.5)
    assert not bad.self_check("float32")
    assert fused.refusals()["test-bad"] == "float32: off by 6.25e-02 (allowed 1e-05)"
    broken = _fake("broken", lambda x: 1 / 0)
    assert not broken.self_check("float64")
    assert fused.refusals()["test-broken"].startswith("ZeroDivisionError")
    for name in ("test-good", "test-bad", "test-broken"):
        fused._REGISTRY.pop(name)


def test_the_self_check_compares_at_the_arrays_own_precision(monkeypatch):
    """Checked first inside a bf16-emulated run, a right fp32 kernel against a twin whose
    GEMM would round its operands to bf16: passed, and the run is still emulated after."""
    from hpcdist.device import precision
    monkeypatch.setattr(precision, "_bf16_operands", True)
    rng = np.random.default_rng(0)
    m = rng.standard_normal((8, 8)).astype(np.float32)
    op = fused.Fused("test-fp32", "", [], lambda k, x: np.matmul(x, m),
                     lambda x: backend.matmul(x, m),
                     lambda xp, rng, dt: [(rng.standard_normal((4, 8)).astype(dt),)])
    assert not np.array_equal(backend.matmul(m, m), m @ m)        # the run does round
    assert op.self_check("float32") and backend.bf16_emulated()
    fused._REGISTRY.pop("test-fp32")


def test_an_output_left_out_is_refused_unless_the_case_allows_it():
    """Attention's GEMM path returns no lse (it keeps the probabilities): the check lets that
    case leave it out, and refuses a launch that leaves it out anywhere else."""
    cases = lambda xp, rng, dt: [(xp.arange(5.0).astype(dt), "gemms"),       # noqa: E731
                                 (xp.arange(5.0).astype(dt), "kernels")]
    twin = lambda x, path: (x * 2.0, x + 1.0)                                  # noqa: E731
    for name, skip, ok in (("one", lambda a: a[-1] == "gemms", True),
                           ("none", lambda a: False, False)):
        op = fused.Fused(f"test-{name}", "", [], lambda k, x, path: (
            x * 2.0, None if path == "gemms" else x + 1.0), twin, cases, compare=2,
            may_skip=skip)
        assert op.self_check("float32") is ok
        fused._REGISTRY.pop(f"test-{name}")
        fused._refused.pop(f"test-{name}", None)
    wrong = fused.Fused("test-wrong", "", [], lambda k, x, path: (x * 2.0, None), twin, cases,
                        compare=2, may_skip=lambda a: a[-1] == "gemms")
    assert not wrong.self_check("float32")
    fused._REGISTRY.pop("test-wrong")
    fused._refused.pop("test-wrong")


def test_every_kernel_has_a_twin_cases_and_source_for_both_dtypes():
    ops = fused.registry()
    assert {"gelu_fwd", "gelu_bwd", "bias_gelu_fwd", "layernorm_fwd", "layernorm_bwd",
            "softmax_causal_fwd", "softmax_causal_bwd", "flash_fwd", "flash_bwd",
            "cross_entropy_fwd", "cross_entropy_bwd", "adamw", "colsum_add",
            "bias_residual"} <= set(ops)
    rng = np.random.default_rng(0)
    for name, f in ops.items():
        for kernel in f.kernels:
            assert f'extern "C" __global__ void {kernel}(' in f.source, name
        cases = list(f.cases(np, rng, np.dtype("float64")))
        assert cases, name
        for args in cases:                               # the twin runs on every case
            f.twin(*[a.copy() if hasattr(a, "copy") else a for a in args])
    assert len(fused.sources()) == sum(len(f.dtypes) for f in ops.values())


def test_the_twins_are_the_op_by_op_math(float64):
    """Each fused op's twin against the textbook expression it replaces."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 6))
    np.testing.assert_allclose(kernels.gelu_twin(x)[0],
                               0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
                               rtol=1e-12)
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(kernels.layernorm_twin(x, w, b, 1e-5)[0],
                               (x - mu) / np.sqrt(var + 1e-5) * w + b, rtol=1e-10)
    s = rng.standard_normal((2, 5, 5))
    ref = np.where(np.triu(np.ones((5, 5), bool), 1), -np.inf, s * 0.3)
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    np.testing.assert_allclose(kernels.softmax_causal_twin(s, 0.3),
                               ref / ref.sum(-1, keepdims=True), rtol=1e-12)
    z, t = rng.standard_normal((4, 7)), np.array([1, -100, 6, 0])
    nll, lse = kernels.cross_entropy_twin(z, t, -100)
    want = np.log(np.exp(z).sum(1))
    np.testing.assert_allclose(lse, want, rtol=1e-12)
    np.testing.assert_allclose(nll, np.where(t == -100, 0, want - z[np.arange(4), t.clip(0)]),
                               rtol=1e-12)
    # padding columns past the vocabulary: out of the softmax, zero gradient
    zp = np.concatenate([z, rng.standard_normal((4, 3)) + 50], axis=1)
    nll_p, lse_p = kernels.cross_entropy_twin(zp, t, -100, 7)
    np.testing.assert_allclose(lse_p, want, rtol=1e-12)
    np.testing.assert_allclose(nll_p, nll, rtol=1e-12)
    g = kernels.cross_entropy_bwd_twin(zp, t, lse_p, -100, np.asarray(0.5), 7)
    assert not g[:, 7:].any()
    np.testing.assert_allclose(g[:, :7], kernels.cross_entropy_bwd_twin(z, t, lse, -100,
                                                                        np.asarray(0.5)))


def test_adamw_twin_is_optims_update(float64):
    rng = np.random.default_rng(2)
    p, g = rng.standard_normal(50), rng.standard_normal(50)
    ranges = [(0, 20), (30, 45)]
    mask = np.zeros(50, np.uint8)
    for a, b in ranges:
        mask[a:b] = 1
    p2, state = p.copy(), {}
    for step in (1, 2, 3):
        optim.adamw_update(p2, g, state, step, 1e-2, 0.9, beta2=0.99, eps=1e-8,
                           weight_decay=0.1, decay_ranges=ranges)
    p1, m, v = p.copy(), np.zeros(50), np.zeros(50)
    for step in (1, 2, 3):
        kernels.adamw_twin(p1, g, m, v, mask, 1e-2, 0.9, 0.99, 1e-8, 0.1, step, None, 0.0)
    np.testing.assert_allclose(p1, p2, rtol=1e-13)
    np.testing.assert_allclose(m, state["exp_avg"], rtol=1e-13)


def _grads(model, flat: bool):
    params = model.parameters()
    fired = {id(p): 0 for p in params}
    for p in params:
        p.register_grad_hook(lambda t: fired.__setitem__(id(t), fired[id(t)] + 1))
    if flat:
        optim.FlatParams(params)                  # .grad views into one zeroed buffer
    idx = np.random.default_rng(3).integers(0, 11, (2, 7))
    for _ in range(2):                            # two micro-batches accumulate
        _, loss = model(hd.tensor(idx).data, idx)
        loss.backward()
    return {n: backend.to_numpy(p.grad).copy() for n, p in model.named_parameters()}, fired


def test_gradients_added_straight_into_buffers_equal_the_engines_addition(float64):
    cfg = nn.GPTConfig(block_size=8, vocab_size=11, n_layer=2, n_head=2, n_embd=8)
    nn.manual_seed(5)
    plain, fired_plain = _grads(nn.GPT(cfg), flat=False)
    nn.manual_seed(5)
    direct, fired_direct = _grads(nn.GPT(cfg), flat=True)
    for name in plain:
        np.testing.assert_allclose(direct[name], plain[name], rtol=1e-12, err_msg=name)
    assert sorted(fired_direct.values()) == sorted(fired_plain.values())   # once per pass


def test_the_gpu_standin_counts_a_fused_op_as_its_launches(monkeypatch):
    pytest.importorskip("numpy")
    from hpcdist.bench.gpu import count
    prev = backend.device_label()
    try:
        got = count(2, 32, 8, 2, 17)
    finally:
        backend.init("cpu" if prev == "cpu" else prev)
    assert got["op by op"] > 300 and got["fused"] < got["op by op"] / 3.5, got
    # native bf16 (bf16 weights, activations and gradients; AdamW writing the bf16 copy)
    # launches no more than the fp32 step, within 5%: no conversion of any GEMM operand
    assert got["fused bf16"] <= 1.05 * got["fused"], got


def _clipped_steps(n, max_norm, fold, low=False):
    """Two AdamW steps on a flat gradient of ``n`` values clipped to ``max_norm``: by the
    optimizer's kernel as it reads it (``fold``), or by optim.clip first. (p, g, low, the
    launches of the last step, norm included, and the device reads)."""
    from hpcdist.device.surface import LAUNCHES, READS
    rng = np.random.default_rng(4)
    p = backend.to_device(rng.standard_normal(n).astype(np.float32))
    g0 = backend.to_device((rng.standard_normal(n) * 3).astype(np.float32))
    out = backend.xp().zeros(n, backend.bfloat16()) if low else None
    state = {}
    for step in (1, 2):
        g = g0.copy()
        launches, reads = LAUNCHES.count, READS.count
        norm = optim.grad_norm(g)
        if not fold:
            optim.clip(g, norm, max_norm)
        optim.adamw_update(p, g, state, step, 1e-2, weight_decay=0.1, low=out,
                           clipping=(norm, max_norm) if fold else None)
        launches, reads = LAUNCHES.count - launches, READS.count - reads
    return p, (g, g0), out, launches, reads


@pytest.mark.parametrize("device", ["cpu", "standin"])
@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_adamw_clips_the_gradient_as_it_reads_it(device, max_norm):
    """AdamW given the clipping (``Optimizer.step``'s ``clipping``) steps the parameters as
    optim.clip and then a step do, and leaves the gradient as backward wrote it: on the GPU
    stand-in bit for bit, the norm one launch on the device and never read, the step one
    launch (ADAMW, and ADAMW_LOW writing the bf16 copy); on the CPU by the numba kernel (its
    float ops may be reordered: within 1e-6), clipped (factor 2e-3) and within the norm."""
    prev = backend.device_label()
    backend.init(device)
    try:
        for low in (False, True) if device == "standin" else (False,):
            p, (g, g0), out, launches, reads = _clipped_steps(100_003, max_norm, True, low)
            p_ref, (g_ref, _), out_ref, launches_ref, _ = _clipped_steps(100_003, max_norm,
                                                                         False, low)
            p, p_ref, g, g0 = map(backend.to_numpy, (p, p_ref, g, g0))
            assert np.array_equal(g, g0)                    # the gradient as it was
            if device == "standin":
                assert np.array_equal(p, p_ref)
                if low:
                    assert np.array_equal(backend.to_numpy(out).view(np.uint16),
                                          backend.to_numpy(out_ref).view(np.uint16))
                assert (launches, reads) == (2, 0), (launches, reads)
                assert launches_ref == 7        # (clip's five, factor 1 or not)
            else:
                np.testing.assert_allclose(p, p_ref, rtol=1e-6, atol=1e-7)
                assert kernels.ADAMW._cpu_checked["float32"]    # (the numba kernel ran)
            if max_norm == 1.0:                 # the clipping acted: not the unclipped step
                unclipped = _clipped_steps(100_003, 0.0, True, low)[0]
                assert not np.allclose(p, backend.to_numpy(unclipped), rtol=1e-3)
    finally:
        backend.init("cpu" if prev == "cpu" else prev)


def test_adamw_writes_the_bf16_compute_copy_in_its_own_kernel():
    """Mixed precision on the device path: the optimizer's kernel (ADAMW_LOW) leaves the
    model's bf16 weights equal to the fp32 master rounded to bf16 after every step, and the
    run equals the one that copies the master over after the step (the CPU's way)."""
    from hpcdist.device import standin
    from hpcdist.parallel.mixed_precision import MixedPrecision
    prev = backend.device_label()
    backend.init("standin")
    try:
        cfg = nn.GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=16)
        runs = []
        for attached in (True, False):
            nn.manual_seed(3)
            model = nn.GPT(cfg)
            mp = MixedPrecision(model.parameters(), "bf16")
            assert mp.mixed and mp.compute.data.dtype.name == "bfloat16"
            opt = optim.AdamW(mp.master, lr=1e-2)
            if attached:
                mp.attach(opt)
            idx = backend.to_device(np.random.default_rng(0).integers(0, 11, (2, 8)))
            losses = []
            for _ in range(3):
                mp.zero_grad()
                _, loss = model(idx, idx)
                loss.backward()
                mp.master.grad[...] = mp.compute.grad
                standin.LAUNCHES.count = 0
                opt.step()
                mp.after_step()
                launches = standin.LAUNCHES.count
                losses.append(float(backend.to_numpy(loss.data).astype(np.float64)))
                want = backend.round_to_bf16(backend.to_numpy(mp.master.data))
                np.testing.assert_array_equal(
                    backend.to_numpy(mp.compute.data).astype(np.float32), want)
            runs.append((losses, launches, backend.to_numpy(mp.master.data)))
        (a, la, pa), (b, lb, pb) = runs
        assert a == b and (pa == pb).all()
        assert la < lb, (la, lb)                 # the copy's own pass is gone
    finally:
        backend.init("cpu" if prev == "cpu" else prev)


def _to_bf16_kernel(name):
    """The to_bf16 kernel's work, on host memory: float -> bf16 words."""
    assert name == "to_bf16"

    def run(grid, block, args):
        x, y, n = args
        y[...] = (backend.round_to_bf16(x).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return run


def test_the_bf16_gemm_hands_cublas_its_operands_column_major(monkeypatch):
    """The launcher's layout logic (which operand first, transposes, leading dimensions)
    against cuBLAS's column-major contract, with a stand-in gemmEx on host memory: C-
    contiguous and transposed operands, odd shapes, as ops.linear's forward and backward
    pass them."""
    from hpcdist.device.kernels import gemm
    prev = backend.device_label()
    calls = []
    monkeypatch.setattr(gemm, "lib", fake_cublas(calls))
    backend.init("standin")
    try:
        xp, rng = backend.xp(), np.random.default_rng(3)
        for n, k, m in ((1, 1, 1), (5, 3, 7), (33, 64, 17)):
            a = rng.standard_normal((n, k)).astype(np.float32)
            b = rng.standard_normal((k, m)).astype(np.float32)
            want = backend.to_numpy(gemm.gemm_twin(xp.asarray(a), xp.asarray(b)))
            for left in (xp.asarray(a), xp.asarray(a.T.copy()).T):
                for right in (xp.asarray(b), xp.asarray(b.T.copy()).T):
                    got = backend.to_numpy(gemm._gemm_launch(_to_bf16_kernel, left, right))
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        backend.init("cpu" if prev == "cpu" else prev)
    assert {c[8:] for c in calls} == {(14, 14, 0, 68, 99)}     # bf16 in, fp32 out and compute
    assert {c[:2] for c in calls} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_a_bf16_run_multiplies_through_the_bf16_gemm(monkeypatch):
    """bf16 emulated (float32 storage) sends every 2-D-foldable GEMM of the model through
    BF16_GEMM, whose twin is the rounded product; other precisions never do."""
    from hpcdist.device.kernels import gemm
    seen = []
    monkeypatch.setattr(gemm.BF16_GEMM, "twin", lambda a, b: seen.append(a.shape) or
                        gemm.gemm_twin(a, b))
    x, w = np.ones((2, 3, 4), np.float32), np.ones((4, 5), np.float32)
    backend.reset_precision(emulated=True)
    try:
        assert kernels.matmul(x, w).shape == (2, 3, 5) and seen == [(6, 4)]
    finally:
        backend.reset_precision()
    kernels.matmul(x, w)
    assert seen == [(6, 4)]


def test_the_tiled_twins_are_attention_as_written(float64):
    """The flash twins (a block of queries at a time, O(T) memory) against the whole (T, T)
    definition; grouped-query attention against multi-head attention on repeated kv heads;
    a block at positions against the same rows of the whole; the backward against finite
    differences of the forward."""
    from hpcdist.device.kernels import flash, flash_blocks
    rng = np.random.default_rng(3)
    B, T, nh, nkv, hs = 2, 37, 6, 2, 4
    qkv = rng.standard_normal((B, T, (nh + 2 * nkv) * hs))
    q, k, v = (a.reshape(B, T, -1) for a in flash._split(qkv, nh, nkv))
    rep = lambda a: np.repeat(a.reshape(B, T, nkv, hs), nh // nkv, axis=2).reshape(B, T, -1)  # noqa: E731
    mha = np.concatenate([q, rep(k), rep(v)], axis=-1)
    want_y, want_lse, _ = kernels.attention_twin(mha, nh, 0.4)
    y, lse = kernels.flash_twin(qkv, nh, nkv, 0.4)
    np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    by, bl = flash_blocks.block_twin(q[:, 20:], k, v, nh, nkv, 0.4, 20, 0)
    np.testing.assert_allclose(by, want_y[:, 20:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bl, want_lse[:, :, 20:], rtol=1e-12)
    none, nl = flash_blocks.block_twin(q[:, :5], k[:, 10:], v[:, 10:], nh, nkv, 0.4, 0, 10)
    assert not none.any() and np.isneginf(nl).all()                 # keys all after: none seen
    dy = rng.standard_normal(y.shape)
    d = kernels.flash_bwd_twin(qkv, y, dy, lse, nh, nkv, 0.4)
    for idx in ((0, 3, 1), (1, 30, nh * hs + 5), (0, 36, (nh + nkv) * hs + 2)):
        e = np.zeros_like(qkv)
        e[idx] = 1e-6
        fd = ((kernels.flash_twin(qkv + e, nh, nkv, 0.4)[0] -
               kernels.flash_twin(qkv - e, nh, nkv, 0.4)[0]) * dy).sum() / 2e-6
        assert abs(fd - d[idx]) < 1e-6 * max(1.0, abs(fd)), (idx, fd, d[idx])


def test_the_twins_by_chunks_of_rows_equal_them_whole(float64, monkeypatch):
    """The twins bound their scores by taking a chunk of query rows at a time (the ring's
    blocks too: a (T/c, T/c) block at long context): chunks of 7 rows give what one chunk
    gives, forward and backward, rows that see no key included."""
    from hpcdist.device.kernels import flash, flash_blocks
    rng = np.random.default_rng(5)
    B, Tq, Tk, nh, nkv, hs = 2, 30, 26, 4, 2, 8
    q = rng.standard_normal((B, Tq, nh * hs))
    k, v = (rng.standard_normal((B, Tk, nkv * hs)) for _ in range(2))
    dy = rng.standard_normal(q.shape)
    qkv = rng.standard_normal((B, Tq, (nh + 2 * nkv) * hs))
    lse, dvec = rng.standard_normal((B, nh, Tq)), rng.standard_normal((B, nh, Tq))

    def run():
        y, l = flash_blocks.block_twin(q, k, v, nh, nkv, 0.3, 4, 10)   # rows 0-5 see none
        grads = flash_blocks.block_bwd_twin(q, k, v, dy, lse, dvec, nh, nkv, 0.3, 4, 10)
        fy, fl = kernels.flash_twin(qkv, nh, nkv, 0.3)
        fd = kernels.flash_bwd_twin(qkv, fy, dy, fl, nh, nkv, 0.3)
        return [y, l, *grads, fy, fl, fd]
    whole = run()
    for module in (flash, flash_blocks):
        monkeypatch.setattr(module, "_rows_per_block", lambda *a, **k: 7)
    chunked = run()
    assert np.isneginf(whole[1][:, :, :6]).all()
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def test_an_attention_path_that_cannot_run_here_gives_way_to_flash_and_says_so(monkeypatch):
    """cuDNN is a candidate only when both its directions passed their self-check (a refused
    one would run as its slow twin); an asked path that is no candidate runs flash, and the
    run's end says flash, not the path asked for."""
    from hpcdist.device.kernels import attention, cudnn_attention
    monkeypatch.setattr(backend, "device_label", lambda: "gpu")
    monkeypatch.setattr(attention, "kind", lambda dtype: "bf16")
    monkeypatch.setattr(cudnn_attention, "why_not", lambda: None)
    qkv = np.zeros((2, 8, 3 * 2 * 16), np.float32)
    for passed, want in ((False, ["flash", "gemms"]), (True, ["flash", "gemms", "cudnn"])):
        monkeypatch.setattr(cudnn_attention, "passed", lambda dtype="float32", p=passed: p)
        assert attention.candidates(qkv, 2, 2) == want
    monkeypatch.setattr(cudnn_attention, "passed", lambda dtype="float32": False)
    # the GEMM path keeps (T, T): auto weighs it only up to T 14 x 16 here; asked, at any T
    long = np.zeros((1, 14 * 16 + 1, 3 * 2 * 16), np.float32)
    assert attention.candidates(long, 2, 2) == ["flash"]
    assert attention.candidates(long[:, :-1], 2, 2) == ["flash", "gemms"]
    try:
        attention.configure("gemms")
        assert attention.candidates(long, 2, 2) == ["flash", "gemms"]
        attention.configure("cudnn")
        assert attention.path_for(qkv, 2, 2, 0.25) == "flash"
        assert attention.choice() == "flash at B, T = 2, 8"
        monkeypatch.setattr(cudnn_attention, "passed", lambda dtype="float32": True)
        attention.configure("cudnn")
        assert attention.path_for(qkv, 2, 2, 0.25) == "cudnn"
        assert attention.choice() == "cudnn at B, T = 2, 8"
    finally:
        attention.configure("auto")
