"""AdamW over the whole flat buffer in one kernel, beside its NumPy twin (optim.adamw_update's
order): fp32 or fp64 parameters in place, and the variant that also writes the bf16 compute
copy of the new parameters (mixed precision: no second pass).

Each has a variant that reads its step's learning rate and bias corrections from the device
(``*_sched``: ``sched`` = [step, lr, 1 - beta1^step, sqrt(1 - beta2^step)], float64) as
``LR_SCHEDULE``'s one-thread kernel advances them (optim.DeviceSchedule): a step replayed as
a CUDA graph then needs no value from the host (the host's would be frozen at the capture).

Each clips the gradient as it reads it (``norm``, ``max_norm``: optim.clip's rule, the factor
from the norm where it is, on the device when it is there), as llm.c's AdamW does: no pass
over the gradient to scale it, and the gradient is left as backward wrote it."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused, grid
from .common import _scalar, kept_zeros


# ---- AdamW ---------------------------------------------------------------------------------

_ADAMW = r"""
// the clipping factor of a gradient of global norm *norm (clip_factor's device rule:
// min(1, max_norm / (norm + 1e-6)) in double, a NaN norm giving NaN); 1 where max_norm is 0
__device__ __forceinline__ A clip_factor(const double* norm, double max_norm) {
    if (max_norm == 0.0) return (A)1;
    double q = max_norm / (*norm + 1e-6);
    return (A)(q >= 1.0 ? 1.0 : q);
}
// element i's step, in the twin's order (optim.adamw_update): p, m, v in place; the new p;
// ``clip``: the gradient's clipping factor
__device__ __forceinline__ T adamw_at(long long i, T* p, const T* g, T* m, T* v,
                                      const unsigned char* decay, A clip, A lr, A beta1,
                                      A beta2, A eps, A wd, A bias1, A sqrt_bias2) {
    A pi = (A)p[i], gi = (A)g[i] * clip;
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
                                 A sqrt_bias2, const double* norm, double max_norm) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) adamw_at(i, p, g, m, v, decay, clip_factor(norm, max_norm), lr, beta1, beta2,
                        eps, wd, bias1, sqrt_bias2);
}
// the learning rate and bias corrections of this step, from the device (LR_SCHEDULE's)
#define SCHED(s) (A)s[1], beta1, beta2, eps, wd, (A)s[2], (A)s[3]
extern "C" __global__ void adamw_sched(T* p, const T* g, T* m, T* v,
                                       const unsigned char* decay, long long n,
                                       const double* sched, A beta1, A beta2, A eps, A wd,
                                       const double* norm, double max_norm) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) adamw_at(i, p, g, m, v, decay, clip_factor(norm, max_norm), SCHED(sched));
}
__device__ __forceinline__ unsigned short bf16_nearest(T out) {
    unsigned u = __float_as_uint((float)out);
    return ((u & 0x7fffffffu) > 0x7f800000u)
        ? (unsigned short)((u >> 16) | 0x40u)                       // NaN stays a NaN
        : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); // nearest, ties even
}
extern "C" __global__ void adamw_low_sched(T* p, const T* g, T* m, T* v,
                                           const unsigned char* decay, long long n,
                                           const double* sched, A beta1, A beta2, A eps,
                                           A wd, const double* norm, double max_norm,
                                           unsigned short* low) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) low[i] = bf16_nearest(adamw_at(i, p, g, m, v, decay,
                                              clip_factor(norm, max_norm), SCHED(sched)));
}
// the same step writing the bf16 compute copy of the new parameters beside the fp32 master
// (mixed precision: no second pass over the parameters), rounded to nearest even
extern "C" __global__ void adamw_low(T* p, const T* g, T* m, T* v, const unsigned char* decay,
                                     long long n, A lr, A beta1, A beta2, A eps, A wd,
                                     A bias1, A sqrt_bias2, const double* norm,
                                     double max_norm, unsigned short* low) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    low[i] = bf16_nearest(adamw_at(i, p, g, m, v, decay, clip_factor(norm, max_norm), lr,
                                   beta1, beta2, eps, wd, bias1, sqrt_bias2));
}
"""


def clip_factor(norm, max_norm: float):
    """optim.clip's factor for a gradient of global ``norm``: min(1, max_norm / (norm +
    1e-6)). A 0-d float64 array where the norm is on a device (not read; a NaN norm gives
    NaN); else a Python float, None where it is 1 (a NaN norm too: nothing scaled). None
    where ``max_norm`` is 0 (no clipping)."""
    if not max_norm:
        return None
    if backend.is_gpu_array(norm):
        return backend.array_module(norm).minimum(1.0, max_norm / (norm + 1e-6))
    factor = min(1.0, max_norm / (float(norm) + 1e-6))
    return factor if factor < 1.0 else None


def clipped_twin(g, norm, max_norm: float):
    """``g`` scaled by its clipping factor (a new array), or ``g`` itself where the factor is
    1: the gradient AdamW's kernels read (optim.clip's product, out of place)."""
    factor = clip_factor(norm, max_norm)
    if factor is None:
        return g
    return g * (factor.astype(g.dtype) if backend.is_gpu_array(factor) else factor)


def adamw_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm):
    """One AdamW step of flat p with moments m, v (in place); ``decay``: a uint8 mask of the
    elements that take weight decay; the gradient clipped first by ``norm`` and
    ``max_norm`` (clipped_twin). Returns (p, m, v)."""
    xp = backend.array_module(p)
    g = clipped_twin(g, norm, max_norm)
    if wd:
        p *= xp.where(decay.astype(bool), 1.0 - lr * wd, 1.0).astype(p.dtype)
    adam_step_twin(p, g, m, v, lr, beta1, beta2, eps, step)
    return p, m, v


def adam_step_twin(p, g, m, v, lr, beta1, beta2, eps, step) -> None:
    """Adam's moments and bias-corrected step, in place, the same operations in the same order
    through one scratch array (the textbook expressions make three flat temporaries: a step's
    peak memory, and time). optim.adamw_update runs it on the host."""
    _moments_and_step(p, g, m, v, beta1, beta2, eps, math.sqrt(1.0 - beta2 ** step),
                      lr / (1.0 - beta1 ** step))


def _moments_and_step(p, g, m, v, beta1, beta2, eps, sqrt_bias2, step_size) -> None:
    """adam_step_twin's body, its bias corrections given (host numbers, or 0-d device
    arrays: the scheduled twins')."""
    xp = backend.array_module(p)
    tmp = g * g
    tmp *= 1.0 - beta2
    v *= beta2
    v += tmp
    xp.multiply(g, 1.0 - beta1, out=tmp)
    m *= beta1
    m += tmp
    xp.sqrt(v, out=tmp)
    tmp /= sqrt_bias2
    tmp += eps
    xp.divide(m, tmp, out=tmp)
    tmp *= step_size
    p -= tmp


