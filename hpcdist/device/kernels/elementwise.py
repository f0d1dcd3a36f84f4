"""Elementwise fused kernels: GELU (and a Linear's bias + GELU), bias + residual added into a
product, a bias's gradient added into its buffer, AdamW over the whole flat buffer."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused, grid
from .common import GELU_C, _rows, _scalar


# ---- GELU ----------------------------------------------------------------------------------

_GELU = r"""
#define GELU_C ((A)0.7978845608028654)
extern "C" __global__ void gelu_fwd(const T* x, T* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    A v = (A)x[i];
    A t = tanh(GELU_C * (v + (A)0.044715 * v * v * v));
    y[i] = (T)((A)0.5 * v * ((A)1 + t));
}
// h += b (kept for the backward), y = gelu(h): a Linear's bias and the GELU in one pass
extern "C" __global__ void bias_gelu_fwd(T* h, const T* b, T* y, long long n, int m) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    A v = (A)h[i] + (A)b[i % m];
    h[i] = (T)v;
    v = (A)h[i];                                   // the stored value, as the twin sees it
    A t = tanh(GELU_C * (v + (A)0.044715 * v * v * v));
    y[i] = (T)((A)0.5 * v * ((A)1 + t));
}
extern "C" __global__ void gelu_bwd(const T* x, const T* g, T* gx, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    A v = (A)x[i];
    A t = tanh(GELU_C * (v + (A)0.044715 * v * v * v));
    A d = (A)0.5 * ((A)1 + t)
        + (A)0.5 * v * ((A)1 - t * t) * GELU_C * ((A)1 + (A)3 * (A)0.044715 * v * v);
    gx[i] = (T)((A)g[i] * d);
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
    k("bias_gelu_fwd")(*grid(h.size), (h, backend.xp().ascontiguousarray(b), y,
                                       np.int64(h.size), np.int32(h.shape[-1])))
    return y, None


def _gelu_launch(k, x):
    y = backend.xp().empty_like(x)
    k("gelu_fwd")(*grid(x.size), (x, y, np.int64(x.size)))
    return y, None


def _gelu_bwd_launch(k, x, g, t=None):
    gx = backend.xp().empty_like(x)
    k("gelu_bwd")(*grid(x.size), (x, backend.xp().ascontiguousarray(g), gx, np.int64(x.size)))
    return gx


def _elementwise_cases(xp, rng, dtype, n_in=1):
    for shape in ((1,), (7,), (3, 257), (5, 1000)):
        yield tuple(xp.asarray((rng.standard_normal(shape) * 3).astype(dtype))
                    for _ in range(n_in))


GELU_FWD = Fused("gelu_fwd", _GELU, ["gelu_fwd"], _gelu_launch, gelu_twin,
                 lambda xp, rng, dt: _elementwise_cases(xp, rng, dt, 1), compare=1)
BIAS_GELU = Fused("bias_gelu_fwd", _GELU, ["bias_gelu_fwd"], _bias_gelu_launch, bias_gelu_twin,
                  lambda xp, rng, dt: ((x, xp.asarray(rng.standard_normal(x.shape[-1])
                                                     .astype(dt)))
                                       for (x,) in _elementwise_cases(xp, rng, dt, 1)),
                  compare=1)
GELU_BWD = Fused("gelu_bwd", _GELU, ["gelu_bwd"], _gelu_bwd_launch, gelu_bwd_twin,
                 lambda xp, rng, dt: _elementwise_cases(xp, rng, dt, 2))


# ---- bias and residual added into a product ------------------------------------------------

_BIAS_RESIDUAL = r"""
// out (N, m) += bias (m) and/or residual (N, m), in place: one pass (flags say which)
extern "C" __global__ void bias_residual(T* out, const T* bias, const T* residual,
                                         long long n, int m, int has_bias, int has_residual) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    A v = (A)out[i];
    if (has_bias) v += (A)bias[i % m];
    if (has_residual) v += (A)residual[i];
    out[i] = (T)v;
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
    dummy = out                                   # a valid pointer for an absent operand
    k("bias_residual")(*grid(out.size), (
        out, dummy if bias is None else xp.ascontiguousarray(bias),
        dummy if residual is None else xp.ascontiguousarray(residual), np.int64(out.size),
        np.int32(out.shape[-1]), np.int32(bias is not None), np.int32(residual is not None)))
    return out


def _bias_residual_cases(xp, rng, dt):
    for shape in ((1, 1), (3, 7), (2, 5, 768)):
        arr = lambda s: xp.asarray(rng.standard_normal(s).astype(dt))  # noqa: E731
        yield arr(shape), arr(shape[-1]), arr(shape)
        yield arr(shape), arr(shape[-1]), None
        yield arr(shape), None, arr(shape)


BIAS_RESIDUAL = Fused("bias_residual", _BIAS_RESIDUAL, ["bias_residual"], _bias_residual_launch,
                      bias_residual_twin, _bias_residual_cases)

# ---- a bias's gradient, added into its buffer ----------------------------------------------

_COLSUM = r"""
// out[c] += sum over rows of g[r, c]: a block of 32 x 32 threads per 32 columns. Thread (x, y)
// sums rows y, y + 32, ... of column c (a warp reads 32 adjacent addresses of a row), then
// thread (x, 0) adds the column's 32 partial sums in a fixed order (no atomics: the same bits
// every run). One thread per column, looping over all rows, left most of an H200 idle: 400 us
// for 4096 x 768.
extern "C" __global__ void colsum_add(const T* g, T* out, long long rows, int C) {
    __shared__ A part[32][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    A s = 0;
    if (c < C)
        for (long long r = threadIdx.y; r < rows; r += 32) s += (A)g[r * C + c];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        A t = 0;
        for (int y = 0; y < 32; y++) t += part[y][threadIdx.x];
        out[c] = (T)((A)out[c] + t);
    }
}
"""


def colsum_add_twin(g, out):
    """``out += g.sum(axis=0)`` for g (N, C); returns out (2-byte floats summed in float32,
    as the kernel does)."""
    out += g.sum(axis=0, dtype=np.float32) if g.dtype.itemsize == 2 else g.sum(axis=0)
    return out


def _colsum_launch(k, g, out):
    rows, C = _rows(g)
    k("colsum_add")((max(1, -(-C // 32)),), (32, 32),
                    (backend.xp().ascontiguousarray(g), out, np.int64(rows), np.int32(C)))
    return out


def _colsum_cases(xp, rng, dt):
    for rows, C in ((1, 1), (3, 7), (1000, 65), (4096, 768)):
        yield (xp.asarray(rng.standard_normal((rows, C)).astype(dt)),
               xp.asarray(rng.standard_normal(C).astype(dt)))


COLSUM_ADD = Fused("colsum_add", _COLSUM, ["colsum_add"], _colsum_launch, colsum_add_twin,
                   _colsum_cases, tolerance=1e-5)


# ---- AdamW ---------------------------------------------------------------------------------

_ADAMW = r"""
// element i's step, in the twin's order (optim.adamw_update): p, m, v in place; the new p
__device__ __forceinline__ T adamw_at(long long i, T* p, const T* g, T* m, T* v,
                                      const unsigned char* decay, A lr, A beta1, A beta2,
                                      A eps, A wd, A bias1, A sqrt_bias2) {
    A pi = (A)p[i], gi = (A)g[i];
    if (decay[i]) pi *= (A)1 - lr * wd;
    A vi = (A)v[i] * beta2 + gi * gi * ((A)1 - beta2);
    A mi = (A)m[i] * beta1 + gi * ((A)1 - beta1);
    A denom = sqrt(vi) / sqrt_bias2 + eps;
    T out = (T)(pi - mi / denom * (lr / bias1));
    p[i] = out;
    m[i] = (T)mi;
    v[i] = (T)vi;
    return out;
}
// one thread per element of the flat buffer
extern "C" __global__ void adamw(T* p, const T* g, T* m, T* v, const unsigned char* decay,
                                 long long n, A lr, A beta1, A beta2, A eps, A wd, A bias1,
                                 A sqrt_bias2) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) adamw_at(i, p, g, m, v, decay, lr, beta1, beta2, eps, wd, bias1, sqrt_bias2);
}
// the same step writing the bf16 compute copy of the new parameters beside the fp32 master
// (mixed precision: no second pass over the parameters), rounded to nearest even
extern "C" __global__ void adamw_low(T* p, const T* g, T* m, T* v, const unsigned char* decay,
                                     long long n, A lr, A beta1, A beta2, A eps, A wd,
                                     A bias1, A sqrt_bias2, unsigned short* low) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    T out = adamw_at(i, p, g, m, v, decay, lr, beta1, beta2, eps, wd, bias1, sqrt_bias2);
    unsigned u = __float_as_uint((float)out);
    low[i] = ((u & 0x7fffffffu) > 0x7f800000u)
        ? (unsigned short)((u >> 16) | 0x40u)                       // NaN stays a NaN
        : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); // nearest, ties even
}
"""


def adamw_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step):
    """One AdamW step of flat p with moments m, v (in place); ``decay``: a uint8 mask of the
    elements that take weight decay. Returns (p, m, v)."""
    xp = backend.array_module(p)
    if wd:
        p *= xp.where(decay.astype(bool), 1.0 - lr * wd, 1.0).astype(p.dtype)
    adam_step_twin(p, g, m, v, lr, beta1, beta2, eps, step)
    return p, m, v


def adam_step_twin(p, g, m, v, lr, beta1, beta2, eps, step) -> None:
    """Adam's moments and bias-corrected step, in place, the same operations in the same order
    through one scratch array (the textbook expressions make three flat temporaries: a step's
    peak memory, and time). optim.adamw_update runs it on the host."""
    xp = backend.array_module(p)
    tmp = g * g
    tmp *= 1.0 - beta2
    v *= beta2
    v += tmp
    xp.multiply(g, 1.0 - beta1, out=tmp)
    m *= beta1
    m += tmp
    xp.sqrt(v, out=tmp)
    tmp /= math.sqrt(1.0 - beta2 ** step)
    tmp += eps
    xp.divide(m, tmp, out=tmp)
    tmp *= lr / (1.0 - beta1 ** step)
    p -= tmp


def _adamw_launch(k, p, g, m, v, decay, lr, beta1, beta2, eps, wd, step):
    acc = np.float64 if p.dtype == np.float64 else np.float32
    s = lambda x: _scalar(acc, x)   # noqa: E731
    k("adamw")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), s(lr), s(beta1), s(beta2),
                               s(eps), s(wd), s(1.0 - beta1 ** step),
                               s(math.sqrt(1.0 - beta2 ** step))))
    return p, m, v


def _adamw_cases(xp, rng, dt):
    for n in (1, 7, 1000, 100_003):
        arr = lambda scale=1.0: xp.asarray((rng.standard_normal(n) * scale).astype(dt))  # noqa
        decay = xp.asarray((rng.random(n) < 0.5).astype(np.uint8))
        yield arr(), arr(), arr(0.1), xp.abs(arr(0.01)), decay, 1e-3, 0.9, 0.99, 1e-8, 0.1, 3


ADAMW = Fused("adamw", _ADAMW, ["adamw"], _adamw_launch, adamw_twin, _adamw_cases,
              tolerance=1e-5)


def adamw_low_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, low):
    """AdamW's step (adamw_twin), then ``low``: the new parameters in its dtype (bf16)."""
    adamw_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step)
    low[...] = backend.round_to_bf16(p)          # (exact in a bf16 array, and in a float32 one)
    return p, m, v, low


def _adamw_low_launch(k, p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, low):
    s = lambda x: _scalar(np.float32, x)   # noqa: E731
    k("adamw_low")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), s(lr), s(beta1),
                                   s(beta2), s(eps), s(wd), s(1.0 - beta1 ** step),
                                   s(math.sqrt(1.0 - beta2 ** step)), low.view(np.uint16)))
    return p, m, v, low


def _adamw_low_cases(xp, rng, dt):
    bf16 = backend.bfloat16()
    for args in _adamw_cases(xp, rng, dt):
        yield args + (xp.zeros(args[0].shape, dtype=bf16),)


# fp32 master weights in, their bf16 compute copy written by the same kernel (the copy's
# rounding is exact: the tolerance is the update's, as ADAMW's)
ADAMW_LOW = Fused("adamw_low", _ADAMW, ["adamw_low"], _adamw_low_launch, adamw_low_twin,
                  _adamw_low_cases, tolerance=1e-5, dtypes=("float32",))
