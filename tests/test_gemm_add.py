"""A weight's gradient added by the GEMM into its buffer (kernels/gemm_add.py): the cuBLAS
call's layout against cuBLAS's column-major contract with a stand-in gemmEx over host memory
(the GPU stand-in's pointers are host addresses), in fp32, TF32, fp64 and bf16; and on the
GPU stand-in a training step's weight gradients through it, equal to the CPU's, one launch
each; the device's one-pass zeroing of the gradients."""
import numpy as np
import pytest

from hpcdist import nn, optim
from hpcdist.device import backend, kernels

from cublas_standin import fake_cublas

@pytest.mark.parametrize("dtype,tf32", [("float32", False), ("float32", True),
                                        ("float64", False), ("bfloat16", False)])
def test_the_gradient_gemm_hands_cublas_its_operands_column_major(monkeypatch, dtype, tf32):
    """into (+)= a @ b through the launcher's one gemmEx: C-contiguous and transposed
    operands (x^T @ dy, as a linear layer's weight gradient), odd shapes, beta 1 and 0; the
    types and compute type cuBLAS is told."""
    pytest.importorskip("ml_dtypes")
    from hpcdist.device.kernels import gemm, gemm_add
    prev = backend.device_label()
    calls = []
    monkeypatch.setattr(gemm, "lib", fake_cublas(calls))
    backend.init("standin")
    dt = backend.dtype(dtype)
    try:
        xp, rng = backend.xp(), np.random.default_rng(5)
        for n, k, m in ((1, 1, 1), (5, 3, 7), (33, 64, 17)):
            a = rng.standard_normal((n, k)).astype(dt)
            b = rng.standard_normal((k, m)).astype(dt)
            c = rng.standard_normal((n, m)).astype(dt)
            for overwrite in (False, True):
                want = a.astype(np.float64) @ b.astype(np.float64) + \
                    (0 if overwrite else c.astype(np.float64))
                for left in (xp.asarray(a), xp.asarray(a.T.copy()).T):
                    for right in (xp.asarray(b), xp.asarray(b.T.copy()).T):
                        into = xp.asarray(c.copy())
                        out = gemm_add._launch(None, left, right, into, overwrite, tf32)
                        assert out is into
                        got = backend.to_numpy(into).astype(np.float64)
                        tol = 2e-2 if dtype == "bfloat16" else 1e-5
                        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)
    finally:
        backend.init("cpu" if prev == "cpu" else prev)
    kind = {"float32": 0, "float64": 1, "bfloat16": 14}[dtype]
    compute = 77 if tf32 else 70 if dtype == "float64" else 68
    assert {c[8:] for c in calls} == {(kind, kind, kind, compute,
                                       -1 if dtype == "float64" else 99)}
    assert {c[:2] for c in calls} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def _step_grads(device, steps=2):
    """Two SGD steps of a small GPT on ``device``: the weights' gradients of the last, the
    launches of the last (on the GPU stand-in) and the parameters."""
    from hpcdist.device import standin as dd
    prev = backend.device_label()
    backend.init(device)
    try:
        nn.manual_seed(0)
        model = nn.GPT(nn.GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2,
                                    n_embd=16))
        opt = optim.AdamW(model.parameters(), lr=1e-2)
        idx = backend.to_device(np.random.default_rng(0).integers(0, 17, (2, 8)))
        for _ in range(steps):
            opt.zero_grad(lazy=True)
            dd.LAUNCHES.count = 0
            _, loss = model(idx, idx)
            loss.backward()
            grads = {n: backend.to_numpy(p.grad).copy() for n, p in model.named_parameters()}
            opt.step()
        return grads, dd.LAUNCHES.count
    finally:
        backend.init(prev)


