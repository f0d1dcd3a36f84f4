"""The gated MLPs' fused kernels from the fused gate | up projection (forward, backward), each
beside its NumPy twin, 16 bytes a thread: SwiGLU's silu(gate) * up and GeGLU's
gelu_tanh(gate) * up (Gemma). Their CPU kernels: cpu_norm_gate_rope.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _VECTOR, vectors
from .elementwise import gelu_bwd_twin, gelu_twin

# ---- the two gated activations -------------------------------------------------------------

_GATED = _VECTOR + r"""
#define GELU_C ((A)0.7978845608028654)
// f(a), and its derivative in d: KIND 0 silu(a) = a sigmoid(a), silu' = s (1 + a (1 - s));
// KIND 1 GELU's tanh form, gelu' = (1 + t) / 2 + a (1 - t^2) c (1 + 3 0.044715 a^2) / 2,
// t = tanh(c (a + 0.044715 a^3)) (the forward drops d: a few flops of a memory-bound pass)
template <int KIND> __device__ __forceinline__ A gate_of(A a, A& d) {
    if (KIND == 0) {
        A s = (A)1 / ((A)1 + exp(-a));
        d = s * ((A)1 + a * ((A)1 - s));
        return a * s;
    }
    A t = tanh(GELU_C * (a + (A)0.044715 * a * a * a));
    d = (A)0.5 * ((A)1 + t)
        + (A)0.5 * a * ((A)1 - t * t) * GELU_C * ((A)1 + (A)3 * (A)0.044715 * a * a);
    return (A)0.5 * a * ((A)1 + t);
}
// h (N, 2H) = [gate | up] -> y (N, H) = f(gate) up; VEC elements of y a thread (H divides by
// VEC: a vector stays in its row's half)
template <int KIND> __device__ void gated_fwd(const T* h, T* y, long long n, long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], yv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A d;
        yv[j] = (T)(gate_of<KIND>((A)av[j], d) * (A)uv[j]);
    }
    copy_vec(y + i, yv);
}
// dh = [g up f'(gate) | g f(gate)]
template <int KIND> __device__ void gated_bwd(const T* h, const T* g, T* dh, long long n,
                                              long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], gv[VEC], dav[VEC], duv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
    copy_vec(gv, g + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A d, gi = (A)gv[j];
        A f = gate_of<KIND>((A)av[j], d);
        dav[j] = (T)(gi * (A)uv[j] * d);
        duv[j] = (T)(gi * f);
    }
    copy_vec(dh + r * 2 * H + c, dav);
    copy_vec(dh + r * 2 * H + H + c, duv);
}
extern "C" __global__ void swiglu_fwd(const T* h, T* y, long long n, long long H) {
    gated_fwd<0>(h, y, n, H);
}
extern "C" __global__ void swiglu_bwd(const T* h, const T* g, T* dh, long long n, long long H) {
    gated_bwd<0>(h, g, dh, n, H);
}
extern "C" __global__ void geglu_fwd(const T* h, T* y, long long n, long long H) {
    gated_fwd<1>(h, y, n, H);
}
extern "C" __global__ void geglu_bwd(const T* h, const T* g, T* dh, long long n, long long H) {
    gated_bwd<1>(h, g, dh, n, H);
}
"""


def _sigmoid(a):
    """1 / (1 + e^-a) without overflow (e^-|a| <= 1)."""
    xp = backend.array_module(a)
    e = xp.exp(-xp.abs(a))
    return xp.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def swiglu_twin(h):
    """silu(gate) * up of h (..., 2H) = [gate | up]."""
    H = h.shape[-1] // 2
    a, u = h[..., :H], h[..., H:]
    return a * _sigmoid(a) * u


def swiglu_bwd_twin(h, g):
    xp = backend.array_module(h)
    H = h.shape[-1] // 2
    a, u = h[..., :H], h[..., H:]
    s = _sigmoid(a)
    return xp.concatenate([g * u * s * (1.0 + a * (1.0 - s)), g * a * s], axis=-1)


def _gated_launch(name: str):
    """The launcher of the gated kernel ``name`` (swiglu_fwd, geglu_fwd): h (..., 2H) ->
    y (..., H), VEC elements of y a thread."""
    def launch(k, h):
        xp = backend.xp()
        h = xp.ascontiguousarray(h)
        H = h.shape[-1] // 2
        y = xp.empty(h.shape[:-1] + (H,), dtype=h.dtype)
        fn, (blocks, threads) = vectors(k, name, y.size, h, y, row=H)
        fn(blocks, threads, (h, y, np.int64(y.size), np.int64(H)))
        return y
    return launch


def _gated_bwd_launch(name: str):
    """... and of its backward (swiglu_bwd, geglu_bwd): (h, g) -> dh (..., 2H)."""
    def launch(k, h, g):
        xp = backend.xp()
        h = xp.ascontiguousarray(h)
        H = h.shape[-1] // 2
        dh = xp.empty_like(h)
        g = xp.ascontiguousarray(g, dtype=h.dtype)
        fn, (blocks, threads) = vectors(k, name, g.size, h, g, dh, row=H)
        fn(blocks, threads, (h, g, dh, np.int64(g.size), np.int64(H)))
        return dh
    return launch


def _swiglu_cases(xp, rng, dt, backward=False):
    for shape in ((1, 2), (3, 14), (2, 5, 128), (7, 2 * 688)):
        h = xp.asarray((rng.standard_normal(shape) * 4).astype(dt))
        if not backward:
            yield h,
        else:
            yield h, xp.asarray(rng.standard_normal(shape[:-1] + (shape[-1] // 2,)).astype(dt))
    big = xp.asarray(np.array([[-90.0, 0.0, 90.0, 1.0, -1.0, 2.0]], dtype=dt))   # saturated
    yield (big,) if not backward else (big, xp.ones((1, 3), dtype=dt))


SWIGLU_FWD = Fused("swiglu_fwd", _GATED, ["swiglu_fwd"], _gated_launch("swiglu_fwd"),
                   swiglu_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt),
                   cpu="cpu_norm_gate_rope.swiglu")
SWIGLU_BWD = Fused("swiglu_bwd", _GATED, ["swiglu_bwd"], _gated_bwd_launch("swiglu_bwd"),
                   swiglu_bwd_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt, True),
                   cpu="cpu_norm_gate_rope.swiglu_bwd")


# ---- GeGLU ---------------------------------------------------------------------------------

def geglu_twin(h):
    """gelu_tanh(gate) * up of h (..., 2H) = [gate | up]."""
    H = h.shape[-1] // 2
    return gelu_twin(h[..., :H])[0] * h[..., H:]


def geglu_bwd_twin(h, g):
    xp = backend.array_module(h)
    H = h.shape[-1] // 2
    a, u = h[..., :H], h[..., H:]
    return xp.concatenate([gelu_bwd_twin(a, g * u), g * gelu_twin(a)[0]], axis=-1)


GEGLU_FWD = Fused("geglu_fwd", _GATED, ["geglu_fwd"], _gated_launch("geglu_fwd"), geglu_twin,
                  lambda xp, rng, dt: _swiglu_cases(xp, rng, dt),
                  cpu="cpu_norm_gate_rope.geglu")
GEGLU_BWD = Fused("geglu_bwd", _GATED, ["geglu_bwd"], _gated_bwd_launch("geglu_bwd"),
                  geglu_bwd_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt, True),
                  cpu="cpu_norm_gate_rope.geglu_bwd")
