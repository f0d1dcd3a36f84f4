"""Elementwise fused kernels: GELU (and a Linear's bias + GELU), bias + residual added into a
product, two gradients summed, a bf16 gradient widened into its float32 master; 16 bytes a
thread where the arrays allow (common.py's vectors). A bias's gradient: colsum.py; AdamW's
kernels: adamw.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _VECTOR, GELU_C, vectors


# ---- GELU ----------------------------------------------------------------------------------

# d gelu(v) / dv, tanh form (gelu_colsum.py's kernel shares it)
GELU_GRAD = r"""
#define GELU_C ((A)0.7978845608028654)
__device__ __forceinline__ A gelu_grad_of(A v) {
    A t = tanh(GELU_C * (v + (A)0.044715 * v * v * v));
    return (A)0.5 * ((A)1 + t)
        + (A)0.5 * v * ((A)1 - t * t) * GELU_C * ((A)1 + (A)3 * (A)0.044715 * v * v);
}
"""

_GELU = _VECTOR + GELU_GRAD + r"""
__device__ __forceinline__ A gelu_of(A v) {
    A t = tanh(GELU_C * (v + (A)0.044715 * v * v * v));
    return (A)0.5 * v * ((A)1 + t);
}
// VEC elements a thread (common.py's _VECTOR): thread t takes [t VEC, (t + 1) VEC)
extern "C" __global__ void gelu_fwd(const T* x, T* y, long long n) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T xv[VEC], yv[VEC];
    copy_vec(xv, x + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) yv[j] = (T)gelu_of((A)xv[j]);
    copy_vec(y + i, yv);
}
// h += b (kept for the backward), y = gelu(h): a Linear's bias and the GELU in one pass (a
// vector never straddles a row: m divides by VEC)
extern "C" __global__ void bias_gelu_fwd(T* h, const T* b, T* y, long long n, int m) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T hv[VEC], bv[VEC], yv[VEC];
    copy_vec(hv, h + i);
    copy_vec(bv, b + i % m);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        hv[j] = (T)((A)hv[j] + (A)bv[j]);
        yv[j] = (T)gelu_of((A)hv[j]);                // of the stored value, as the twin's
    }
    copy_vec(h + i, hv);
    copy_vec(y + i, yv);
}
extern "C" __global__ void gelu_bwd(const T* x, const T* g, T* gx, long long n) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T xv[VEC], gv[VEC], ov[VEC];
    copy_vec(xv, x + i);
    copy_vec(gv, g + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) ov[j] = (T)((A)gv[j] * gelu_grad_of((A)xv[j]));
    copy_vec(gx + i, ov);
}
"""


def _gelu_tanh(x):
    """tanh(c (x + 0.044715 x^3)), in place in one temporary."""
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= GELU_C
    return backend.array_module(x).tanh(t, out=t)


def gelu_twin(x):
    """(0.5 x (1 + tanh(c (x + 0.044715 x^3))), the tanh for the backward), in place where it
    can (3 temporaries; the kernel keeps no tanh: its backward recomputes it)."""
    t = _gelu_tanh(x)
    out = t + 1.0
    out *= x
    out *= 0.5
    return out, t


def gelu_bwd_twin(x, g, t=None):
    """g times d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2); ``t`` the
    forward's tanh when it kept one."""
    xp = backend.array_module(x)
    if t is None:
        t = _gelu_tanh(x)
    d = x * x
    d *= 3 * 0.044715 * GELU_C
    d += GELU_C
    d *= x
    s = t * t
    xp.subtract(1.0, s, out=s)
    s *= d
    s += t
    s += 1.0
    s *= 0.5
    s *= g
    return s


def bias_gelu_twin(h, b):
    """``h += b`` in place, then (gelu(h), its tanh): a Linear's bias and GELU in one pass."""
    h += b
    return gelu_twin(h)


