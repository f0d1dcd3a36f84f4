"""A linear layer's GEMM with its epilogue, as llm.c runs it, through cuBLASLt (cublaslt.py):
``GEMM_BIAS`` a @ b + bias (+ a residual as C, beta 1); ``GEMM_BIAS_GELU`` (gelu(a @ b +
bias), a @ b + bias: the GELU's input kept for its backward); ``GEMM_DGELU_BGRAD`` (a @ b)
gelu'(h) and its column sums (the next layer's input gradient taken through the GELU, and the
GELU's bias's gradient); ``GEMM_BGRAD`` a weight's gradient into (+)= a @ b with its bias's,
b's sums over k. A bias's gradient is written, never added: its buffer must hold nothing of
this step. Each is one launch (``_TF32``: fp32 on TF32's tensor cores), self-checked against
its twin (the passes apart's arithmetic) on first use; the GPU stand-in runs the twin.
``HPCDIST_CUBLASLT=0`` turns them off. What each replaces: docs/gpu.md, "gemm_epilogue.py"."""
from __future__ import annotations

import os

import numpy as np

from .. import backend, fused
from ..fused import Fused, dtype_name
from . import cublaslt
from .colsum import colsum_add_twin
from .common import low
from .elementwise import bias_gelu_twin, bias_residual_twin
from .gelu_colsum import gelu_bwd_colsum_twin
from .gemm_add import gemm_add_twin
from .gemm import _TO_BF16, tf32_on


def _compute(tf32: bool) -> str:
    return "32F_FAST_TF32" if tf32 else "32F"


def _bias_launch(k, a, b, bias, residual=None, tf32=False):
    d = backend.xp().empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    return cublaslt.matmul(a, b, d, epilogue="bias", compute=_compute(tf32),
                           beta=0.0 if residual is None else 1.0, c=residual, vector=bias)


def _gelu_launch(k, a, b, bias, tf32=False):
    xp = backend.xp()
    d = xp.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    aux = xp.empty_like(d)
    cublaslt.matmul(a, b, d, epilogue="gelu_aux_bias", compute=_compute(tf32), vector=bias,
                    aux=aux)
    return d, aux


def _dgelu_launch(k, a, b, h, vector, tf32=False):
    d = backend.xp().empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    return cublaslt.matmul(a, b, d, epilogue="dgelu_bgrad", compute=_compute(tf32),
                           vector=vector, aux=h), vector


def _bgrad_launch(k, a, b, into, vector, overwrite=False, tf32=False):
    cublaslt.matmul(a, b, into, epilogue="bgrada", compute=_compute(tf32),
                    beta=0.0 if overwrite else 1.0, vector=vector)
    return into, vector


def _product(a, b):
    """a @ b as the GEMM stores it (2-byte floats multiplied in float32, rounded once)."""
    if low(a):
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)
    return a @ b


# The twins are the passes apart's arithmetic: the GEMM's output stored, then the epilogue's
# own pass (cuBLASLt rounds once, within the tolerance). The GPU stand-in's numbers then do
# not depend on whether an epilogue is used — nor on whether a bias's buffer was fresh, which
# a CUDA graph replaying one micro-batch for the next sees differently from eager steps.

def gemm_bias_twin(a, b, bias, residual=None):
    """The definition: a @ b, then ``bias_residual_twin``'s pass."""
    return bias_residual_twin(_product(a, b), bias, residual)


def gemm_bias_gelu_twin(a, b, bias):
    """(gelu(h), h) for h = a @ b + bias: a @ b, then ``bias_gelu_twin``'s pass."""
    h = _product(a, b)
    y, _ = bias_gelu_twin(h, bias)
    return y, h


def gemm_dgelu_bgrad_twin(a, b, h, vector):
    """(gh = (a @ b) gelu'(h), ``vector`` = gh's column sums): a @ b, then
    ``gelu_bwd_colsum_twin``'s pass into ``vector`` zeroed."""
    vector[...] = 0
    return gelu_bwd_colsum_twin(h, _product(a, b), None, vector), vector


def gemm_bgrad_twin(a, b, into, vector, overwrite=False):
    """(``into`` (+)= a @ b, ``vector`` = b's column sums): ``gemm_add_twin``, then
    ``colsum_add_twin`` into ``vector`` zeroed."""
    gemm_add_twin(a, b, into, overwrite)
    vector[...] = 0
    colsum_add_twin(b, vector)
    return into, vector


