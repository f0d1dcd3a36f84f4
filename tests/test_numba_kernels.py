"""The fused ops' CPU kernels (numba, hpcdist/device/kernels/cpu.py) against their NumPy twins:
the GPU self-check's cases, and the edges (one row, one column, T = 1, a sequence longer than
one attention block, saturated GELU, ignored targets, a constant LayerNorm row) in float32 and
float64; column sums that add in one order at any thread count; the dispatch (size, dtype,
a kernel that disagrees is refused); a GPT trained with them equal to the twins in float64."""
import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed (the CPU kernels need it)")

from hpcdist import nn, optim  # noqa: E402
from hpcdist.device import backend, fused  # noqa: E402
from hpcdist.device import kernels  # noqa: E402
from hpcdist.device.kernels import attention, cpu, cpu_attention, elementwise as el, rows  # noqa
from hpcdist.device.kernels import cpu_flat  # noqa: E402
from hpcdist.host import threads  # noqa: E402

OPS = sorted(name for name, op in fused.registry().items() if op.cpu is not None)


def _err(want, got):
    return fused._error(np.asarray(want), np.asarray(got))


def _agree(op, args, dtype, tol=None):
    """The CPU kernel's outputs equal the twin's (the ones the self-check compares)."""
    copy = lambda: [a.copy() if isinstance(a, np.ndarray) else a for a in args]  # noqa: E731
    want = fused._tuple(op.twin(*copy()))[:op.compare]
    got = fused._tuple(op.cpu(*copy()))[:op.compare]
    tol = tol if tol is not None else (op.tolerance if dtype == np.float32 else 1e-12)
    for w, g in zip(want, got):
        assert w.shape == g.shape and g.dtype == w.dtype
        assert _err(w, g) <= tol, (op.name, _err(w, g))


def test_every_fused_op_but_the_gemms_has_a_cpu_kernel():
    # (the bf16 conversions serve cuBLAS on a GPU, the CPU rounds with backend.round_to_bf16;
    # TF32 is a GPU's alone; a ring step's blocks run their twin on the CPU, the ring's own
    # NumPy, as the ring did; AdamW writing the bf16 copy serves a GPU's mixed precision, the
    # CPU copies after its AdamW kernel; two gradients' sum and a bf16 gradient's widening are
    # one NumPy operation each on the CPU, their twins, where a GPU wanted 16 bytes a thread;
    # the schedule and AdamW reading it from the device serve a step replayed as a CUDA graph,
    # which the CPU never makes; fp8's quantization runs its twin's NumPy on the CPU, and the
    # loss's mean over the scored positions, a few NumPy sums, its twin)
    assert set(OPS) == {n for n, op in fused.registry().items() if not op.library and n not in
                        ("to_bf16", "round_bf16", "from_bf16", "flash_fwd_tf32", "flash_bwd_tf32",
                         "adamw_low", "add2", "widen", "lr_schedule", "adamw_sched",
                         "adamw_low_sched", "cross_entropy_mean")
                        and not n.startswith(("flash_block", "fp8_"))}


@pytest.mark.parametrize("name,dtype", [(n, dt) for n in OPS for dt in ("float32", "float64")
                                        if dt in fused.registry()[n].dtypes])
def test_cpu_kernel_equals_its_twin_on_the_self_check_cases(name, dtype):
    op = fused.registry()[name]
    worst = op.worst_error(dtype, run=op.cpu)
    assert worst <= (op.tolerance if dtype == "float32" else 1e-12), worst


