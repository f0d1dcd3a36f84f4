"""The BLAS the numba kernels call: the addresses of its ``cblas_sgemm`` and ``cblas_dgemm``
and the width of its integers. Intel's MKL where its wheel is installed (the ``cpu-mkl`` extra,
which ``make venv`` adds on x86-64 Linux), else NumPy's own; ``HPCDIST_BLAS=numpy``: NumPy's.

Callable from numba because a rank's threads are one set, numba's OpenMP threads (host/pool.py):
a GEMM split over them is called inside a kernel. NumPy's wheels export CBLAS (SciPy's OpenBLAS:
``scipy_`` prefix, ILP64 ``64_`` suffix; threadpoolctl names the file); where none is found
(macOS Accelerate), ``find()`` says why and BLAS runs its own threads. MKL first: at a small
GPT's GEMMs it is 15-25% faster than OpenBLAS (PyTorch's CPU GEMMs run on it), loaded
sequential (each part is already one thread's), LP64, RTLD_DEEPBIND; where it will not load
the run header says why and NumPy's BLAS runs (docs/autograd.md)."""
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
MKL_SEQUENTIAL, MKL_LP64 = 1, 0                    # MKL_Set_Threading_Layer / _Interface_Layer

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
    if os.environ.get("HPCDIST_BLAS", "auto") != "numpy":
        mkl = _mkl()
        if mkl is not None:
            return mkl
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


mkl_why_not: str | None = None      # why an installed MKL was not taken (the run header says)


def mkl_library() -> str | None:
    """The path of the ``mkl`` wheel's libmkl_rt (from the wheel's own file list, wherever
    pip put it: a venv's lib/, ~/.local/lib), None without the wheel."""
    import importlib.metadata
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))
    return os.path.normpath(found[-1]) if found else None


def _mkl() -> Gemm | None:
    """MKL's CBLAS GEMMs from the ``mkl`` wheel's libmkl_rt, sequential, LP64; None where the
    wheel is absent or the library refuses (``mkl_why_not`` says why)."""
    global mkl_why_not
    path = mkl_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0))
        # before any other MKL call: no threads of MKL's own, 32-bit sizes
        if lib.MKL_Set_Threading_Layer(MKL_SEQUENTIAL) != MKL_SEQUENTIAL:
            mkl_why_not = f"{path} refused its sequential layer"
            return None
        lib.MKL_Set_Interface_Layer(MKL_LP64)
        s, d = lib.cblas_sgemm, lib.cblas_dgemm
    except (OSError, AttributeError) as e:
        mkl_why_not = f"{type(e).__name__}: {e}"[:200]
        return None
    import importlib.metadata
    return Gemm(ctypes.cast(s, ctypes.c_void_p).value, ctypes.cast(d, ctypes.c_void_p).value,
                32, f"mkl {importlib.metadata.version('mkl')}")


def int_type():
    """The NumPy integer type of the BLAS's sizes (find() must have found it)."""
    import numpy as np
    return np.int64 if find().int_bits == 64 else np.int32