def reads_norm(norm) -> bool:
    """Whether the kernels can read ``norm`` where it is: one float64 in an array."""
    return getattr(norm, "dtype", None) == np.float64 and norm.size == 1


def _clip_args(norm, max_norm) -> tuple:
    """The kernels' (norm, max_norm): the device norm (float64), or, with max_norm 0, a
    kept zero the kernel does not read (a pointer it is given all the same)."""
    if not max_norm:
        norm = kept_zeros(backend.xp(), 1, np.float64, "adamw's norm when not clipping")
    elif not reads_norm(norm):
        raise TypeError("AdamW's kernel clips by a norm on the device (one float64), not "
                        f"{type(norm).__name__} {getattr(norm, 'dtype', '')}")
    return norm, np.float64(max_norm)


def _adamw_launch(k, p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm):
    acc = np.float64 if p.dtype == np.float64 else np.float32
    s = lambda x: _scalar(acc, x)   # noqa: E731
    k("adamw")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), s(lr), s(beta1), s(beta2),
                               s(eps), s(wd), s(1.0 - beta1 ** step),
                               s(math.sqrt(1.0 - beta2 ** step))) + _clip_args(norm, max_norm))
    return p, m, v


# the gradient's (norm, max_norm) of each case: not clipped, clipped (factor 0.27, 0.22),
# within the norm (factor 1)
_CLIPS = ((0.0, 0.0), (3.7, 1.0), (0.5, 1.0), (9.0, 2.0))


