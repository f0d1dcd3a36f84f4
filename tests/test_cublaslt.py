"""A linear layer's GEMM with its epilogue through cuBLASLt (kernels/cublaslt.py,
kernels/gemm_epilogue.py), without a GPU: every descriptor built by the real libcublasLt's
host functions (the nvidia-cublas wheel CuPy installs), the matmul itself by a stand-in that
reads them back and computes what cuBLASLt documents (tests/cublas_standin.py), against each
op's twin — C-contiguous and transposed operands, fp32, TF32's compute type and bf16, beta 0
and 1. Then on the GPU stand-in a GPT step through the linear layers: the same gradients as
the passes apart, one launch for each GEMM with its epilogue."""
import numpy as np
import pytest

from hpcdist.device import backend, fused
from hpcdist.device.kernels import cublaslt, gemm_epilogue as ge

from cublas_standin import cublaslt_path, fake_cublaslt


@pytest.fixture
def lt(monkeypatch):
    """(the matmuls' record) with cuBLASLt's host functions real and its GPU calls faked, on
    the GPU stand-in (whose arrays live in host memory)."""
    path = cublaslt_path()
    if path is None:
        pytest.skip("the nvidia-cublas wheel (libcublasLt) is not installed: make cupy "
                    "installs it")
    pytest.importorskip("ml_dtypes")
    monkeypatch.setattr(cublaslt, "library_path", lambda: path)
    monkeypatch.setattr(cublaslt, "_found", {})
    monkeypatch.setattr(cublaslt, "_plans", {})
    monkeypatch.setattr(cublaslt, "_handle_made", [])
    calls = []
    monkeypatch.setattr(cublaslt, "api", fake_cublaslt(cublaslt.api, calls))
    prev = backend.device_label()
    backend.init("standin")
    yield calls
    backend.init(prev)


LAUNCHERS = {"bias": ge._bias_launch, "gelu": ge._gelu_launch, "dgelu": ge._dgelu_launch,
             "bgrad": ge._bgrad_launch}
CASES = {"bias": ge._bias_cases, "gelu": ge._gelu_cases, "dgelu": ge._dgelu_cases,
         "bgrad": ge._bgrad_cases}
TWINS = {"bias": ge.gemm_bias_twin, "gelu": ge.gemm_bias_gelu_twin,
         "dgelu": ge.gemm_dgelu_bgrad_twin, "bgrad": ge.gemm_bgrad_twin}
EPILOGUE = {"bias": "bias", "gelu": "gelu_aux_bias", "dgelu": "dgelu_bgrad", "bgrad": "bgrada"}


@pytest.mark.parametrize("kind", ["bias", "gelu", "dgelu", "bgrad"])
@pytest.mark.parametrize("dtype,tf32", [("float32", False), ("float32", True),
                                        ("bfloat16", False)])
def test_each_epilogue_equals_its_twin_through_the_real_descriptors(lt, kind, dtype, tf32):
    """Every self-check case of the op through the launcher: the outputs equal the twin's
    (bf16: to a rounding of the output), the epilogue and transposes cuBLASLt is told are
    the ones the contract needs, the compute type is TF32's where asked."""
    xp, dt = backend.xp(), backend.dtype(dtype)
    n = 0
    for args in CASES[kind](xp, np.random.default_rng(3), dt):
        want = TWINS[kind](*[fused._copy(a) for a in args])
        got = LAUNCHERS[kind](None, *[fused._copy(a) for a in args],
                              tf32=tf32)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for w, g in zip(want, got):
            w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
            assert w.shape == g.shape
            tol = 8e-3 if dtype == "bfloat16" else 1e-5
            assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), (kind, args[0].shape)
        n += 1
    assert n >= 8 and len(lt) == n
    assert {c[5] for c in lt} == {cublaslt.EPILOGUES[EPILOGUE[kind]]}
    assert {(c[0], c[1]) for c in lt} >= ({(0, 1)} if kind == "bgrad" else {(0, 0), (1, 1)})
    assert {c[6] for c in lt} == {cublaslt.COMPUTE["32F_FAST_TF32" if tf32 else "32F"]}


