"""What the GPU path adds beside the CPU one: bf16 emulation, staging helpers, the device
double. Runs on the CPU (numbers checked against ml_dtypes) and, under make test-gpu, on the
GPU ($HPCDIST_DEVICE=gpu)."""
import numpy as np
import pytest

from hpcdist import backend


def test_round_to_bf16_matches_ml_dtypes():
    ml = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10 ** rng.integers(
        -30, 30, 10_000).astype(np.float32), np.array([0.0, -0.0, 1.00390625, 1.01171875,
                                                       np.inf, -np.inf, 3.4e38], np.float32)])
    x = x[np.isfinite(x) | np.isinf(x)]
    got = backend.to_numpy(backend.round_to_bf16(backend.to_device(x)))
    ref = x.astype(ml.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, ref)
    nan = backend.to_numpy(backend.round_to_bf16(backend.to_device(np.array([np.nan], np.float32))))
    assert np.isnan(nan).all()


def test_emulated_bf16_matmul_is_bf16_operands_with_fp32_accumulation():
    ml = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)
    ref = a.astype(ml.bfloat16).astype(np.float64) @ b.astype(ml.bfloat16).astype(np.float64)
    old = backend._bf16_operands
    try:
        backend._bf16_operands = True
        got = backend.to_numpy(backend.matmul(backend.to_device(a), backend.to_device(b)))
    finally:
        backend._bf16_operands = old
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)       # fp32 accumulation
    assert np.abs(got - a @ b).max() > 1e-3                         # and not plain fp32


def test_staging_round_trip_through_reused_host_buffers():
    x = backend.to_device(np.arange(1000, dtype=np.float64).reshape(10, 100))
    h = backend.to_host(x)
    assert type(h) is np.ndarray and h.shape == (1000,)
    np.testing.assert_array_equal(h, np.arange(1000))
    out = backend.to_device(np.zeros((10, 100)))
    assert backend.from_host(h, x, out) is out
    np.testing.assert_array_equal(backend.to_numpy(out).reshape(-1), np.arange(1000))
    if backend.is_gpu_array(x):             # the next staging with the same key reuses h
        again = backend.to_host(x[:, :50].copy(), key=0)
        assert again.ctypes.data == h.ctypes.data
        assert backend.to_host(x, key=1).ctypes.data != h.ctypes.data


def test_the_device_double_refuses_host_arrays_and_mpi():
    from mpi4py import MPI
    from hpcdist import device_double as dd
    d = dd.asarray(np.ones(4))
    assert dd.BUFFER_CLOSED
    with pytest.raises(TypeError):
        MPI.COMM_SELF.Send(d, 0, 0)
    with pytest.raises(TypeError, match="host"):
        d + np.ones(4)
    with pytest.raises(TypeError, match="host"):
        dd.where(np.ones(4, bool), d, d)
    np.testing.assert_array_equal(dd.asnumpy(d * 2 + 1), np.full(4, 3.0))