def _bias_gelu_launch(k, h, b):
    y = backend.xp().empty_like(h)
    b = backend.xp().ascontiguousarray(b)
    fn, (blocks, threads) = vectors(k, "bias_gelu_fwd", h.size, h, b, y, row=h.shape[-1])
    fn(blocks, threads, (h, b, y, np.int64(h.size), np.int32(h.shape[-1])))
    return y, None


def _gelu_launch(k, x):
    y = backend.xp().empty_like(x)
    fn, (blocks, threads) = vectors(k, "gelu_fwd", x.size, x, y)
    fn(blocks, threads, (x, y, np.int64(x.size)))
    return y, None


def _gelu_bwd_launch(k, x, g, t=None):
    gx = backend.xp().empty_like(x)
    g = backend.xp().ascontiguousarray(g)
    fn, (blocks, threads) = vectors(k, "gelu_bwd", x.size, x, g, gx)
    fn(blocks, threads, (x, g, gx, np.int64(x.size)))
    return gx


def _elementwise_cases(xp, rng, dtype, n_in=1):
    for shape in ((1,), (7,), (3, 257), (5, 1000)):
        yield tuple(xp.asarray((rng.standard_normal(shape) * 3).astype(dtype))
                    for _ in range(n_in))


GELU_FWD = Fused("gelu_fwd", _GELU, ["gelu_fwd"], _gelu_launch, gelu_twin,
                 lambda xp, rng, dt: _elementwise_cases(xp, rng, dt, 1), compare=1,
                 cpu="cpu.gelu")
BIAS_GELU = Fused("bias_gelu_fwd", _GELU, ["bias_gelu_fwd"], _bias_gelu_launch, bias_gelu_twin,
                  lambda xp, rng, dt: ((x, xp.asarray(rng.standard_normal(x.shape[-1])
                                                     .astype(dt)))
                                       for (x,) in _elementwise_cases(xp, rng, dt, 1)),
                  compare=1,
                  cpu="cpu.bias_gelu")
GELU_BWD = Fused("gelu_bwd", _GELU, ["gelu_bwd"], _gelu_bwd_launch, gelu_bwd_twin,
                 lambda xp, rng, dt: _elementwise_cases(xp, rng, dt, 2),
                 cpu="cpu.gelu_bwd")


# ---- bias and residual added into a product ------------------------------------------------

_BIAS_RESIDUAL = _VECTOR + r"""
// out (N, m) += bias (m) and/or residual (N, m), in place: one pass (flags say which), VEC
// elements a thread
extern "C" __global__ void bias_residual(T* out, const T* bias, const T* residual,
                                         long long n, int m, int has_bias, int has_residual) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T ov[VEC], bv[VEC], rv[VEC];
    copy_vec(ov, out + i);
    if (has_bias) copy_vec(bv, bias + i % m);
    if (has_residual) copy_vec(rv, residual + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A v = (A)ov[j];
        if (has_bias) v += (A)bv[j];
        if (has_residual) v += (A)rv[j];
        ov[j] = (T)v;
    }
    copy_vec(out + i, ov);
}
"""


def bias_residual_twin(out, bias=None, residual=None):
    """``out += bias; out += residual`` (either may be None); returns out."""
    if bias is not None:
        out += bias
    if residual is not None:
        out += residual
    return out


def _bias_residual_launch(k, out, bias=None, residual=None):
    xp = backend.xp()
    has_bias, has_residual = bias is not None, residual is not None
    dummy = out                                   # a valid pointer for an absent operand
    bias = xp.ascontiguousarray(bias) if has_bias else dummy
    residual = xp.ascontiguousarray(residual) if has_residual else dummy
    fn, (blocks, threads) = vectors(k, "bias_residual", out.size, out, bias, residual,
                                     row=out.shape[-1])
    fn(blocks, threads, (out, bias, residual, np.int64(out.size), np.int32(out.shape[-1]),
                         np.int32(has_bias), np.int32(has_residual)))
    return out


