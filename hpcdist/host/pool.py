"""One set of threads per rank for all of its CPU work: numba's OpenMP threads run the fused
kernels, every GEMM of 1 M flops or more split by rows, and attention's (sequence, head)
pairs, each part one call of NumPy's BLAS held to one thread (host/blas.py, the GEMM kernels
in device/kernels/cpu_gemm.py). Why: BLAS's own threads and the kernels' were two sets taking
turns on the same cores (OpenBLAS's spin ~0.1 s after a GEMM), numba's work queue takes ~150
us to start a kernel and Python threads ~100 us a GEMM part; an OpenMP region starts in ~2 us.
PyTorch's CPU ops and MKL share one OpenMP pool the same way.

On where a rank has more than one thread and blas.split_here(); ``HPCDIST_CPU_POOL=0`` turns
it off (BLAS runs its own threads, the kernels numba's work queue). Measured: docs/autograd.md,
"At the shapes people train"."""
from __future__ import annotations

import numpy as np

from . import blas, threads

MIN_FLOPS = 1 << 20          # smaller GEMMs run whole on the calling thread


def on() -> bool:
    """Whether this rank splits its CPU work over its threads itself (BLAS on one each)."""
    return threads.threads > 1 and threads.blas_single and blas.split_here()


def wanted(a, b) -> bool:
    """Whether ``a @ b`` (2-D, NumPy floats) is worth splitting (kernels/cpu.py: gemm)."""
    return (on() and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.ndim == 2
            and b.ndim == 2 and a.dtype == b.dtype and a.dtype in (np.float32, np.float64)
            and 2 * a.shape[0] * a.shape[1] * b.shape[1] >= MIN_FLOPS
            and a.shape[0] >= 32 * threads.threads and layout(a) is not None
            and layout(b) is not None)


def layout(x):
    """(CBLAS transpose flag, leading dimension) of a 2-D x as BLAS takes it, None when it
    cannot (x's rows or columns are not unit-strided)."""
    s0, s1, size = x.strides[0], x.strides[1], x.itemsize
    if s1 == size and s0 % size == 0 and s0 >= max(1, x.shape[1]) * size:
        return blas.NO_TRANS, s0 // size         # rows apart by s0
    if s0 == size and s1 % size == 0 and s1 >= max(1, x.shape[0]) * size:
        return blas.TRANS, s1 // size            # stored by columns
    return None
