"""NumPy's own BLAS, callable from the numba kernels: the addresses of its ``cblas_sgemm`` and
``cblas_dgemm`` and the width of its integers.

Why: the rank's threads are one set, numba's OpenMP threads (host/pool.py), and a GEMM
split over them has to be called from inside a numba kernel; NumPy exposes no BLAS to numba, but the
library it loaded exports the CBLAS symbols (NumPy's wheels: SciPy's OpenBLAS, ``scipy_``
prefix, ILP64 ``64_`` suffix; a conda NumPy: MKL's ``cblas_sgemm``). threadpoolctl names the
file. Where none is found (macOS Accelerate, a BLAS threadpoolctl does not know), ``find()``
returns None and says why, and BLAS runs its own threads as before."""
from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import NamedTuple


class Gemm(NamedTuple):
    sgemm: int           # address of cblas_sgemm
    dgemm: int           # address of cblas_dgemm
    int_bits: int        # 64: ILP64 (sizes are int64), 32: LP64
    where: str           # the library, for the run header


ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112        # CBLAS's enums

# (prefix, suffix, integer bits) in the order tried
NAMES = (("scipy_", "64_", 64), ("", "64_", 64), ("", "_64", 64), ("scipy_", "", 32), ("", "", 32))

_found: Gemm | None = None
why_not: str | None = None
_looked = False
_numba = None        # whether numba is installed, once looked up


def split_here() -> bool:
    """Whether hpcdist's kernels can split BLAS's work over a rank's threads in this process
    (host/pool.py): numba is installed, NumPy's BLAS is callable, and neither
    HPCDIST_CPU_POOL=0 nor HPCDIST_CPU_KERNELS=0."""
    global _numba
    if _numba is None:
        _numba = importlib.util.find_spec("numba") is not None
    return (os.environ.get("HPCDIST_CPU_POOL", "1") != "0"
            and os.environ.get("HPCDIST_CPU_KERNELS", "1") != "0" and _numba
            and find() is not None)


def find() -> Gemm | None:
    """NumPy's CBLAS GEMMs, looked up once (None: ``why_not`` says why)."""
    global _found, why_not, _looked
    if not _looked:
        _looked = True
        try:
            _found = _look()
        except Exception as e:                       # a library that will not load
            why_not = f"{type(e).__name__}: {e}"
        if _found is None and why_not is None:
            why_not = "no CBLAS GEMM found in NumPy's BLAS"
    return _found


def _look() -> Gemm | None:
    global why_not
    import numpy  # noqa: F401  (its BLAS loaded)
    from threadpoolctl import threadpool_info
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not libs:
        why_not = "threadpoolctl sees no BLAS in NumPy"
        return None
    for info in libs:
        lib = ctypes.CDLL(info["filepath"])
        for prefix, suffix, bits in NAMES:
            try:
                s = getattr(lib, f"{prefix}cblas_sgemm{suffix}")
                d = getattr(lib, f"{prefix}cblas_dgemm{suffix}")
            except AttributeError:
                continue
            address = ctypes.cast(s, ctypes.c_void_p).value, ctypes.cast(d, ctypes.c_void_p).value
            return Gemm(address[0], address[1], bits,
                        f"{info.get('internal_api')} {info.get('version') or ''}".strip())
    why_not = f"no CBLAS GEMM symbol in {', '.join(i['filepath'] for i in libs)}"
    return None


def int_type():
    """The NumPy integer type of the BLAS's sizes (find() must have found it)."""
    import numpy as np
    return np.int64 if find().int_bits == 64 else np.int32