_SHAPES = ((1, 1, 8), (3, 5, 8), (64, 48, 40), (17, 256, 136))


def _pairs(xp, rng, dt, n, k, m):
    a = (rng.standard_normal((n, k)) * 2).astype(dt)
    b = (rng.standard_normal((k, m)) * 2).astype(dt)
    yield xp.asarray(a), xp.asarray(b)
    yield xp.asarray(a.T.copy()).T, xp.asarray(b.T.copy()).T          # transposed views


def _bias_cases(xp, rng, dt):
    for n, k, m in _SHAPES:
        bias = xp.asarray(rng.standard_normal(m).astype(dt))
        residual = xp.asarray(rng.standard_normal((n, m)).astype(dt))
        for a, b in _pairs(xp, rng, dt, n, k, m):
            yield a, b, bias
            yield a, b, bias, residual


def _gelu_cases(xp, rng, dt):
    for n, k, m in _SHAPES:
        bias = xp.asarray(rng.standard_normal(m).astype(dt))
        for a, b in _pairs(xp, rng, dt, n, k, m):
            yield a, b, bias


def _dgelu_cases(xp, rng, dt):
    for n, k, m in _SHAPES:      # as a projection's input gradient: dy (N, C) @ w^T (C, 4C)
        h = xp.asarray((rng.standard_normal((n, m)) * 2).astype(dt))
        for a, b in _pairs(xp, rng, dt, n, k, m):
            yield a, b, h, xp.zeros(m, dtype=dt)


def _bgrad_cases(xp, rng, dt):
    for n, k, m in _SHAPES:      # as a weight's gradient: x^T (k_in, N) @ dy (N, m)
        x = xp.asarray(rng.standard_normal((k, n)).astype(dt))
        g = xp.asarray(rng.standard_normal((k, m)).astype(dt))
        into = xp.asarray(rng.standard_normal((n, m)).astype(dt))
        for overwrite in (False, True):
            yield x.T, g, into, xp.zeros(m, dtype=dt), overwrite
        yield xp.asarray(x.T.copy()), g, into, xp.zeros(m, dtype=dt)


def _ops(tf32: bool) -> dict:
    suffix, tol = ("_tf32", 5e-3) if tf32 else ("", 1e-5)
    common = dict(dtypes=("float32",) if tf32 else ("float32", "bfloat16"), tolerance=tol,
                  library="cuBLASLt")
    return {
        "bias": Fused("gemm_bias" + suffix, _TO_BF16, [],
                      lambda k, *a: _bias_launch(k, *a, tf32=tf32), gemm_bias_twin,
                      _bias_cases, **common),
        "gelu": Fused("gemm_bias_gelu" + suffix, _TO_BF16, [],
                      lambda k, *a: _gelu_launch(k, *a, tf32=tf32), gemm_bias_gelu_twin,
                      _gelu_cases, **common),
        "dgelu": Fused("gemm_dgelu_bgrad" + suffix, _TO_BF16, [],
                       lambda k, *a: _dgelu_launch(k, *a, tf32=tf32), gemm_dgelu_bgrad_twin,
                       _dgelu_cases, **common),
        "bgrad": Fused("gemm_bgrad" + suffix, _TO_BF16, [],
                       lambda k, *a: _bgrad_launch(k, *a, tf32=tf32), gemm_bgrad_twin,
                       _bgrad_cases, **common)}


_PLAIN, _TF32 = _ops(False), _ops(True)
GEMM_BIAS, GEMM_BIAS_GELU, GEMM_BGRAD = _PLAIN["bias"], _PLAIN["gelu"], _PLAIN["bgrad"]
GEMM_DGELU_BGRAD = _PLAIN["dgelu"]
GEMM_BIAS_TF32, GEMM_BIAS_GELU_TF32, GEMM_BGRAD_TF32 = (_TF32["bias"], _TF32["gelu"],
                                                        _TF32["bgrad"])
GEMM_DGELU_BGRAD_TF32 = _TF32["dgelu"]


def enabled() -> bool:
    return os.environ.get("HPCDIST_CUBLASLT", "1") != "0" and fused.enabled()