def _adamw_cases(xp, rng, dt):
    for n, (norm, max_norm) in zip((1, 7, 1000, 100_003), _CLIPS):
        arr = lambda scale=1.0: xp.asarray((rng.standard_normal(n) * scale).astype(dt))  # noqa
        decay = xp.asarray((rng.random(n) < 0.5).astype(np.uint8))
        yield (arr(), arr(), arr(0.1), xp.abs(arr(0.01)), decay, 1e-3, 0.9, 0.99, 1e-8, 0.1, 3,
               xp.asarray(np.float64(norm)), max_norm)


ADAMW = Fused("adamw", _ADAMW, ["adamw"], _adamw_launch, adamw_twin, _adamw_cases,
              tolerance=1e-5,
              cpu="cpu_flat.adamw")


def adamw_low_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm, low):
    """AdamW's step (adamw_twin), then ``low``: the new parameters in its dtype (bf16)."""
    adamw_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm)
    return _low_copy(p, m, v, low)


def _low_copy(p, m, v, low):
    low[...] = backend.round_to_bf16(p)          # (exact in a bf16 array, and in a float32 one)
    return p, m, v, low


def _adamw_low_launch(k, p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm,
                      low):
    s = lambda x: _scalar(np.float32, x)   # noqa: E731
    k("adamw_low")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), s(lr), s(beta1),
                                   s(beta2), s(eps), s(wd), s(1.0 - beta1 ** step),
                                   s(math.sqrt(1.0 - beta2 ** step)))
                   + _clip_args(norm, max_norm) + (low.view(np.uint16),))
    return p, m, v, low


def _with_low(cases):
    """``cases`` with a bf16 array for the compute copy after each case's arguments."""
    def with_low(xp, rng, dt):
        bf16 = backend.bfloat16()
        for args in cases(xp, rng, dt):
            yield args + (xp.zeros(args[0].shape, dtype=bf16),)
    return with_low


# fp32 master weights in, their bf16 compute copy written by the same kernel (the copy's
# rounding is exact: the tolerance is the update's, as ADAMW's)
ADAMW_LOW = Fused("adamw_low", _ADAMW, ["adamw_low"], _adamw_low_launch, adamw_low_twin,
                  _with_low(_adamw_cases), tolerance=1e-5, dtypes=("float32",))


# ---- the step's schedule on the device, and AdamW reading it -------------------------------

_LR_SCHEDULE = r"""
// optim.lr_at on the device, one thread: the next step's count, learning rate (linear warmup,
// then cosine to min_lr at total) and AdamW's bias corrections, in sched
extern "C" __global__ void lr_schedule(double* sched, double base_lr, double min_lr,
                                       long long warmup, long long total, double beta1,
                                       double beta2) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double step = sched[0] + 1.0, lr;
    if (warmup > 0 && step <= (double)warmup) {
        lr = base_lr * step / (double)warmup;
    } else if (step >= (double)total) {
        lr = min_lr;
    } else {
        long long span = total - warmup > 1 ? total - warmup : 1;
        double progress = (step - (double)warmup) / (double)span;
        lr = min_lr + 0.5 * (base_lr - min_lr) * (1.0 + cos(3.141592653589793 * progress));
    }
    sched[0] = step;
    sched[1] = lr;
    sched[2] = 1.0 - pow(beta1, step);
    sched[3] = sqrt(1.0 - pow(beta2, step));
}
"""


def lr_schedule_twin(sched, base_lr, min_lr, warmup, total, beta1, beta2):
    """``sched`` (float64 [step, lr, 1 - beta1^step, sqrt(1 - beta2^step)]) advanced one step
    in place, as optim.lr_at counts: device operations only (no value read to the host)."""
    xp = backend.array_module(sched)
    step = sched[0] + 1.0
    progress = (step - warmup) / max(1, total - warmup)
    lr = xp.where(step >= total, min_lr,
                  min_lr + 0.5 * (base_lr - min_lr) * (1.0 + xp.cos(math.pi * progress)))
    if warmup > 0:
        lr = xp.where(step <= warmup, base_lr * step / warmup, lr)
    sched[1] = lr
    sched[2] = 1.0 - beta1 ** step
    sched[3] = xp.sqrt(1.0 - beta2 ** step)
    sched[0] = step
    return sched


