"""hpcdist/host/pool.py and blas.py: a rank's CPU work on one set of threads (numba's) with
NumPy's BLAS called from inside the kernels on one thread each — GEMMs split by rows equal one
call for every layout BLAS takes and add into a result as BLAS's beta does, attention's pairs
over two threads equal the twin, and the pool is off (BLAS on its own threads again) with one
thread, when asked, or where NumPy's BLAS cannot be called."""
import numpy as np
import pytest

from hpcdist.device import backend
from hpcdist.device.kernels import cpu
from hpcdist.host import blas, pool, threads

needs_pool = pytest.mark.skipif(not blas.split_here(), reason="numba or a callable BLAS missing")


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setattr(threads, "threads", 2)
    monkeypatch.setattr(threads, "blas_single", True)
    assert pool.on()


def test_numpys_blas_is_found_with_its_integer_width():
    g = blas.find()
    if g is None:
        pytest.skip(f"not here: {blas.why_not}")
    assert g.sgemm and g.dgemm and g.int_bits in (32, 64) and g.where


@needs_pool
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1024, 384, 1152), (97, 5, 3), (64 * 2, 7, 1), (1000, 1, 13),
                                   (67, 300, 2), (384, 1024, 384), (64, 33, 200), (70, 9, 2003),
                                   (64, 5, 65)])
def test_gemm_split_by_rows_equals_one_call(two_threads, shape, dtype, monkeypatch):
    """(M, K, N): results tall and wide, parts even and uneven, one column."""
    monkeypatch.setattr(pool, "MIN_FLOPS", 0)
    M, K, N = shape
    rng = np.random.default_rng(0)
    tol = 1e-13 if dtype == np.float64 else 1e-4
    wide = rng.standard_normal((M, K + 3)).astype(dtype)
    for a in (rng.standard_normal((M, K)).astype(dtype),            # rows
              rng.standard_normal((K, M)).astype(dtype).T,          # stored by columns
              wide[:, 1:K + 1]):                                    # rows apart by K + 3
        for b in (rng.standard_normal((K, N)).astype(dtype),
                  rng.standard_normal((N, K)).astype(dtype).T):
            assert pool.wanted(a, b)
            want = a.astype(np.float64) @ b.astype(np.float64)
            np.testing.assert_allclose(cpu.gemm(a, b), want, rtol=tol, atol=tol * K)
            np.testing.assert_allclose(backend.matmul(a, b), want, rtol=tol, atol=tol * K)
            into = rng.standard_normal((M, N)).astype(dtype)
            was = into.astype(np.float64)
            assert cpu.gemm(a, b, into, beta=1.0) is into
            np.testing.assert_allclose(into, was + want, rtol=tol, atol=tol * (K + 1))


def test_what_is_split(two_threads, monkeypatch):
    monkeypatch.setattr(pool, "MIN_FLOPS", 0)
    if not blas.split_here():
        assert not pool.wanted(np.zeros((64, 4)), np.zeros((4, 4)))
        return
    assert pool.wanted(np.zeros((64, 4)), np.zeros((4, 4)))
    assert not pool.wanted(np.zeros((63, 4)), np.zeros((4, 4)))     # under 32 rows a thread
    assert not pool.wanted(np.zeros((64, 4), np.float16), np.zeros((4, 4), np.float16))
    assert not pool.wanted(np.zeros((64, 8))[:, ::2], np.zeros((4, 4)))   # no BLAS layout
    assert not pool.wanted(np.zeros((64, 4)), np.zeros((4, 4), np.float32))


def test_off_with_one_thread_when_asked_or_without_a_callable_blas(monkeypatch):
    monkeypatch.setattr(threads, "blas_single", True)
    monkeypatch.setattr(threads, "threads", 1)
    assert not pool.on()
    monkeypatch.setattr(threads, "threads", 2)
    for var in ("HPCDIST_CPU_POOL", "HPCDIST_CPU_KERNELS"):
        monkeypatch.setenv(var, "0")
        assert not pool.on() and not blas.split_here()
        monkeypatch.delenv(var)
    monkeypatch.setattr(blas, "find", lambda: None)
    assert not blas.split_here()


