"""hpcdist/host/pool.py: a rank's CPU work spread over its threads with BLAS on one thread
each — GEMMs split by rows equal one call, attention's blocks over the threads equal the twin,
an exception in any part reaches the caller after every part ran, and with the pool off (one
thread, HPCDIST_CPU_POOL=0) the work runs in turn on the caller."""
import threading

import numpy as np
import pytest

from hpcdist.device import backend
from hpcdist.host import pool, threads


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setattr(threads, "threads", 2)
    monkeypatch.setattr(threads, "blas_single", True)
    assert pool.on()


@pytest.mark.parametrize("shape", [(1024, 384, 1152), (97, 5, 3), (64 * 2, 7, 1), (1000, 1, 13)])
def test_gemm_split_by_rows_equals_one_call(two_threads, shape, monkeypatch):
    monkeypatch.setattr(pool, "MIN_FLOPS", 0)
    M, K, N = shape
    rng = np.random.default_rng(0)
    for a in (rng.standard_normal((M, K)), rng.standard_normal((K, M)).T):    # a view too
        b = rng.standard_normal((K, N))
        if pool.wanted(a, b):
            np.testing.assert_allclose(pool.matmul(a, b), a @ b, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(backend.matmul(a, b), a @ b, rtol=1e-13, atol=1e-13)
    assert pool.wanted(np.zeros((64, 4)), np.zeros((4, 4)))
    assert not pool.wanted(np.zeros((63, 4)), np.zeros((4, 4)))     # under 32 rows a thread
    assert not pool.wanted(np.zeros((64, 4), np.float16), np.zeros((4, 4), np.float16))


def test_work_goes_to_every_thread_and_errors_come_back(two_threads):
    seen, lock = set(), threading.Lock()

    def note(i):
        with lock:
            seen.add(threading.get_ident())
        if i == 3:
            raise ValueError("part 3")
    with pytest.raises(ValueError, match="part 3"):
        pool.run(note, range(8))
    assert len(seen) == 2 and threading.get_ident() in seen      # the caller is one of them
    done = []
    pool.run(done.append, range(5))
    assert sorted(done) == list(range(5))


def test_off_with_one_thread_or_when_asked(monkeypatch):
    monkeypatch.setattr(threads, "blas_single", True)
    monkeypatch.setattr(threads, "threads", 1)
    assert not pool.on()
    monkeypatch.setattr(threads, "threads", 2)
    monkeypatch.setenv("HPCDIST_CPU_POOL", "0")
    assert not pool.on()
    seen = []
    pool.run(lambda i: seen.append(threading.get_ident()), range(4))
    assert set(seen) == {threading.get_ident()}


def test_attention_over_two_threads_equals_the_twin(two_threads, monkeypatch):
    pytest.importorskip("numba")
    from hpcdist.device import kernels
    from hpcdist.device.kernels import attention, cpu
    monkeypatch.setattr(cpu, "MIN_SIZE", 0)
    monkeypatch.setattr(cpu, "ATTENTION_BYTES", 3 * 37 * 37 * 8)      # several blocks
    rng = np.random.default_rng(1)
    B, T, nh, hs = 3, 37, 4, 8
    qkv = rng.standard_normal((B, T, 3 * nh * hs))
    dy = rng.standard_normal((B, T, nh * hs))
    y, lse, _ = kernels.ATTENTION_FWD(qkv, nh, 0.3)
    want_y, want_lse, att = attention.attention_twin(qkv, nh, 0.3)
    np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    got = kernels.ATTENTION_BWD(qkv, y, dy, lse, nh, 0.3, None)
    want = attention.attention_bwd_twin(qkv, want_y, dy, want_lse, nh, 0.3, att)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


def test_a_part_that_spreads_work_runs_it_in_turn(two_threads):
    """Work spread from inside a part runs on that part's thread (a worker waiting on the
    pool it belongs to would wait forever)."""
    inner = []

    def part(i):
        pool.run(lambda j: inner.append((i, threading.get_ident())), range(3))
    pool.run(part, range(2))
    assert len(inner) == 6
    by_part = {}
    for i, ident in inner:
        by_part.setdefault(i, set()).add(ident)
    assert all(len(idents) == 1 for idents in by_part.values())