def _lr_schedule_launch(k, sched, base_lr, min_lr, warmup, total, beta1, beta2):
    f = np.float64
    k("lr_schedule")((1,), (32,), (sched, f(base_lr), f(min_lr), np.int64(warmup),
                                   np.int64(total), f(beta1), f(beta2)))
    return sched


def _lr_schedule_cases(xp, rng, dt):
    for warmup, total in ((0, 10), (4, 10), (4, 4), (3, 1)):
        for step in range(0, total + 3):
            yield (xp.asarray(np.array([step, 0, 0, 0], dtype=np.float64)), 3e-4, 3e-5, warmup,
                   total, 0.9, 0.95)


LR_SCHEDULE = Fused("lr_schedule", _LR_SCHEDULE, ["lr_schedule"], _lr_schedule_launch,
                    lr_schedule_twin, _lr_schedule_cases, tolerance=1e-12, dtypes=("float64",))


def _sched_terms(sched, dtype):
    """(lr, 1 - beta1^step, sqrt(1 - beta2^step)) of ``sched`` as 0-d arrays of ``dtype``
    (where the kernel rounds them to its A)."""
    return tuple(sched[i].astype(dtype) for i in (1, 2, 3))


def adamw_sched_twin(p, g, m, v, decay, sched, beta1, beta2, eps, wd, norm, max_norm):
    """adamw_twin with its learning rate and bias corrections read from ``sched`` on the
    device (LR_SCHEDULE's)."""
    xp = backend.array_module(p)
    g = clipped_twin(g, norm, max_norm)
    lr, bias1, sqrt_bias2 = _sched_terms(sched, p.dtype)
    if wd:
        p *= xp.where(decay.astype(bool), 1.0 - lr * wd, 1.0).astype(p.dtype)
    _moments_and_step(p, g, m, v, beta1, beta2, eps, sqrt_bias2, lr / bias1)
    return p, m, v


def _adamw_sched_launch(k, p, g, m, v, decay, sched, beta1, beta2, eps, wd, norm, max_norm):
    acc = np.float64 if p.dtype == np.float64 else np.float32
    s = lambda x: _scalar(acc, x)   # noqa: E731
    k("adamw_sched")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), sched, s(beta1),
                                     s(beta2), s(eps), s(wd)) + _clip_args(norm, max_norm))
    return p, m, v


def _sched_cases(xp, rng, dt):
    for p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, *clip in _adamw_cases(xp, rng, dt):
        sched = np.array([step, lr, 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)])
        yield (p, g, m, v, decay, xp.asarray(sched), beta1, beta2, eps, wd, *clip)


ADAMW_SCHED = Fused("adamw_sched", _ADAMW, ["adamw_sched"], _adamw_sched_launch,
                    adamw_sched_twin, _sched_cases, tolerance=1e-5)


def adamw_low_sched_twin(p, g, m, v, decay, sched, beta1, beta2, eps, wd, norm, max_norm,
                         low):
    """adamw_sched_twin, then ``low``: the new parameters in its dtype (bf16)."""
    adamw_sched_twin(p, g, m, v, decay, sched, beta1, beta2, eps, wd, norm, max_norm)
    return _low_copy(p, m, v, low)


def _adamw_low_sched_launch(k, p, g, m, v, decay, sched, beta1, beta2, eps, wd, norm,
                            max_norm, low):
    s = lambda x: _scalar(np.float32, x)   # noqa: E731
    k("adamw_low_sched")(*grid(p.size), (p, g, m, v, decay, np.int64(p.size), sched, s(beta1),
                                         s(beta2), s(eps), s(wd))
                         + _clip_args(norm, max_norm) + (low.view(np.uint16),))
    return p, m, v, low


ADAMW_LOW_SCHED = Fused("adamw_low_sched", _ADAMW, ["adamw_low_sched"],
                        _adamw_low_sched_launch, adamw_low_sched_twin, _with_low(_sched_cases),
                        tolerance=1e-5, dtypes=("float32",))
