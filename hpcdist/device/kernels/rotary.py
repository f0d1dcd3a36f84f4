"""Rotary position embeddings on the fused q|k|v (forward; the backward is the rotation
back), beside the NumPy twin, and the cos / sin tables of a rotary kind's frequencies. Its CPU
kernel: cpu_norm_gate_rope.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _VECTOR, _scalar, vectors

# ---- rotary position embeddings ------------------------------------------------------------

_ROTARY = _VECTOR + r"""
// the q and k heads of x (B, T, W) (heads h < nq: q at h hd; then nk k heads), each pair
// (i, i + hd/2) rotated by the angle of (t, i): cos/sin (T, hd/2), ``sign`` 1 (forward) or
// -1 (backward: the rotation back); the v heads copied. One thread a (b, t, head) and VEC
// consecutive i (hd/2 divides by VEC): 16 bytes of each half, cos and sin a thread.
extern "C" __global__ void rotary(const T* x, T* out, const T* cs, const T* sn, long long n,
                                  int T_, int W, int nq, int nk, int hd, A sign) {
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (i >= n) return;                              // n = B T W / 2: half of each head
    int half = hd / 2;
    long long row = i / (W / 2);
    int j = (int)(i % (W / 2)), head = j / half, p = j % half, t = (int)(row % T_);
    long long a = row * W + (long long)head * hd + p, b = a + half;
    alignas(16) T x1[VEC], x2[VEC], cv[VEC], sv[VEC];
    copy_vec(x1, x + a);
    copy_vec(x2, x + b);
    if (head >= nq + nk) { copy_vec(out + a, x1); copy_vec(out + b, x2); return; }
    copy_vec(cv, cs + t * half + p);
    copy_vec(sv, sn + t * half + p);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        A c = (A)cv[k], s = sign * (A)sv[k], u = (A)x1[k], w = (A)x2[k];
        x1[k] = (T)(u * c - w * s);
        x2[k] = (T)(w * c + u * s);
    }
    copy_vec(out + a, x1);
    copy_vec(out + b, x2);
}
"""


def rotary_tables(pos, hd: int, theta: float, dtype, frequencies=None):
    """cos, sin (T, hd/2) of position x theta^(-2i/hd) (or x ``frequencies``, float64 on
    pos's device: a scaled rotary kind's), in ``dtype`` on pos's device."""
    xp = backend.array_module(pos)
    # (made on pos's device: nothing crosses from the host inside a step, which a CUDA
    # graph's capture refuses)
    inv = frequencies if frequencies is not None else \
        1.0 / (theta ** (xp.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = xp.asarray(pos).astype(np.float64)[:, None] * inv[None, :]
    return xp.cos(ang).astype(dtype), xp.sin(ang).astype(dtype)


def rotary_twin(x, cos, sin, nq: int, nk: int, hd: int, sign: float = 1.0):
    """x (B, T, W) with its first nq + nk heads rotated (cos, sin: (T, hd/2))."""
    xp = backend.array_module(x)
    B, T, W = x.shape
    out = x.copy()
    heads = out[..., :(nq + nk) * hd].reshape(B, T, nq + nk, hd)
    x1, x2 = heads[..., :hd // 2].copy(), heads[..., hd // 2:].copy()
    c, s = cos[None, :, None, :], sin[None, :, None, :] * sign
    heads[..., :hd // 2] = x1 * c - x2 * s
    heads[..., hd // 2:] = x2 * c + x1 * s
    return xp.ascontiguousarray(out)


def _rotary_launch(k, x, cos, sin, nq, nk, hd, sign=1.0):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    B, T, W = x.shape
    out = xp.empty_like(x)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    n = x.size // 2
    cos = xp.ascontiguousarray(cos, dtype=x.dtype)
    sin = xp.ascontiguousarray(sin, dtype=x.dtype)
    fn, (blocks, threads) = vectors(k, "rotary", n, x, out, cos, sin, row=hd // 2)
    fn(blocks, threads, (x, out, cos, sin, np.int64(n), np.int32(T), np.int32(W), np.int32(nq),
                         np.int32(nk), np.int32(hd), _scalar(acc, sign)))
    return out


def _rotary_cases(xp, rng, dt):
    for B, T, nq, nk, hd in ((1, 1, 1, 1, 2), (2, 5, 4, 2, 8), (1, 17, 3, 1, 64),
                             (2, 9, 2, 2, 128)):
        W = (nq + 2 * nk) * hd
        x = xp.asarray(rng.standard_normal((B, T, W)).astype(dt))
        pos = xp.asarray(np.arange(3, 3 + T))
        cos, sin = rotary_tables(pos, hd, 10000.0, dt)
        for sign in (1.0, -1.0):
            yield x, cos, sin, nq, nk, hd, sign


ROTARY = Fused("rotary", _ROTARY, ["rotary"], _rotary_launch, rotary_twin, _rotary_cases,
               cpu="cpu_norm_gate_rope.rotary")
