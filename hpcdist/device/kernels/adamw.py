"""AdamW over the whole flat buffer in one kernel, beside its NumPy twin (optim.adamw_update's
order): fp32 or fp64 parameters in place, and the variant that also writes the bf16 compute
copy of the new parameters (mixed precision: no second pass)."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused, grid
from .common import _scalar


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
              tolerance=1e-5,
              cpu="cpu.adamw")


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
