"""One set of threads per rank for the CPU's parallel work: GEMMs split by rows, attention's
blocks of heads, with BLAS on one thread each.

Why: NumPy's OpenBLAS keeps its threads spinning after every GEMM (about 0.1 s), and the fused
kernels' threads (numba) that follow found a core taken: at 2 threads a GELU backward after a
GEMM ran at one thread's speed, and attention's small per-head GEMMs, each split over the BLAS
threads, took as long on 2 threads as on 1. With BLAS held to one thread a call
(host/threads.py) nothing spins: a GEMM's rows go to this rank's threads (the caller's among
them), and numba's threads, which sleep when idle, get the cores for the kernels between.
``HPCDIST_CPU_POOL=0`` turns it off. The rest: docs/autograd.md, "At the shapes people train"."""
from __future__ import annotations

import os
import threading

import numpy as np

from . import threads

MIN_FLOPS = 1 << 22          # smaller GEMMs run whole on the calling thread (a handoff ~20 us)
_pool = None                 # (threads, ThreadPoolExecutor of threads - 1 workers)
_inside = threading.local()  # set on a thread while it runs a part: a part's own work runs in turn


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def on() -> bool:
    """Whether this rank splits its CPU work over its threads itself (BLAS on one each)."""
    return threads.threads > 1 and threads.blas_single and \
        os.environ.get("HPCDIST_CPU_POOL", "1") != "0"


def _workers(n: int):
    global _pool
    if _pool is None or _pool[0] != n:
        from concurrent.futures import ThreadPoolExecutor
        if _pool is not None:
            _pool[1].shutdown()
        _pool = (n, ThreadPoolExecutor(n - 1, thread_name_prefix="hpcdist-cpu"))
    return _pool[1]


def run(fn, items) -> None:
    """``fn(item)`` for every item, spread over this rank's threads (the caller's among them),
    in turn on the caller when the pool is off. Items must write apart from each other; the
    first exception is raised here once every item has finished."""
    items = list(items)
    n = min(threads.threads, len(items))
    if not on() or n < 2 or getattr(_inside, "part", False):
        for item in items:
            fn(item)
        return
    groups = [items[i::n] for i in range(n)]
    futures = [_workers(threads.threads).submit(_each, fn, g) for g in groups[1:]]
    error = None
    try:
        _each(fn, groups[0])
    except BaseException as e:                   # the others still finish before we raise
        error = e
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def _each(fn, group) -> None:
    _inside.part = True
    try:
        for item in group:
            fn(item)
    finally:
        _inside.part = False


def wanted(a, b) -> bool:
    """Whether ``a @ b`` (2-D, NumPy floats) is worth splitting."""
    return (on() and isinstance(a, np.ndarray) and a.ndim == 2 and b.ndim == 2
            and a.dtype == b.dtype and a.dtype.kind == "f" and a.dtype.itemsize >= 4
            and 2 * a.shape[0] * a.shape[1] * b.shape[1] >= MIN_FLOPS
            and a.shape[0] >= 32 * threads.threads)


def matmul(a, b):
    """``a @ b`` with a's rows split over this rank's threads (bounds on 16-row lines), each
    part one BLAS call into its rows of the result (the inner dimension is never split)."""
    M, n = a.shape[0], threads.threads
    out = np.empty((M, b.shape[1]), dtype=np.result_type(a, b))
    step = (-(-M // n) + 15) // 16 * 16
    parts = [(r, min(M, r + step)) for r in range(0, M, step)]
    run(lambda p: np.matmul(a[p[0]:p[1]], b, out=out[p[0]:p[1]]), parts)
    return out
