"""A weight's gradient added by the GEMM itself into its buffer: ``into += a @ b``.

On the CPU NumPy's BLAS does it (kernels/cpu.py gemm_add); on a GPU cuBLAS's ``gemmEx`` with
beta 1 (``GEMM_ADD``; ``GEMM_ADD_TF32`` under ``--tf32``), in fp32, fp64 or bf16 (bf16 in and
out, fp32 accumulation). Either way the product's array and the pass that adds it go: one
launch fewer a weight a step (49 in a GPT 12x768 step), and a weight-sized temporary.
Each is self-checked against its twin on first use like every fused kernel; a refused one
leaves the product and the engine's addition, as before."""
from __future__ import annotations

import numpy as np

from .. import backend, fused
from ..fused import Fused, dtype_name
from .common import low
from .gemm import _TO_BF16, gemm_ex, tf32_on

# cuBLAS's data and compute types of ``into``'s dtype, and the type of alpha and beta
_TYPES = {"float32": ("runtime.CUDA_R_32F", "cublas.CUBLAS_COMPUTE_32F", np.float32),
          "float64": ("runtime.CUDA_R_64F", "cublas.CUBLAS_COMPUTE_64F", np.float64),
          "bfloat16": ("runtime.CUDA_R_16BF", "cublas.CUBLAS_COMPUTE_32F", np.float32)}


def _launch(k, a, b, into, overwrite=False, tf32=False):
    """``into`` (n, m) += (``overwrite``: =) ``a`` (n, k) @ ``b`` (k, m): one gemmEx with
    beta 1 (0), all three of into's type."""
    kind, compute, scalar = _TYPES[dtype_name(into.dtype)]
    return gemm_ex(a, b, into, kind, kind, "cublas.CUBLAS_COMPUTE_32F_FAST_TF32" if tf32
                   else compute, beta=0.0 if overwrite else 1.0, scalar=scalar)


def _launch_tf32(k, a, b, into, overwrite=False):
    return _launch(k, a, b, into, overwrite, tf32=True)


def gemm_add_twin(a, b, into, overwrite=False):
    """The definition: ``into`` (+)= a @ b; 2-byte floats multiplied and added in float32 and
    rounded once into ``into``."""
    if low(into):
        prod = a.astype(np.float32) @ b.astype(np.float32)
        into[...] = (prod if overwrite else into.astype(np.float32) + prod).astype(into.dtype)
        return into
    if overwrite:
        into[...] = a @ b
    else:
        into += a @ b
    return into


def _cases(xp, rng, dt):
    for n, k, m in ((1, 1, 1), (3, 5, 7), (64, 48, 33), (17, 256, 129), (2, 0, 3)):
        a = (rng.standard_normal((n, k)) * 3).astype(dt)
        b = (rng.standard_normal((k, m)) * 3).astype(dt)
        into = (rng.standard_normal((n, m)) * 3).astype(dt)
        yield xp.asarray(a), xp.asarray(b), xp.asarray(into)
        # as a linear layer's weight gradient takes them: x^T (a transposed view) @ dy
        yield xp.asarray(a.T.copy()).T, xp.asarray(b), xp.asarray(into), True
        yield xp.asarray(a), xp.asarray(b.T.copy()).T, xp.asarray(into)


GEMM_ADD = Fused("gemm_add", _TO_BF16, [], _launch, gemm_add_twin, _cases, tolerance=1e-5,
                 dtypes=("float32", "float64", "bfloat16"), library="cuBLAS gemmEx")
# TF32 rounds the operands to 10 bits of mantissa (the twin multiplies in fp32): tf32's tolerance
GEMM_ADD_TF32 = Fused("gemm_add_tf32", _TO_BF16, [], _launch_tf32, gemm_add_twin, _cases,
                      tolerance=5e-3, dtypes=("float32",), library="cuBLAS gemmEx")


def matmul_add(a, b, into, overwrite: bool = False) -> bool:
    """``into += a @ b`` (``overwrite``: ``into = a @ b``) inside the GEMM where it can be,
    saving the product's array and the pass that adds it (a weight's gradient into its
    buffer): NumPy's BLAS on the CPU in float32/float64; cuBLAS on a GPU in fp32, fp64, bf16
    (the GPU stand-in runs the twin, one launch); not under bf16 emulation (its GEMMs round
    their operands: BF16_GEMM); two fp8 ``Codes`` by cuBLASLt's FP8 matmul into a float32 or
    bf16 ``into``. False: not done, the caller adds."""
    if a.dtype == np.uint8:                                  # fp8 codes (kernels/fp8_gemm.py)
        return a.add_product(b, into, overwrite)
    if backend.bf16_emulated() and a.dtype == np.float32:
        return False
    label = backend.device_label()
    if label == "cpu":
        from . import cpu
        return cpu.gemm_add(a, b, into, overwrite)
    op = GEMM_ADD_TF32 if tf32_on() and a.dtype == np.float32 else GEMM_ADD
    if not (fused.enabled() and a.ndim == b.ndim == into.ndim == 2
            and a.dtype == b.dtype == into.dtype and dtype_name(a.dtype) in op.dtypes
            and into.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0]
            and into.flags.c_contiguous) or (label == "gpu" and not op.ready(dtype_name(a.dtype))):
        return False
    op(a, b, into, overwrite)
    return True


def device_gemm(a, b):
    """``a @ b`` of two matrices on a GPU (or the GPU stand-in) as one gemmEx into a new array, or
    None where GEMM_ADD does not take it (the caller multiplies through CuPy). CuPy's own GEMM
    runs cuBLAS through wrappers that refuse a CUDA graph's capture (device/graphs.py), and
    costs the host ~30 us a call against this one's ~15."""
    if a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype:
        return None
    out = backend.xp().empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    return out if matmul_add(a, b, out, overwrite=True) else None
