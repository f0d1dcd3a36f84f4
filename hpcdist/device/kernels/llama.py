"""The Llama family's fused kernels, each beside its NumPy twin: RMSNorm (forward, backward),
SwiGLU from the fused gate | up projection (forward, backward) and rotary position
embeddings on the fused q|k|v (forward; the backward is the rotation back). Their CPU
kernels: cpu_llama.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import (_COMMON, _FINISH, _VECTOR, WARP_ROWS, _rows, _scalar, accumulator,
                     finishes, kept_zeros, low, row_threads, rows_per_block, sums, summed,
                     vector_width, vectors, wide)

# ---- RMSNorm -------------------------------------------------------------------------------

_RMSNORM = _COMMON + _VECTOR + _FINISH + r"""
// one warp per row of C, VEC elements a lane at a time (LayerNorm's forward says why): y = x
// rstd w, rstd = 1 / sqrt(mean(x^2) + eps), kept for backward
extern "C" __global__ void rmsnorm_fwd(const T* x, const T* w, T* y, A* rstd, long long rows,
                                       int C, A eps) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;                               // (the whole warp: one row a warp)
    const T* xr = x + r * C;
    alignas(16) T xv[VEC], wv[VEC], yv[VEC];
    A q = 0;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        for (int j = 0; j < VEC; j++) { A v = (A)xv[j]; q += v * v; }
    }
    A rs = (A)1 / sqrt(lane_sum(q) / (A)C + eps);
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        copy_vec(wv, w + c);
#pragma unroll
        for (int j = 0; j < VEC; j++) yv[j] = (T)((A)xv[j] * rs * (A)wv[j]);
        copy_vec(y + r * C + c, yv);
    }
    if (lane == 0) rstd[r] = rs;
}
// one block per ``per`` rows (<= 32): gx = rstd (g w - xhat mean(g w xhat)), xhat = x rstd;
// the weight's gradient summed over the block's rows in shared memory (each thread owns its
// VEC-wide columns) and added once a block into gw (zeros, or its own gradient buffer);
// per == 1 (a row too wide for the shared sums): added row by row. ``finish``: gw a kept
// workspace added into the 2-byte buffer gw_low by the last block. gx in a second, flat pass
// (LayerNorm's backward says why)
extern "C" __global__ void rmsnorm_bwd(const T* g, const T* x, const T* w, const A* rstd, T* gx,
                                       A* gw, T* gw_low, unsigned* done, long long rows, int C,
                                       int per, int finish) {
    __shared__ A shared[32];
    __shared__ A stats[32];                              // each row's mean(g w xhat)
    extern __shared__ unsigned char smem[];
    A* part = (A*)smem;                                  // [C] when per > 1
    long long r0 = (long long)blockIdx.x * per;
    if (r0 >= rows) return;
    int n = (int)((r0 + per < rows ? r0 + per : rows) - r0);
    alignas(16) T gv[VEC], xv[VEC], wv[VEC], ov[VEC];
    if (per > 1)
        for (int c = threadIdx.x; c < C; c += blockDim.x) part[c] = 0;
    __syncthreads();                       // (threads zero other columns than they add to)
    for (int k = 0; k < n; k++) {
        const T* gr = g + (r0 + k) * C;
        const T* xr = x + (r0 + k) * C;
        A rs = rstd[r0 + k], s = 0;
        for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
            copy_vec(gv, gr + c);
            copy_vec(xv, xr + c);
            copy_vec(wv, w + c);
            for (int j = 0; j < VEC; j++) {
                A xhat = (A)xv[j] * rs, gc = (A)gv[j];
                s += gc * (A)wv[j] * xhat;
                if (per > 1) part[c + j] += gc * xhat;
                else atomicAdd(gw + c + j, gc * xhat);
            }
        }
        s = block_sum(s, shared);
        if (threadIdx.x == 0) stats[k] = s / (A)C;
    }
    __syncthreads();
    int vectors = C / VEC;
    for (int i = threadIdx.x; i < n * vectors; i += blockDim.x) {
        int k = i / vectors;
        long long at = (r0 + k) * C + (long long)(i - k * vectors) * VEC;
        A rs = rstd[r0 + k], s = stats[k];
        copy_vec(gv, g + at);
        copy_vec(xv, x + at);
        copy_vec(wv, w + (i - k * vectors) * VEC);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            ov[j] = (T)(rs * ((A)gv[j] * (A)wv[j] - (A)xv[j] * rs * s));
        copy_vec(gx + at, ov);
    }
    __syncthreads();
    if (per > 1)
        for (int c = threadIdx.x; c < C; c += blockDim.x) atomicAdd(gw + c, part[c]);
    if (finish) finish_into(gw, gw_low, gw_low, C, 0, done);
}
"""


def rmsnorm_twin(x, w, eps):
    """(y, rstd, xhat) over the last axis; rstd of shape x.shape[:-1]. 2-byte floats in
    float32 (rstd and xhat stay float32), y rounded back."""
    if low(x):
        y, rstd, xhat = rmsnorm_twin(wide(x), wide(w), eps)
        return y.astype(x.dtype), rstd, xhat
    xp = backend.array_module(x)
    ms = (x * x).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])
    rstd = 1.0 / xp.sqrt(ms + eps)
    xhat = x * rstd
    return xhat * w, rstd[..., 0], xhat


def rmsnorm_bwd_twin(g, x, w, rstd, xhat=None, gw_into=None):
    """(gx, gw) of y = x rstd w; ``gw_into``: the weight's gradient added into it. 2-byte
    floats in float32, gx and gw rounded back."""
    if low(x):
        gx, gw = rmsnorm_bwd_twin(wide(g), wide(x), wide(w), rstd,
                                  wide(xhat) if xhat is not None else None)
        return gx.astype(x.dtype), summed(gw, gw_into, x.dtype)
    if xhat is None:
        xhat = x * rstd[..., None]
    gxhat = g * w
    m = (gxhat * xhat).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])
    gx = (gxhat - xhat * m) * rstd[..., None]
    C = x.shape[-1]
    gw = (g.reshape(-1, C) * xhat.reshape(-1, C)).sum(axis=0)
    if gw_into is not None:
        gw_into += gw
        gw = gw_into
    return gx, gw


def _rmsnorm_launch(k, x, w, eps):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    y = xp.empty_like(x)
    rstd = xp.empty(rows, dtype=acc)
    w = xp.ascontiguousarray(w)
    vec = vector_width(x.size, x, w, y, row=C)
    k("rmsnorm_fwd", {"VEC": vec})((max(-(-rows // WARP_ROWS), 1),), (32 * WARP_ROWS,),
                                   (x, w, y, rstd, np.int64(rows), np.int32(C),
                                    _scalar(acc, eps)))
    return y, rstd.reshape(x.shape[:-1]), None


def _rmsnorm_bwd_launch(k, g, x, w, rstd, xhat=None, gw_into=None):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    gx = xp.empty_like(x)
    finish = finishes(x, acc, gw_into)
    gw = kept_zeros(xp, C, acc, "norm sums")[:C] if finish else sums(gw_into, C, acc)
    per, shm = rows_per_block(rows, C * np.dtype(acc).itemsize)
    g, w = xp.ascontiguousarray(g, dtype=x.dtype), xp.ascontiguousarray(w)
    vec = vector_width(x.size, g, x, w, gx, row=C)
    k("rmsnorm_bwd", {"VEC": vec})((max(-(-rows // per), 1),), (row_threads(C, vec),),
                                   (g, x, w, xp.ascontiguousarray(rstd, dtype=acc).reshape(-1),
                                    gx, gw, gw_into if finish else gx,
                                    kept_zeros(xp, 1, np.uint32, "norm counter"),
                                    np.int64(rows), np.int32(C), np.int32(per),
                                    np.int32(finish)), shared_mem=shm)
    return gx, gw_into if finish else summed(gw, gw_into, x.dtype)


def _rmsnorm_cases(xp, rng, dt, backward=False):
    for shape in ((1, 1), (3, 7), (2, 5, 64), (4, 1000), (37, 96), (3, 12300)):
        x = xp.asarray((rng.standard_normal(shape) * 3).astype(dt))
        w = xp.asarray(rng.standard_normal(shape[-1]).astype(dt))
        if not backward:
            yield x, w, 1e-5
        else:
            _, rstd, _ = rmsnorm_twin(x, w, 1e-5)
            g = xp.asarray(rng.standard_normal(shape).astype(dt))
            yield g, x, w, rstd
            into = xp.asarray(rng.standard_normal(shape[-1]).astype(dt))
            yield g, x, w, rstd, None, into                   # added into its buffer
    x = xp.zeros((2, 8), dtype=dt)                  # all-zero rows: rstd = 1/sqrt(eps)
    yield (x, xp.ones(8, dtype=dt), 1e-6) if not backward else \
        (xp.ones((2, 8), dtype=dt), x, xp.ones(8, dtype=dt), rmsnorm_twin(x, x[0], 1e-6)[1])


RMSNORM_FWD = Fused("rmsnorm_fwd", _RMSNORM, ["rmsnorm_fwd"], _rmsnorm_launch, rmsnorm_twin,
                    lambda xp, rng, dt: _rmsnorm_cases(xp, rng, dt), compare=2)
RMSNORM_BWD = Fused("rmsnorm_bwd", _RMSNORM, ["rmsnorm_bwd"], _rmsnorm_bwd_launch,
                    rmsnorm_bwd_twin, lambda xp, rng, dt: _rmsnorm_cases(xp, rng, dt, True),
                    tolerance=1e-4)

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


def _swiglu_launch(k, h):
    xp = backend.xp()
    h = xp.ascontiguousarray(h)
    H = h.shape[-1] // 2
    y = xp.empty(h.shape[:-1] + (H,), dtype=h.dtype)
    fn, (blocks, threads) = vectors(k, "swiglu_fwd", y.size, h, y, row=H)
    fn(blocks, threads, (h, y, np.int64(y.size), np.int64(H)))
    return y


def _swiglu_bwd_launch(k, h, g):
    xp = backend.xp()
    h = xp.ascontiguousarray(h)
    H = h.shape[-1] // 2
    dh = xp.empty_like(h)
    g = xp.ascontiguousarray(g, dtype=h.dtype)
    fn, (blocks, threads) = vectors(k, "swiglu_bwd", g.size, h, g, dh, row=H)
    fn(blocks, threads, (h, g, dh, np.int64(g.size), np.int64(H)))
    return dh


def _swiglu_cases(xp, rng, dt, backward=False):
    for shape in ((1, 2), (3, 14), (2, 5, 128), (7, 2 * 688)):
        h = xp.asarray((rng.standard_normal(shape) * 4).astype(dt))
        if not backward:
            yield h,
        else:
            yield h, xp.asarray(rng.standard_normal(shape[:-1] + (shape[-1] // 2,)).astype(dt))
    big = xp.asarray(np.array([[-90.0, 0.0, 90.0, 1.0, -1.0, 2.0]], dtype=dt))   # saturated
    yield (big,) if not backward else (big, xp.ones((1, 3), dtype=dt))


SWIGLU_FWD = Fused("swiglu_fwd", _SWIGLU, ["swiglu_fwd"], _swiglu_launch, swiglu_twin,
                   lambda xp, rng, dt: _swiglu_cases(xp, rng, dt))
SWIGLU_BWD = Fused("swiglu_bwd", _SWIGLU, ["swiglu_bwd"], _swiglu_bwd_launch, swiglu_bwd_twin,
                   lambda xp, rng, dt: _swiglu_cases(xp, rng, dt, True))

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


ROTARY = Fused("rotary", _ROTARY, ["rotary"], _rotary_launch, rotary_twin, _rotary_cases)