def _op(kind: str, a, b, *rest):
    """The op of ``kind`` that takes these operands on this device, or None: a GPU (its check
    passed, and cuBLASLt has an algorithm for them) or the GPU stand-in; 2-D a and b, each
    C-contiguous or the transpose of such; every array of one dtype the op is written for;
    no bf16 emulation (its GEMMs take bf16 words)."""
    label = backend.device_label()
    if label not in ("gpu", "standin") or not enabled() or a.ndim != 2 or b.ndim != 2 \
            or a.shape[1] != b.shape[0] or 0 in a.shape + b.shape:
        return None
    op = (_TF32 if tf32_on() and a.dtype == np.float32 else _PLAIN)[kind]
    dtype = dtype_name(a.dtype)
    if dtype not in op.dtypes or any(x is not None and x.dtype != a.dtype for x in (b,) + rest) \
            or cublaslt._operand(a) is None or cublaslt._operand(b) is None \
            or (backend.bf16_emulated() and a.dtype == np.float32):
        return None
    if label == "gpu" and not op.ready(dtype):
        return None
    return op


def _supported(op, a, b, d=None, **kw) -> bool:
    """Whether cuBLASLt has an algorithm for this call (``d`` None: into a new array), its plan
    made now and kept; always on the stand-in."""
    return backend.device_label() != "gpu" or cublaslt.plan(
        a, b, d, compute=_compute(op.name.endswith("_tf32")), **kw) is not None


def bias_product(a, b, bias, residual=None):
    """``a @ b + bias (+ residual)`` (a (N, k), b (k, m), bias (m,), residual (N, m)) as one
    GEMM, or None where GEMM_BIAS does not take it (the caller adds after its GEMM)."""
    op = _op("bias", a, b, bias, residual)
    if op is None or not bias.flags.c_contiguous or bias.shape != (b.shape[1],) or (
            residual is not None and (residual.shape != (a.shape[0], b.shape[1])
                                      or not residual.flags.c_contiguous)) \
            or not _supported(op, a, b, epilogue="bias", vector=bias, c=residual):
        return None
    return op(a, b, bias, residual) if residual is not None else op(a, b, bias)


def gelu_product(a, b, bias):
    """(``gelu(a @ b + bias)``, ``a @ b + bias``) as one GEMM, or None where GEMM_BIAS_GELU
    does not take it (cuBLASLt keeps the GELU's input with a leading dimension of a multiple
    of 8: m % 8 == 0)."""
    op = _op("gelu", a, b, bias)
    m = b.shape[1]
    if op is None or m % 8 or not bias.flags.c_contiguous or bias.shape != (m,) \
            or not _supported(op, a, b, epilogue="gelu_aux_bias", vector=bias, aux="new"):
        return None
    return op(a, b, bias)


def gelu_grad_product(a, b, h, vector):
    """``(a @ b) * gelu'(h)`` (a (N, k), b (k, m), h (N, m): the GELU's input kept by its
    forward) as one GEMM, with ``vector`` = its column sums written (the GELU's bias's
    gradient), or None where GEMM_DGELU_BGRAD does not take it."""
    op = _op("dgelu", a, b, h, vector)
    m = b.shape[1]
    if op is None or m % 8 or h.shape != (a.shape[0], m) or not h.flags.c_contiguous \
            or vector.shape != (m,) or not vector.flags.c_contiguous \
            or not _supported(op, a, b, epilogue="dgelu_bgrad", vector=vector, aux=h):
        return None
    return op(a, b, h, vector)[0]


def weight_bias_grads(a, b, into, vector, overwrite: bool) -> bool:
    """A weight's gradient ``into (+)= a @ b`` (``overwrite``: =) and its bias's, ``vector =
    b.sum(axis=0)`` (written, never added), in one GEMM; False where GEMM_BGRAD does not
    take it (the caller runs its GEMM and its row sum)."""
    op = _op("bgrad", a, b, into, vector)
    if op is None or into.shape != (a.shape[0], b.shape[1]) or not into.flags.c_contiguous \
            or vector.shape != (b.shape[1],) or not vector.flags.c_contiguous:
        return False
    if not _supported(op, a, b, into, epilogue="bgrada", vector=vector):
        return False
    op(a, b, into, vector, overwrite)
    return True