@pytest.mark.parametrize("blas_inside", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_edges(dtype, blas_inside, monkeypatch):
    """(attention: BLAS called from inside the kernel, cpu_gemm.py, and NumPy's GEMMs
    between numba's row kernels where NumPy's BLAS cannot be called so)"""
    if not blas_inside:
        monkeypatch.setattr(cpu_attention, "_blas_args", lambda dtype: None)
    elif cpu_attention._blas_args(np.dtype(dtype)) is None:
        pytest.skip("NumPy's BLAS cannot be called from numba here (host/blas.py)")
    rng = np.random.default_rng(1)
    for shape in ((1,), (1, 1), (2, 3, 129), (4097,)):
        x = (rng.standard_normal(shape) * 6).astype(dtype)
        x.flat[0], x.flat[-1] = 40.0, -40.0                  # saturated tanh both ways
        g = rng.standard_normal(shape).astype(dtype)
        _agree(kernels.GELU_FWD, (x,), dtype)
        _agree(kernels.GELU_BWD, (x, g), dtype, tol=2e-6 if dtype == np.float32 else None)
        _agree(kernels.BIAS_GELU, (x, rng.standard_normal(shape[-1]).astype(dtype)), dtype)
        out = rng.standard_normal(shape).astype(dtype)
        _agree(kernels.BIAS_RESIDUAL, (out, None, x), dtype)
        _agree(kernels.BIAS_RESIDUAL, (out, g.reshape(-1, shape[-1])[0], None), dtype)
    for R in (1, 63, 64, 65, 1000):
        g = rng.standard_normal((R, 5)).astype(dtype)
        _agree(kernels.COLSUM_ADD, (g, np.ones(5, dtype)), dtype)


def test_adamw_without_decay_with_a_mask_and_clipped(float64):
    rng = np.random.default_rng(2)
    n = 5000
    p, g, m = (rng.standard_normal(n) for _ in range(3))
    v = np.abs(rng.standard_normal(n))
    mask = (rng.random(n) < 0.3).astype(np.uint8)
    # not clipped; clipped by a Python float norm (factor 0.0141) and by a 0-d one (1: none)
    for decay, wd, clip in ((mask, 0.1, (None, 0.0)), (mask, 0.0, (70.7, 1.0)),
                            (np.ones(n, np.uint8), 0.2, (np.asarray(0.5), 1.0))):
        _agree(kernels.ADAMW, (p, g, m, v, decay, 3e-3, 0.9, 0.95, 1e-8, wd, 7, *clip),
               np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_edges(dtype):
    rng = np.random.default_rng(3)
    for shape in ((1, 1), (1, 7), (3, 1), (130, 33)):
        x = rng.standard_normal(shape).astype(dtype)
        x[0] = 2.5                                          # a constant row: variance 0
        w, b = rng.standard_normal(shape[-1]).astype(dtype), rng.standard_normal(shape[-1])
        y, mean, rstd, _ = kernels.LAYERNORM_FWD.cpu(x, w, b.astype(dtype), 1e-5)
        _agree(kernels.LAYERNORM_FWD, (x, w, b.astype(dtype), 1e-5), dtype)
        g = rng.standard_normal(shape).astype(dtype)
        # (the constant row's rstd is 1/sqrt(eps) = 316: its gradient's rounding scales so)
        scale = float(rstd.max())
        _agree(kernels.LAYERNORM_BWD, (g, x, w, mean, rstd), dtype,
               tol=(1e-6 if dtype == np.float32 else 1e-14) * scale)
    for shape, past in (((1, 1, 1, 1), 0), ((2, 1, 1, 9), 8), ((1, 3, 7, 7), 0),
                        ((2, 2, 5, 12), 7)):
        x = rng.standard_normal(shape).astype(dtype)
        _agree(kernels.SOFTMAX_CAUSAL_FWD, (x, 0.7, past), dtype)
        y = kernels.SOFTMAX_CAUSAL_FWD.twin(x, 0.7, past)
        _agree(kernels.SOFTMAX_CAUSAL_BWD, (rng.standard_normal(shape).astype(dtype), y, 0.7),
               dtype)
    # the softmax kernels work in place: the op's inputs stay the caller's (a strided one too)
    x = rng.standard_normal((2, 9, 9)).astype(dtype).swapaxes(1, 2)
    g = rng.standard_normal((2, 9, 9)).astype(dtype)
    x0, g0 = x.copy(), g.copy()
    y = kernels.SOFTMAX_CAUSAL_FWD.cpu(x, 0.7, 0)
    np.testing.assert_allclose(y, kernels.SOFTMAX_CAUSAL_FWD.twin(x0, 0.7, 0), rtol=1e-5)
    kernels.SOFTMAX_CAUSAL_BWD.cpu(g, y, 0.7)
    assert np.array_equal(x, x0) and np.array_equal(g, g0)
    for R, V, vocab in ((1, 1, None), (4, 3, None), (9, 300, None), (4, 3, 1), (9, 320, 300)):
        z = (rng.standard_normal((R, V)) * 5).astype(dtype)
        n = vocab or V                               # (past ``vocab``: padding columns)
        for t in (rng.integers(0, n, R), np.full(R, -100), np.full(R, n - 1)):
            _agree(kernels.CROSS_ENTROPY_FWD, (z, t, -100, vocab), dtype)
            lse = kernels.CROSS_ENTROPY_FWD.twin(z, t, -100, vocab)[1]
            _agree(kernels.CROSS_ENTROPY_BWD, (z, t, lse, -100, np.asarray(0.5, dtype), vocab),
                   dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("budget", [1 << 30, 3000])       # every pair at once; one head a block
@pytest.mark.parametrize("blas_inside", [True, False])    # the BLAS kernel; NumPy's GEMMs
def test_attention_in_blocks_equals_the_twin(dtype, budget, blas_inside, monkeypatch):
    monkeypatch.setattr(cpu, "ATTENTION_BYTES", budget)
    if not blas_inside:
        monkeypatch.setattr(cpu_attention, "_blas_args", lambda dtype: None)
    elif cpu_attention._blas_args(np.dtype(dtype)) is None:
        pytest.skip("NumPy's BLAS is not callable from numba here")
    rng = np.random.default_rng(4)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for B, T, nh, hs in ((1, 1, 1, 1), (2, 7, 3, 4), (1, 130, 2, 8), (3, 300, 2, 5)):
        qkv = rng.standard_normal((B, T, 3 * nh * hs)).astype(dtype)
        y, lse, att = attention.attention_twin(qkv, nh, 0.35)
        cy, clse, kept = cpu_attention.attention_fwd(qkv, nh, 0.35)
        assert kept is None and _err(y, cy) <= tol and _err(lse, clse) <= tol
        dy = rng.standard_normal(y.shape).astype(dtype)
        want = attention.attention_bwd_twin(qkv, y, dy, lse, nh, 0.35, att)
        assert _err(want, cpu_attention.attention_bwd(qkv, cy, dy, clse, nh, 0.35)) <= tol


def test_attention_blocks_cover_every_pair_and_query_once():
    for B, nh, T, isz, budget in ((3, 4, 64, 4, 1 << 30), (3, 4, 64, 4, 40000),
                                  (2, 5, 100, 8, 90000), (1, 1, 1, 4, 1)):
        cpu.ATTENTION_BYTES, old = budget, cpu.ATTENTION_BYTES
        try:
            blocks = list(cpu_attention.blocks(B, nh, T, isz))
            seen = [(b, h) for b0, b1, h0, h1 in blocks
                    for b in range(b0, b1) for h in range(h0, h1)]
            assert sorted(seen) == [(b, h) for b in range(B) for h in range(nh)]
        finally:
            cpu.ATTENTION_BYTES = old
        q = [i for i0, i1 in cpu_attention.query_blocks(T) for i in range(i0, i1)]
        assert q == list(range(T))


def test_column_sums_add_in_one_order_at_any_thread_count(monkeypatch):
    """The threaded kernels at 1 and 2 threads give the same bits, and the column sums of the
    serial ones (a rank of one thread) too: partial sums are per block of rows, not per
    thread. (A row's own sum may be vectorised differently in the two codes.)"""
    import numba
    from hpcdist.device.kernels import cpu_jit
    rng = np.random.default_rng(5)
    g = rng.standard_normal((1000, 37)).astype(np.float32)
    x = rng.standard_normal((1000, 37)).astype(np.float32)
    w = rng.standard_normal(37).astype(np.float32)
    mean, rstd = x.mean(1), 1 / x.std(1)
    outs = []
    for variant, n in ((cpu_jit.PARALLEL, 1), (cpu_jit.PARALLEL, 2), (cpu_jit.SERIAL, 1)):
        monkeypatch.setattr(cpu, "jit", lambda: variant)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        outs.append((cpu._colsum(g), *cpu.layernorm_bwd(g, x, w, mean, rstd)))
    monkeypatch.setattr(cpu, "_threads", 0)        # the next call sets the rank's count
    for a, b in zip(outs[0], outs[1]):                  # one code at 1 and 2 threads
        assert np.array_equal(a, b)
    colsum, gx, gw, gb = outs[2]                       # the serial code: its own row sums
    assert np.array_equal(colsum, outs[0][0]) and np.array_equal(gw, outs[0][2])
    assert np.array_equal(gb, outs[0][3]) and _err(outs[0][1], gx) < 1e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_clipping_adds_in_one_order_and_scales_as_numpy(dtype, monkeypatch):
    """Clipping's kernels over a flat gradient (several 65536-element blocks and a rest):
    the sum of squares the same bits threaded at 1 and 2 threads and serially, within 1e-12
    of NumPy's float64 sum; ``optim.clip`` takes the scaling kernel and writes NumPy's
    ``grad *= scale`` bit for bit."""
    import numba
    from hpcdist.device.kernels import cpu_jit
    cpu.jit()                                          # (imports every kernel module)
    rng = np.random.default_rng(9)
    g = rng.standard_normal(3 * 65536 + 1234).astype(dtype)
    sums = []
    for variant, n in ((cpu_jit.PARALLEL, 1), (cpu_jit.PARALLEL, 2), (cpu_jit.SERIAL, 1)):
        monkeypatch.setattr(cpu_flat, "jit", lambda: variant)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        sums.append(cpu_flat.sumsq(g))
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "_threads", 0)        # the next call sets the rank's count
    want = float(np.sum(g.astype(np.float64) ** 2))
    assert sums[0] == sums[1] == sums[2] and abs(sums[0] - want) <= 1e-12 * want
    taken = []
    monkeypatch.setattr(cpu_flat, "scale",
                        lambda x, s, f=cpu_flat.scale: taken.append(f(x, s)) or taken[-1])
    got, norm = g.copy(), float(np.sqrt(want))         # (a Python float, as global_norm's)
    optim.clip(got, norm, 2.5)
    ref = g.copy()
    ref *= kernels.clip_factor(norm, 2.5)
    assert taken == [True] and got.dtype == dtype and np.array_equal(got, ref)
    assert not np.array_equal(got, g)


def test_the_kernels_take_the_ranks_thread_count(monkeypatch):
    """A rank of one thread runs the serial kernels; of two, the threaded ones on two."""
    import numba
    from hpcdist.device.kernels import cpu_jit
    monkeypatch.setattr(cpu, "_threads", 0)
    monkeypatch.setattr(threads, "threads", 1)
    assert cpu.jit() is cpu_jit.SERIAL and numba.get_num_threads() == 1
    if numba.config.NUMBA_NUM_THREADS >= 2:
        monkeypatch.setattr(threads, "threads", 2)
        assert cpu.jit() is cpu_jit.PARALLEL and numba.get_num_threads() == 2


def test_which_ops_the_cpu_kernels_take(monkeypatch):
    monkeypatch.setattr(cpu, "MIN_SIZE", 100)
    assert cpu.wanted(np.zeros(100, np.float32)) and cpu.wanted(np.zeros((10, 10)))
    assert not cpu.wanted(np.zeros(99, np.float32))
    assert not cpu.wanted(np.zeros(1000, np.float16))
    monkeypatch.setenv("HPCDIST_CPU_KERNELS", "0")
    assert not cpu.wanted(np.zeros(1000)) and "HPCDIST_CPU_KERNELS=0" in cpu.describe()


def test_a_cpu_kernel_that_disagrees_is_refused_and_the_twin_runs(monkeypatch):
    op = kernels.GELU_FWD
    monkeypatch.setattr(cpu, "MIN_SIZE", 1)
    monkeypatch.setattr(op, "cpu", lambda x: (x * 2.0, None))
    monkeypatch.setattr(op, "_cpu_checked", {})
    x = np.linspace(-3, 3, 50)
    assert np.array_equal(op(x)[0], el.gelu_twin(x.copy())[0])
    assert "gelu_fwd (cpu)" in fused.refusals()
    fused._refused.pop("gelu_fwd (cpu)", None)


def _train(steps=3):
    nn.manual_seed(0)
    cfg = nn.GPTConfig(block_size=40, vocab_size=50, n_layer=2, n_head=2, n_embd=32)
    model = nn.GPT(cfg)
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        idx = rng.integers(0, 50, (3, 40))
        opt.zero_grad()
        _, loss = model(idx, np.roll(idx, -1, 1))
        loss.backward()
        opt.step()
        losses.append(float(loss.data))
    return losses, [p.data.copy() for p in model.parameters()]


def test_a_gpt_trained_on_the_cpu_kernels_equals_the_twins(float64, monkeypatch):
    """Every op of the step through the kernels (size floor 1) against the twins: float64."""
    assert backend.default_float() == np.float64
    monkeypatch.setenv("HPCDIST_CPU_KERNELS", "0")
    want_loss, want_params = _train()
    monkeypatch.setenv("HPCDIST_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu, "MIN_SIZE", 1)
    calls = {}
    for name, op in fused.registry().items():
        if op.cpu is not None:
            monkeypatch.setattr(op, "cpu", _counting(op.cpu, name, calls))
    got_loss, got_params = _train()
    assert {"flash_fwd", "flash_bwd", "adamw", "layernorm_bwd", "bias_gelu_fwd",
            "gelu_bwd_colsum", "cross_entropy_fwd", "cross_entropy_bwd"} <= set(calls)
    np.testing.assert_allclose(got_loss, want_loss, rtol=0, atol=1e-10)
    for a, b in zip(got_params, want_params):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def _counting(fn, name, calls):
    def run(*args):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args)
    return run


_NO_LOADS_IN_STEPS = r"""
import numpy as np
from hpcdist import nn, optim
from hpcdist.device.kernels import cpu, cpu_gemm, cpu_jit
from hpcdist.host import threads
threads.threads = 2                            # (both variants: split GEMMs and whole ones)
def signatures():
    return {(id(mod), k): set(v.signatures) for mod in (cpu_jit.PARALLEL, cpu_jit.SERIAL,
            cpu_jit, cpu_gemm) for k, v in vars(mod).items() if hasattr(v, "signatures")}
cpu.ready("float32")
before = signatures()
nn.manual_seed(0)
model = nn.GPT(nn.GPTConfig(block_size=64, vocab_size=512, n_layer=1, n_head=2, n_embd=64))
flat = optim.FlatParams(model.parameters())
opt = optim.AdamW(flat, lr=1e-3)
idx = np.random.default_rng(0).integers(0, 512, (8, 64))
for _ in range(2):                             # as the training loop: clipped as stepped
    opt.zero_grad(lazy=True)
    _, loss = model(idx, idx)
    loss.backward()
    opt.step(clipping=(optim.grad_norm(flat.grad), 1.0))
new = {k: s - before.get(k, set()) for k, s in signatures().items()}
print({k[1]: [str(t) for t in s] for k, s in new.items() if s})
"""


def test_ready_loads_every_kernel_signature_a_training_step_uses():
    """After cpu.ready, a step loads no kernel (numba compiles one per dtype and layout; a
    pair first met inside the first step cost 80 ms there). Its own process: this one's
    kernels are loaded already by the tests before."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _NO_LOADS_IN_STEPS], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "{}"