def _bias_residual_cases(xp, rng, dt):
    for shape in ((1, 1), (3, 7), (2, 5, 768)):
        arr = lambda s: xp.asarray(rng.standard_normal(s).astype(dt))  # noqa: E731
        yield arr(shape), arr(shape[-1]), arr(shape)
        yield arr(shape), arr(shape[-1]), None
        yield arr(shape), None, arr(shape)


BIAS_RESIDUAL = Fused("bias_residual", _BIAS_RESIDUAL, ["bias_residual"], _bias_residual_launch,
                      bias_residual_twin, _bias_residual_cases,
                      cpu="cpu.bias_residual")

# ---- two gradients of one tensor, summed -----------------------------------------------------

_ADD = _VECTOR + r"""
// out = a + b, VEC elements a thread: autograd's engine summing the gradients a tensor gets
// from two consumers (the residual stream's, twice a layer); CuPy's add reads 2 bytes a
// thread in bf16 (41 us a call at GPT-2 medium on an H200, a quarter of its memory's speed)
extern "C" __global__ void add2(const T* a, const T* b, T* out, long long n) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T av[VEC], bv[VEC];
    copy_vec(av, a + i);
    copy_vec(bv, b + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) av[j] = (T)((A)av[j] + (A)bv[j]);
    copy_vec(out + i, av);
}
"""


def add_twin(a, b):
    """``a + b``, a new array."""
    return a + b


def _add_launch(k, a, b):
    xp = backend.xp()
    a, b = xp.ascontiguousarray(a), xp.ascontiguousarray(b)
    out = xp.empty_like(a)
    fn, (blocks, threads) = vectors(k, "add2", a.size, a, b, out)
    fn(blocks, threads, (a, b, out, np.int64(a.size)))
    return out


ADD = Fused("add2", _ADD, ["add2"], _add_launch, add_twin,
            lambda xp, rng, dt: _elementwise_cases(xp, rng, dt, 2))


# ---- a 2-byte gradient widened into its float32 master ----------------------------------------

_WIDEN = _VECTOR + r"""
// y (float32) = x (bf16): mixed precision's gradient into the fp32 master's bucket, where DDP
// averages it (CuPy's copy read 2 bytes a thread: 297 us for 60M elements on an H200, a
// quarter of its memory's speed). VEC bf16 in, VEC floats out in VEC / 4 16-byte stores.
#ifdef __CUDACC_RTC__
__device__ __forceinline__ void copy_floats(float* dst, const float* src) {
#if VEC > 1
    for (int q = 0; q < VEC / 4; q++) ((uint4*)dst)[q] = ((const uint4*)src)[q];
#else
    dst[0] = src[0];
#endif
}
#else
__device__ __forceinline__ void copy_floats(float* dst, const float* src) {
    if (VEC > 1) { sim_check16(dst, "store"); sim_check16(src, "load"); }
    for (int j = 0; j < VEC; j++) dst[j] = src[j];
}
#endif
extern "C" __global__ void widen(const T* x, float* y, long long n) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    alignas(16) T xv[VEC];
    alignas(16) float yv[VEC];
    copy_vec(xv, x + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) yv[j] = (float)xv[j];
    copy_floats(y + i, yv);
}
"""


def widen_twin(x, y):
    """``y[...] = x`` (a float32 ``y`` from a 2-byte ``x`` of its shape); returns y."""
    y[...] = x
    return y


def _widen_launch(k, x, y):
    if y.dtype != np.float32 or not y.flags.c_contiguous or x.shape != y.shape:
        return widen_twin(x, y)
    x = backend.xp().ascontiguousarray(x)
    fn, (blocks, threads) = vectors(k, "widen", x.size, x, y)
    fn(blocks, threads, (x, y, np.int64(x.size)))
    return y


def _widen_cases(xp, rng, dt):
    for shape in ((1,), (7,), (3, 257), (5, 1000), (4, 1024)):
        yield (xp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt),
               xp.zeros(shape, dtype=np.float32))


WIDEN = Fused("widen", _WIDEN, ["widen"], _widen_launch, widen_twin, _widen_cases,
              tolerance=0.0, dtypes=("bfloat16",))