def test_weight_gradients_through_the_gemm_equal_the_cpus(monkeypatch, float64):
    """On the GPU stand-in the linear layers' weight gradients go through GEMM_ADD (one
    launch each, into the gradient buffer) and equal the CPU's; without it (the product and
    the engine's addition) the step takes a launch more a weight."""
    cpu, _ = _step_grads("cpu")
    seen = []
    twin = kernels.GEMM_ADD.twin
    monkeypatch.setattr(kernels.GEMM_ADD, "twin", lambda *a: seen.append(a[2].shape) or twin(*a))
    dev, launches = _step_grads("standin")
    assert len(seen) >= 2 * 2 * 4          # two steps, two layers, four weights each
    for name, g in cpu.items():
        np.testing.assert_allclose(dev[name], g, rtol=1e-10, atol=1e-12, err_msg=name)
    from hpcdist.device.kernels import gemm_add
    monkeypatch.setattr(gemm_add, "matmul_add", lambda *a, **k: False)
    monkeypatch.setattr(kernels, "matmul_add", lambda *a, **k: False)
    _, without = _step_grads("standin")
    assert without >= launches + 2 * 4, (without, launches)


def test_a_device_zeroes_its_gradients_in_one_pass():
    """zero_grad(lazy=True) on device arrays zeroes every gradient in one pass, one launch
    (lazily, each bias's and norm's buffer would take one at its first write); on the host
    it stays lazy (no pass)."""
    from hpcdist.device import standin as dd
    prev = backend.device_label()
    for device, launches, zero in (("standin", 1, True), ("cpu", 0, False)):
        backend.init(device)
        try:
            w = nn.Parameter(backend.to_device(np.ones((3, 2))))
            opt = optim.SGD([w], lr=1.0)
            (w * w).sum().backward()
            dd.LAUNCHES.count = 0
            opt.zero_grad(lazy=True)
            assert dd.LAUNCHES.count == launches
            assert (not backend.to_numpy(w.grad).any()) == zero
        finally:
            backend.init(prev)


def test_a_workspace_of_our_own_is_given_after_each_stream(monkeypatch):
    """Once graphs.py asks for one before a capture, every gemmEx is preceded by the stream
    and then the workspace (cublasSetStream gives the handle back cuBLAS's own workspace)."""
    from hpcdist.device.kernels import gemm
    prev = backend.device_label()
    calls, events = [], []
    monkeypatch.setattr(gemm, "lib", fake_cublas(calls, events))
    monkeypatch.setattr(gemm, "_workspace", [])
    backend.init("standin")
    try:
        xp = backend.xp()
        a, b = xp.ones((3, 4), np.float32), xp.ones((4, 5), np.float32)
        out = xp.empty((3, 5), np.float32)
        gemm.gemm_ex(a, b, out, "runtime.CUDA_R_32F", "runtime.CUDA_R_32F",
                     "cublas.CUBLAS_COMPUTE_32F", beta=0.0)
        assert [e[0] for e in events] == ["stream", "gemm"]
        from hpcdist.device import graphs
        assert gemm.use_workspace in graphs.BEFORE_CAPTURE
        gemm.use_workspace()
        gemm.use_workspace()                                   # made once
        events.clear()
        gemm.gemm_ex(a, b, out, "runtime.CUDA_R_32F", "runtime.CUDA_R_32F",
                     "cublas.CUBLAS_COMPUTE_32F", beta=0.0)
        space = gemm._workspace[0]
        assert len(gemm._workspace) == 1
        assert events == [("stream", 0), ("workspace", space.data.ptr, gemm.WORKSPACE_BYTES),
                          ("gemm",)]
        np.testing.assert_array_equal(backend.to_numpy(out), np.full((3, 5), 4.0))
        monkeypatch.setattr(gemm, "_workspace", [])
        monkeypatch.setenv("HPCDIST_CUBLAS_WORKSPACE_MB", "0")   # cuBLAS's own, to compare
        gemm.use_workspace()
        events.clear()
        gemm.gemm_ex(a, b, out, "runtime.CUDA_R_32F", "runtime.CUDA_R_32F",
                     "cublas.CUBLAS_COMPUTE_32F", beta=0.0)
        assert gemm._workspace == [] and [e[0] for e in events] == ["stream", "gemm"]
    finally:
        backend.init(prev)