def test_a_wrong_vector_is_caught(lt):
    """The check can fail: a bias's gradient summed over the wrong axis differs."""
    xp = backend.xp()
    x = xp.asarray(np.random.default_rng(0).standard_normal((24, 16)).astype(np.float32))
    g = xp.asarray(np.random.default_rng(1).standard_normal((24, 8)).astype(np.float32))
    into, vec = xp.zeros((16, 8), np.float32), xp.zeros(8, np.float32)
    ge._bgrad_launch(None, x.T, g, into, vec, True)
    np.testing.assert_allclose(vec, g.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(into, x.T @ g, rtol=1e-5, atol=1e-5)
    assert not np.allclose(vec[:8], x.sum(axis=0)[:8])


def test_a_plan_is_made_once_per_shape_and_alignment(lt):
    """Plans are kept: the same shape twice is one heuristic query; a bias at another
    alignment (a view 2 bytes in) is another plan."""
    xp, rng = backend.xp(), np.random.default_rng(2)
    a = xp.asarray(rng.standard_normal((8, 16)).astype(np.float32))
    b = xp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    bias = xp.asarray(rng.standard_normal(9).astype(np.float32))
    ge._bias_launch(None, a, b, bias[:8])
    ge._bias_launch(None, a, b, bias[:8])
    assert len(cublaslt._plans) == 1
    ge._bias_launch(None, a, b, bias[1:])
    assert len(cublaslt._plans) == 2


def _gpt_grads(monkeypatch, lt_on: bool):
    """One bf16 GPT step's parameter gradients on the GPU stand-in, and its launches."""
    from hpcdist.bench import gpu
    from hpcdist.device import standin
    monkeypatch.setenv("HPCDIST_CUBLASLT", "1" if lt_on else "0")
    backend.reset_precision()
    step, model = gpu._step_fn(2, 64, 16, 2, 96, 2, precision="bf16")
    step()
    standin.LAUNCHES.count = 0
    step()
    launches = standin.LAUNCHES.count
    return {n: np.asarray(p.grad, np.float64) for n, p in model.named_parameters()}, launches


def test_a_bf16_gpt_step_takes_seven_launches_fewer_a_layer_same_gradients(monkeypatch):
    """Forward: the q|k|v bias, the MLP's bias + GELU, its projection's bias + residual in
    their GEMMs; backward: three biases' gradients in their weights' GEMMs, the GELU's
    backward and its bias's gradient in the projection's input-gradient GEMM (the device's
    zero_grad leaves the biases freshly zeroed: an epilogue may write them). The gradients
    equal the passes apart's bit for bit: the twins are the passes apart's arithmetic, so the
    stand-in's numbers do not depend on the epilogues (nor on a bias's buffer being fresh,
    which a CUDA graph replaying a micro-batch sees differently from eager steps)."""
    prev = backend.device_label()
    backend.init("standin")
    try:
        with_lt, n_lt = _gpt_grads(monkeypatch, True)
        apart, n_apart = _gpt_grads(monkeypatch, False)
    finally:
        backend.reset_precision()
        backend.init(prev)
    assert n_apart - n_lt == 7 * 2, (n_apart, n_lt)
    assert with_lt.keys() == apart.keys()
    for name, g in apart.items():
        np.testing.assert_array_equal(with_lt[name], g, err_msg=name)
    assert any(np.abs(g).max() > 0 for n, g in with_lt.items() if n.endswith("bias"))


@pytest.mark.parametrize("other_consumer", [False, True])
def test_the_gelu_backward_moves_into_the_next_gemm_only_when_it_has_all_the_gradient(
        monkeypatch, other_consumer):
    """x = gelu(h) feeding a projection: its backward GEMM takes the gradient through the
    GELU (one launch fewer) only when the projection is x's sole consumer; with another
    consumer of x the GELU's own backward runs on the summed gradient. Either way every
    gradient equals the passes apart (fp32, to 1e-5)."""
    from hpcdist.autograd.tensor import tensor
    from hpcdist.autograd import ops
    from hpcdist.device import standin
    prev = backend.device_label()
    backend.init("standin")
    rng = np.random.default_rng(4)

    def run(lt_on):
        monkeypatch.setenv("HPCDIST_CUBLASLT", "1" if lt_on else "0")
        t = (lambda *shape: tensor(rng.standard_normal(shape).astype(np.float32) * 0.5,
                                      requires_grad=True))
        params = [t(16, 32), t(32), t(32, 16), t(16)]
        for p in params:
            p.grad = backend.xp().zeros_like(p.data)
        from hpcdist.autograd.lazy_zero import zeroed_grads
        zeroed_grads(params)
        x = t(2, 5, 16)
        a = ops.linear_gelu(x, params[0], params[1])
        y = ops.linear(a, params[2], params[3])
        loss = (y * y).sum()
        if other_consumer:
            loss = loss + (a * a).sum()
        standin.LAUNCHES.count = 0
        loss.backward()
        return [np.asarray(p.grad) for p in params] + [np.asarray(x.grad)], \
            standin.LAUNCHES.count

    try:
        state = rng.bit_generator.state
        fused_grads, n_fused = run(True)
        rng.bit_generator.state = state
        apart, n_apart = run(False)
    finally:
        backend.init(prev)
    for g, w in zip(fused_grads, apart):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    # apart: the projection's bias and weight gradients, its input gradient, the GELU's
    # backward; fused: bias and weight in one, the input gradient through the GELU
    assert n_apart - n_fused == (1 if other_consumer else 2), (n_apart, n_fused)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fp8_matmul_equals_its_twin_through_the_real_descriptors(lt, dtype):
    """FP8_GEMM's launch — the amax and codes kernels in the CUDA model (device/cudasim.py),
    then cuBLASLt's FP8 matmul with its descriptors built by the real library (e4m3 and e5m2
    layouts, "TN", the two scale pointers) and computed by the stand-in, which refuses what
    cuBLASLt's FP8 contract refuses — equals its twin (the quantized values' product) on every
    self-check case, e5m2 on either side."""
    from hpcdist.device import cudasim
    from hpcdist.device.kernels import fp8_gemm
    if cudasim.available() is not None:
        pytest.skip(f"the CUDA execution model: {cudasim.available()}")
    op, xp = fp8_gemm.FP8_GEMM, backend.xp()
    model = cudasim.kernels(op, dtype)

    def k(name, defines=None):             # (the model reads the stand-in's arrays as NumPy's)
        kernel = model(name, defines)
        return lambda grid, block, args: kernel(grid, block, tuple(
            np.asarray(a) if isinstance(a, np.ndarray) else a for a in args))
    n = 0
    for args in op.cases(xp, np.random.default_rng(5), backend.dtype(dtype)):
        want = np.asarray(op.twin(*[fused._widened(a) for a in args]), np.float64)
        got = np.asarray(op.launch(k, *[fused._copy(a) for a in args]), np.float64)
        assert got.shape == want.shape
        assert fused._error(want, got) <= op.tolerance_for(dtype), args[0].shape
        assert fused._error(want, np.asarray(args[0], np.float64) @ np.asarray(args[1])) > 1e-3
        n += 1
    assert n == 9 and len(lt) == n
    assert {c[:2] for c in lt} == {(1, 0)} and {c[6] for c in lt} == {cublaslt.COMPUTE["32F"]}