def test_blas_keeps_its_own_threads_where_the_pool_cannot_run(monkeypatch):
    """threads.limit holds BLAS to one thread only where the pool will split its work."""
    from threadpoolctl import threadpool_info
    saved = threads.threads

    def blas_threads():            # NumPy's (hpcdist's MKL runs on no threads of its own)
        return [i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas" and "libmkl_rt" not in i["filepath"]]
    try:
        monkeypatch.setattr(blas, "find", lambda: None)
        threads.limit(2)
        assert not threads.blas_single and set(blas_threads()) == {2}
        monkeypatch.undo()
        if blas.split_here():
            threads.limit(2)
            assert threads.blas_single and set(blas_threads()) == {1}
            threads.release_blas()
            assert not threads.blas_single and set(blas_threads()) == {2}
    finally:
        threads.limit(saved or 1)


@needs_pool
@pytest.mark.parametrize("n", [2, 1])
def test_attention_over_the_threads_equals_the_twin(n, monkeypatch):
    from hpcdist.device import kernels
    from hpcdist.device.kernels import attention, cpu
    monkeypatch.setattr(threads, "threads", n)
    monkeypatch.setattr(cpu, "MIN_SIZE", 0)
    rng = np.random.default_rng(1)
    for B, T, nh, hs in ((3, 37, 4, 8), (1, 1, 1, 3), (1, 200, 1, 16), (2, 65, 3, 2)):
        qkv = rng.standard_normal((B, T, 3 * nh * hs))
        dy = rng.standard_normal((B, T, nh * hs))
        y, lse, _ = kernels.attention_fwd(qkv, nh, nh, 0.3)
        want_y, want_lse, att = attention.attention_twin(qkv, nh, 0.3)
        np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
        got = kernels.attention_bwd(qkv, y, dy, lse, nh, nh, 0.3, None)
        want = attention.attention_bwd_twin(qkv, want_y, dy, want_lse, nh, 0.3, att)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)
    monkeypatch.setattr(cpu, "_threads", 0)
    if n == 2:                   # one set of threads: OpenMP's (or TBB's), not the work queue
        import numba
        assert numba.threading_layer() in ("omp", "tbb")


@needs_pool
@pytest.mark.parametrize("n", [2, 1])
def test_a_gemm_adds_into_a_buffer_in_place(n, monkeypatch):
    """cpu.gemm_add: into += a @ b by BLAS's beta (a weight's gradient into its buffer), split
    over the threads or in one call; refused (False, into untouched) where BLAS cannot."""
    monkeypatch.setattr(threads, "threads", n)
    monkeypatch.setattr(threads, "blas_single", True)
    monkeypatch.setattr(pool, "MIN_FLOPS", 0)
    monkeypatch.setattr(cpu, "MIN_SIZE", 0)
    rng = np.random.default_rng(3)
    for M, K, N in ((300, 70, 5), (1, 3, 2), (64, 1, 64)):
        for a in (rng.standard_normal((M, K)), rng.standard_normal((K, M)).T):
            b = rng.standard_normal((K, N))
            buf = rng.standard_normal((M, N))
            want = buf + a @ b
            view = buf.view()
            assert cpu.gemm_add(a, b, view) and view.base is buf
            np.testing.assert_allclose(buf, want, rtol=1e-13, atol=1e-13)
    buf = np.zeros((4, 4))
    assert not cpu.gemm_add(np.ones((4, 4), np.float32), np.ones((4, 4), np.float32), buf)
    monkeypatch.setattr(cpu, "MIN_SIZE", 17)               # smaller: NumPy's GEMM, + by caller
    assert not cpu.gemm_add(np.ones((4, 4)), np.ones((4, 4)), buf)
    assert not cpu.gemm_add(np.ones((4, 4)), np.ones((4, 4)), np.zeros((8, 4))[::2])
    assert not cpu.gemm_add(np.ones((4, 8))[:, ::2], np.ones((4, 4)), buf)
    assert not buf.any()
    monkeypatch.setattr(cpu, "_threads", 0)


def test_the_kernels_call_mkl_where_its_wheel_is_and_numpys_blas_when_asked():
    """host/blas.py takes the mkl wheel's libmkl_rt where this environment has one (make venv
    installs it on x86-64 Linux), NumPy's BLAS under HPCDIST_BLAS=numpy; a GEMM split over two
    threads through either equals the float64 product to float32's rounding."""
    import importlib.metadata
    import os
    import subprocess
    import sys
    code = ("import numpy as np; from hpcdist.host import blas, threads; threads.limit(2); "
            "from hpcdist.device.kernels import cpu; g = blas.find(); "
            "r = np.random.default_rng(0); a = r.standard_normal((512, 384), np.float32); "
            "b = r.standard_normal((384, 640), np.float32); c = cpu.gemm(a, b); "
            "w = a.astype(np.float64) @ b; "
            "print(g.where, g.int_bits, np.abs(c - w).max() / np.abs(w).max())")
    try:
        mkl = any(f.name.startswith("libmkl_rt.so") for f in importlib.metadata.files("mkl"))
    except importlib.metadata.PackageNotFoundError:
        mkl = False
    for choice in ("auto", "numpy"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, HPCDIST_BLAS=choice))
        assert r.returncode == 0, r.stderr[-2000:]
        *lib, bits, err = r.stdout.split()
        lib, bits, err = " ".join(lib), int(bits), float(err)
        assert lib.startswith("mkl") == (mkl and choice == "auto"), (choice, lib)
        assert err < 1e-5, (lib, err)
        if lib.startswith("mkl"):
            assert bits == 32                       # LP64, as it was set
