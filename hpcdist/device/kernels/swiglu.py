"""The gated MLPs' fused kernels from the fused gate | up projection (forward, backward), each
beside its NumPy twin, 16 bytes a thread: SwiGLU's silu(gate) * up and GeGLU's
gelu_tanh(gate) * up (Gemma). Their CPU kernels: cpu_norm_gate_rope.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _VECTOR, vectors
from .elementwise import gelu_bwd_twin, gelu_twin

# ---- SwiGLU --------------------------------------------------------------------------------

_SWIGLU = _VECTOR + r"""
// h (N, 2H) = [gate | up] -> y (N, H) = silu(gate) up, silu(a) = a sigmoid(a); VEC elements
// of y a thread (H divides by VEC: a vector stays in its row's half)
extern "C" __global__ void swiglu_fwd(const T* h, T* y, long long n, long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], yv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A a = (A)av[j], u = (A)uv[j];
        yv[j] = (T)(a / ((A)1 + exp(-a)) * u);
    }
    copy_vec(y + i, yv);
}
// dh = [g up silu'(gate) | g silu(gate)], silu'(a) = s (1 + a (1 - s)), s = sigmoid(a)
extern "C" __global__ void swiglu_bwd(const T* h, const T* g, T* dh, long long n, long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], gv[VEC], dav[VEC], duv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
    copy_vec(gv, g + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A a = (A)av[j], u = (A)uv[j], gi = (A)gv[j];
        A s = (A)1 / ((A)1 + exp(-a));
        dav[j] = (T)(gi * u * s * ((A)1 + a * ((A)1 - s)));
        duv[j] = (T)(gi * a * s);
    }
    copy_vec(dh + r * 2 * H + c, dav);
    copy_vec(dh + r * 2 * H + H + c, duv);
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


SWIGLU_FWD = Fused("swiglu_fwd", _SWIGLU, ["swiglu_fwd"], _gated_launch("swiglu_fwd"),
                   swiglu_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt),
                   cpu="cpu_norm_gate_rope.swiglu")
SWIGLU_BWD = Fused("swiglu_bwd", _SWIGLU, ["swiglu_bwd"], _gated_bwd_launch("swiglu_bwd"),
                   swiglu_bwd_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt, True),
                   cpu="cpu_norm_gate_rope.swiglu_bwd")


# ---- GeGLU ---------------------------------------------------------------------------------

_GEGLU = _VECTOR + r"""
#define GELU_C ((A)0.7978845608028654)
// h (N, 2H) = [gate | up] -> y (N, H) = gelu(gate) up, GELU's tanh form; VEC elements of y
// a thread (H divides by VEC)
extern "C" __global__ void geglu_fwd(const T* h, T* y, long long n, long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], yv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A a = (A)av[j], u = (A)uv[j];
        A t = tanh(GELU_C * (a + (A)0.044715 * a * a * a));
        yv[j] = (T)((A)0.5 * a * ((A)1 + t) * u);
    }
    copy_vec(y + i, yv);
}
// dh = [g up gelu'(gate) | g gelu(gate)], gelu'(a) = (1 + t) / 2 + a (1 - t^2) c (1 + 3
// 0.044715 a^2) / 2, t = tanh(c (a + 0.044715 a^3))
extern "C" __global__ void geglu_bwd(const T* h, const T* g, T* dh, long long n, long long H) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;
    long long r = i / H, c = i % H;
    alignas(16) T av[VEC], uv[VEC], gv[VEC], dav[VEC], duv[VEC];
    copy_vec(av, h + r * 2 * H + c);
    copy_vec(uv, h + r * 2 * H + H + c);
    copy_vec(gv, g + i);
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        A a = (A)av[j], u = (A)uv[j], gi = (A)gv[j];
        A t = tanh(GELU_C * (a + (A)0.044715 * a * a * a));
        A d = (A)0.5 * ((A)1 + t)
            + (A)0.5 * a * ((A)1 - t * t) * GELU_C * ((A)1 + (A)3 * (A)0.044715 * a * a);
        dav[j] = (T)(gi * u * d);
        duv[j] = (T)(gi * (A)0.5 * a * ((A)1 + t));
    }
    copy_vec(dh + r * 2 * H + c, dav);
    copy_vec(dh + r * 2 * H + H + c, duv);
}
"""


def geglu_twin(h):
    """gelu_tanh(gate) * up of h (..., 2H) = [gate | up]."""
    H = h.shape[-1] // 2
    return gelu_twin(h[..., :H])[0] * h[..., H:]


def geglu_bwd_twin(h, g):
    xp = backend.array_module(h)
    H = h.shape[-1] // 2
    a, u = h[..., :H], h[..., H:]
    return xp.concatenate([gelu_bwd_twin(a, g * u), g * gelu_twin(a)[0]], axis=-1)


GEGLU_FWD = Fused("geglu_fwd", _GEGLU, ["geglu_fwd"], _gated_launch("geglu_fwd"), geglu_twin,
                  lambda xp, rng, dt: _swiglu_cases(xp, rng, dt),
                  cpu="cpu_norm_gate_rope.geglu")
GEGLU_BWD = Fused("geglu_bwd", _GEGLU, ["geglu_bwd"], _gated_bwd_launch("geglu_bwd"),
                  geglu_bwd_twin, lambda xp, rng, dt: _swiglu_cases(xp, rng, dt, True),
                  cpu="cpu_norm_gate_rope.geglu_bwd")
