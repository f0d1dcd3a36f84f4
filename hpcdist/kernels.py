"""The fused kernels of a GPT step, each beside its NumPy twin (fused.py says how they run).

    GELU_FWD, GELU_BWD          tanh GELU and its derivative, one pass each
    LAYERNORM_FWD, _BWD         a row's mean and 1/std, normalise, scale, shift; the backward's
                                input gradient per row and the weight and bias gradients
    SOFTMAX_CAUSAL_FWD, _BWD    scale, causal mask, softmax of attention scores in one pass;
                                its backward
    CROSS_ENTROPY_FWD, _BWD     per row: log-sum-exp and the target's loss; the gradient
                                softmax - onehot, weighted, in place of the logits' copy
    ADAMW                       AdamW over the whole flat buffer, decoupled decay by a mask

Twins are the definition; each kernel's self-check compares against its twin on a GPU before
it is used. Every kernel computes in ``A`` (float for float32, double for float64) and checks
its bounds.
"""
from __future__ import annotations

import math

import numpy as np

from . import backend
from .fused import ROW_THREADS, Fused, grid

GELU_C = math.sqrt(2.0 / math.pi)

_COMMON = r"""
#define NEG_INF ((A)(-__int_as_float(0x7f800000)))          // -infinity (no <math.h> in NVRTC)
__device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffff, v, o));
    return v;
}
// the sum (or max) over the block, on every thread; blockDim.x a multiple of 32, <= 1024
__device__ A block_sum(A v, A* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? shared[lane] : (A)0;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    v = shared[0];
    __syncthreads();
    return v;
}
__device__ A block_max(A v, A* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? shared[lane] : NEG_INF;
    if (warp == 0) v = warp_max(v);
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    v = shared[0];
    __syncthreads();
    return v;
}
"""


def _scalar(dtype, value):
    return np.dtype(dtype).type(value)


def _rows(x):
    """(rows, width) of x seen as a matrix over its last axis."""
    return int(x.size // x.shape[-1]) if x.shape[-1] else 0, int(x.shape[-1])


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


def gelu_twin(x):
    """(0.5 x (1 + tanh(c (x + 0.044715 x^3))), the tanh for the backward), in place where it
    can (3 temporaries; the kernel keeps no tanh: its backward recomputes it)."""
    xp = backend.array_module(x)
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= GELU_C
    xp.tanh(t, out=t)
    out = t + 1.0
    out *= x
    out *= 0.5
    return out, t


def gelu_bwd_twin(x, g, t=None):
    """g times d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2); ``t`` the
    forward's tanh when it kept one."""
    xp = backend.array_module(x)
    if t is None:
        t = x * x
        t *= 0.044715
        t += 1.0
        t *= x
        t *= GELU_C
        xp.tanh(t, out=t)
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


# ---- LayerNorm -----------------------------------------------------------------------------

_LAYERNORM = _COMMON + r"""
// one block per row of C: y = (x - mean) * rstd * w + b; mean and rstd kept for backward
extern "C" __global__ void layernorm_fwd(const T* x, const T* w, const T* b, T* y,
                                         A* mean, A* rstd, long long rows, int C, A eps) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const T* xr = x + r * C;
    A s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += (A)xr[c];
    A m = block_sum(s, shared) / (A)C;
    A q = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) { A d = (A)xr[c] - m; q += d * d; }
    A rs = (A)1 / sqrt(block_sum(q, shared) / (A)C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        y[r * C + c] = (T)(((A)xr[c] - m) * rs * (A)w[c] + (A)b[c]);
    if (threadIdx.x == 0) { mean[r] = m; rstd[r] = rs; }
}
// one block per row: gx = rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)), gxhat = g w;
// the weight and bias gradients added over rows into gw, gb (zeros, or the parameters' own
// gradient buffers: accumulated in place)
extern "C" __global__ void layernorm_bwd(const T* g, const T* x, const T* w, const A* mean,
                                         const A* rstd, T* gx, T* gw, T* gb, long long rows,
                                         int C) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const T* gr = g + r * C;
    const T* xr = x + r * C;
    A m = mean[r], rs = rstd[r], s1 = 0, s2 = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        A xhat = ((A)xr[c] - m) * rs, gh = (A)gr[c] * (A)w[c];
        s1 += gh;
        s2 += gh * xhat;
        atomicAdd(gw + c, (T)((A)gr[c] * xhat));
        atomicAdd(gb + c, gr[c]);
    }
    s1 = block_sum(s1, shared) / (A)C;
    s2 = block_sum(s2, shared) / (A)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        A xhat = ((A)xr[c] - m) * rs, gh = (A)gr[c] * (A)w[c];
        gx[r * C + c] = (T)(rs * (gh - s1 - xhat * s2));
    }
}
"""


def layernorm_twin(x, w, b, eps):
    """(y, mean, rstd) over the last axis; mean and rstd of shape x.shape[:-1]."""
    xp = backend.array_module(x)
    inv_c = 1.0 / x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True) * inv_c
    xc = x - mean
    var = xp.einsum("...c,...c->...", xc, xc)[..., None] if xc.ndim <= 3 else \
        (xc * xc).sum(axis=-1, keepdims=True)
    var *= inv_c
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xc *= rstd                                 # xc is not needed again: normalise in place
    out = xc * w
    out += b
    return out, mean[..., 0], rstd[..., 0], xc


def layernorm_bwd_twin(g, x, w, mean, rstd, xhat=None, gw_into=None, gb_into=None):
    """(gx, gw, gb) of y = (x - mean) rstd w + b; ``xhat`` the forward's normalised x when it
    kept it; ``gw_into``/``gb_into``: add the weight and bias gradients into these (returned
    as gw, gb) instead of new arrays."""
    xp = backend.array_module(x)
    inv_c = 1.0 / x.shape[-1]
    if xhat is None:
        xhat = x - mean[..., None]
        xhat *= rstd[..., None]
    gxhat = g * w
    m1 = gxhat.sum(axis=-1, keepdims=True)
    m1 *= inv_c
    m2 = xp.einsum("...c,...c->...", gxhat, xhat)[..., None] if xhat.ndim <= 3 else \
        (gxhat * xhat).sum(axis=-1, keepdims=True)
    m2 *= inv_c
    gx = gxhat
    gx -= m1
    gx -= xhat * m2
    gx *= rstd[..., None]
    C = x.shape[-1]
    flat_g = g.reshape(-1, C)
    gw = xp.einsum("nc,nc->c", flat_g, xhat.reshape(-1, C))
    gb = flat_g.sum(axis=0)
    if gw_into is not None:
        gw_into += gw
        gw = gw_into
    if gb_into is not None:
        gb_into += gb
        gb = gb_into
    return gx, gw, gb


def _layernorm_launch(k, x, w, b, eps):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = xp.empty_like(x)
    mean, rstd = xp.empty(rows, dtype=acc), xp.empty(rows, dtype=acc)
    k("layernorm_fwd")((max(rows, 1),), (ROW_THREADS,),
                       (x, w, b, y, mean, rstd, np.int64(rows), np.int32(C),
                        _scalar(acc, eps)))
    return y, mean.reshape(x.shape[:-1]).astype(x.dtype, copy=False), \
        rstd.reshape(x.shape[:-1]).astype(x.dtype, copy=False), None


def _layernorm_bwd_launch(k, g, x, w, mean, rstd, xhat=None, gw_into=None, gb_into=None):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    gx = xp.empty_like(x)
    gw = gw_into if gw_into is not None else xp.zeros(C, dtype=x.dtype)
    gb = gb_into if gb_into is not None else xp.zeros(C, dtype=x.dtype)
    k("layernorm_bwd")((max(rows, 1),), (ROW_THREADS,),
                       (xp.ascontiguousarray(g), x, w, xp.ascontiguousarray(mean, dtype=acc),
                        xp.ascontiguousarray(rstd, dtype=acc), gx, gw, gb, np.int64(rows),
                        np.int32(C)))
    return gx, gw.astype(x.dtype, copy=False), gb.astype(x.dtype, copy=False)


def _ln_cases(xp, rng, dt, backward=False):
    for shape in ((1, 1), (1, 7), (3, 5, 64), (2, 257), (4, 3, 768)):
        x = xp.asarray((rng.standard_normal(shape) * 2 + 0.5).astype(dt))
        w = xp.asarray(rng.standard_normal(shape[-1]).astype(dt))
        if not backward:
            yield x, w, xp.asarray(rng.standard_normal(shape[-1]).astype(dt)), 1e-5
        else:
            _, mean, rstd, _ = layernorm_twin(x, w, xp.zeros_like(w), 1e-5)
            g = xp.asarray(rng.standard_normal(shape).astype(dt))
            yield g, x, w, mean, rstd
            into = [xp.asarray(rng.standard_normal(shape[-1]).astype(dt)) for _ in range(2)]
            yield g, x, w, mean, rstd, None, into[0], into[1]      # added into buffers


LAYERNORM_FWD = Fused("layernorm_fwd", _LAYERNORM, ["layernorm_fwd"], _layernorm_launch,
                      layernorm_twin, lambda xp, rng, dt: _ln_cases(xp, rng, dt), compare=3)
LAYERNORM_BWD = Fused("layernorm_bwd", _LAYERNORM, ["layernorm_bwd"], _layernorm_bwd_launch,
                      layernorm_bwd_twin, lambda xp, rng, dt: _ln_cases(xp, rng, dt, True),
                      tolerance=1e-4)     # gw, gb: atomic sums in another order


# ---- causal softmax of attention scores -----------------------------------------------------

_SOFTMAX = _COMMON + r"""
// one block per row of S scores: query position q = past + (row % Tq) sees keys 0..q;
// y = softmax(scale * x) over them, 0 beyond
extern "C" __global__ void softmax_causal_fwd(const T* x, T* y, long long rows, int Tq, int S,
                                              int past, A scale) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    int last = past + (int)(r % Tq);               // the last key this query sees
    const T* xr = x + r * S;
    A mx = NEG_INF;
    for (int c = threadIdx.x; c <= last && c < S; c += blockDim.x) mx = max(mx, scale * (A)xr[c]);
    mx = block_max(mx, shared);
    A s = 0;
    for (int c = threadIdx.x; c <= last && c < S; c += blockDim.x) s += exp(scale * (A)xr[c] - mx);
    s = block_sum(s, shared);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        y[r * S + c] = (c <= last) ? (T)(exp(scale * (A)xr[c] - mx) / s) : (T)0;
}
// gx = scale * y * (g - sum(g y)) (masked entries have y = 0: their gradient is 0)
extern "C" __global__ void softmax_causal_bwd(const T* g, const T* y, T* gx, long long rows,
                                              int S, A scale) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    A s = 0;
    for (int c = threadIdx.x; c < S; c += blockDim.x) s += (A)g[r * S + c] * (A)y[r * S + c];
    s = block_sum(s, shared);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        gx[r * S + c] = (T)(scale * (A)y[r * S + c] * ((A)g[r * S + c] - s));
}
"""


def softmax_causal_twin(x, scale, past=0):
    """softmax over the last axis of ``scale * x`` with query i (axis -2, after ``past``
    cached ones) seeing keys 0..past+i; 0 for the keys it may not see."""
    xp = backend.array_module(x)
    Tq, S = x.shape[-2], x.shape[-1]
    mask = xp.arange(S)[None, :] > (past + xp.arange(Tq))[:, None]     # (Tq, S) unseen
    z = xp.where(mask, xp.asarray(-np.inf, dtype=x.dtype), x * scale)
    e = xp.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_causal_bwd_twin(g, y, scale):
    return (y * (g - (g * y).sum(axis=-1, keepdims=True))) * scale


def _softmax_launch(k, x, scale, past=0):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    rows, S = _rows(x)
    y = xp.empty_like(x)
    acc = np.float64 if x.dtype == np.float64 else np.float32
    k("softmax_causal_fwd")((max(rows, 1),), (ROW_THREADS,),
                            (x, y, np.int64(rows), np.int32(x.shape[-2]), np.int32(S),
                             np.int32(past), _scalar(acc, scale)))
    return y


def _softmax_bwd_launch(k, g, y, scale):
    xp = backend.xp()
    rows, S = _rows(y)
    gx = xp.empty_like(y)
    acc = np.float64 if y.dtype == np.float64 else np.float32
    k("softmax_causal_bwd")((max(rows, 1),), (ROW_THREADS,),
                            (xp.ascontiguousarray(g), xp.ascontiguousarray(y), gx,
                             np.int64(rows), np.int32(S), _scalar(acc, scale)))
    return gx


def _softmax_cases(xp, rng, dt, backward=False):
    for shape, past in (((1, 1, 1, 1), 0), ((2, 3, 5, 5), 0), ((1, 2, 1, 9), 8),
                        ((2, 2, 3, 300), 297), ((1, 4, 64, 64), 0)):
        x = xp.asarray(rng.standard_normal(shape).astype(dt))
        if not backward:
            yield x, 0.125, past
        else:
            y = softmax_causal_twin(x, 0.125, past)
            yield xp.asarray(rng.standard_normal(shape).astype(dt)), y, 0.125


SOFTMAX_CAUSAL_FWD = Fused("softmax_causal_fwd", _SOFTMAX, ["softmax_causal_fwd"],
                           _softmax_launch, softmax_causal_twin,
                           lambda xp, rng, dt: _softmax_cases(xp, rng, dt))
SOFTMAX_CAUSAL_BWD = Fused("softmax_causal_bwd", _SOFTMAX, ["softmax_causal_bwd"],
                           _softmax_bwd_launch, softmax_causal_bwd_twin,
                           lambda xp, rng, dt: _softmax_cases(xp, rng, dt, True))


# ---- cross-entropy -------------------------------------------------------------------------

_CROSS_ENTROPY = _COMMON + r"""
// one block per row of V logits: lse = log sum exp; nll = lse - z[t] (0 where t is ignored)
extern "C" __global__ void cross_entropy_fwd(const T* z, const long long* t, A* nll, A* lse,
                                             long long rows, int V, long long ignore) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const T* zr = z + r * V;
    A mx = NEG_INF;
    for (int c = threadIdx.x; c < V; c += blockDim.x) mx = max(mx, (A)zr[c]);
    mx = block_max(mx, shared);
    A s = 0;
    for (int c = threadIdx.x; c < V; c += blockDim.x) s += exp((A)zr[c] - mx);
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        A l = mx + log(s);
        long long target = t[r];
        lse[r] = l;
        nll[r] = (target == ignore || target < 0 || target >= V) ? (A)0 : l - (A)zr[target];
    }
}
// the gradient: (softmax - onehot(t)) * weight, 0 on ignored rows
extern "C" __global__ void cross_entropy_bwd(const T* z, const long long* t, const A* lse,
                                             T* gz, long long rows, int V, long long ignore,
                                             const T* weight) {
    long long r = blockIdx.x;
    if (r >= rows) return;
    long long target = t[r];
    bool skip = target == ignore || target < 0 || target >= V;
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        A p = skip ? (A)0
                   : (exp((A)z[r * V + c] - lse[r]) - (c == target ? (A)1 : (A)0)) * (A)weight[0];
        gz[r * V + c] = (T)p;
    }
}
"""


def cross_entropy_twin(z, t, ignore):
    """(nll per row, 0 where ignored; log-sum-exp per row) of logits z (R, V)."""
    xp = backend.array_module(z)
    valid = t != ignore
    safe = xp.where(valid, t, 0)
    shifted = z - z.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=1))
    rows = xp.arange(z.shape[0])
    nll = (lse - shifted[rows, safe]) * valid
    return nll, lse + z.max(axis=1)


def cross_entropy_bwd_twin(z, t, lse, ignore, weight):
    """(softmax(z) - onehot(t)) * weight per row, 0 on ignored rows (``weight``: a 0-d
    array, so that no value leaves the device)."""
    xp = backend.array_module(z)
    valid = t != ignore
    p = xp.exp(z - lse[:, None])
    rows = xp.arange(z.shape[0])
    p[rows, xp.where(valid, t, 0)] -= 1
    p *= (valid * weight)[:, None].astype(p.dtype)
    return p


def _ce_launch(k, z, t, ignore):
    xp = backend.xp()
    rows, V = _rows(z)
    acc = np.float64 if z.dtype == np.float64 else np.float32
    nll, lse = xp.empty(rows, dtype=acc), xp.empty(rows, dtype=acc)
    k("cross_entropy_fwd")((max(rows, 1),), (ROW_THREADS,),
                           (xp.ascontiguousarray(z), xp.ascontiguousarray(t, dtype=np.int64),
                            nll, lse, np.int64(rows), np.int32(V), np.int64(ignore)))
    return nll.astype(z.dtype, copy=False), lse.astype(z.dtype, copy=False)


def _ce_bwd_launch(k, z, t, lse, ignore, weight):
    xp = backend.xp()
    rows, V = _rows(z)
    acc = np.float64 if z.dtype == np.float64 else np.float32
    gz = xp.empty_like(z)
    k("cross_entropy_bwd")((max(rows, 1),), (ROW_THREADS,),
                           (xp.ascontiguousarray(z), xp.ascontiguousarray(t, dtype=np.int64),
                            xp.ascontiguousarray(lse, dtype=acc), gz, np.int64(rows),
                            np.int32(V), np.int64(ignore),
                            xp.ascontiguousarray(weight, dtype=z.dtype).reshape(1)))
    return gz


def _ce_cases(xp, rng, dt, backward=False):
    for R, V in ((1, 1), (1, 5), (7, 13), (33, 50257)):
        z = xp.asarray((rng.standard_normal((R, V)) * 4).astype(dt))
        t = rng.integers(0, V, R)
        t[::3] = -100
        t = xp.asarray(t)
        if not backward:
            yield z, t, -100
        else:
            yield z, t, cross_entropy_twin(z, t, -100)[1], -100, xp.asarray(0.25, dtype=dt)


CROSS_ENTROPY_FWD = Fused("cross_entropy_fwd", _CROSS_ENTROPY, ["cross_entropy_fwd"],
                          _ce_launch, cross_entropy_twin,
                          lambda xp, rng, dt: _ce_cases(xp, rng, dt), tolerance=1e-5)
CROSS_ENTROPY_BWD = Fused("cross_entropy_bwd", _CROSS_ENTROPY, ["cross_entropy_bwd"],
                          _ce_bwd_launch, cross_entropy_bwd_twin,
                          lambda xp, rng, dt: _ce_cases(xp, rng, dt, True))


# ---- AdamW ---------------------------------------------------------------------------------

_ADAMW = r"""
// one thread per element of the flat buffer, in the twin's order (optim.adamw_update)
extern "C" __global__ void adamw(T* p, const T* g, T* m, T* v, const unsigned char* decay,
                                 long long n, A lr, A beta1, A beta2, A eps, A wd, A bias1,
                                 A sqrt_bias2) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    A pi = (A)p[i], gi = (A)g[i];
    if (decay[i]) pi *= (A)1 - lr * wd;
    A vi = (A)v[i] * beta2 + gi * gi * ((A)1 - beta2);
    A mi = (A)m[i] * beta1 + gi * ((A)1 - beta1);
    A denom = sqrt(vi) / sqrt_bias2 + eps;
    p[i] = (T)(pi - mi / denom * (lr / bias1));
    m[i] = (T)mi;
    v[i] = (T)vi;
}
"""


def adamw_twin(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step):
    """One AdamW step of flat p with moments m, v (in place); ``decay``: a uint8 mask of the
    elements that take weight decay. Returns (p, m, v)."""
    xp = backend.array_module(p)
    if wd:
        p *= xp.where(decay.astype(bool), 1.0 - lr * wd, 1.0).astype(p.dtype)
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
    return p, m, v


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


# ---- causal attention from the fused q|k|v projection ---------------------------------------

_ATTENTION = _COMMON + r"""
// qkv (B, T, 3C): q, k, v side by side, C = nh * hs; one block per (batch, head, query i).
// y (B, T, C) = softmax(scale q_i k_j, j <= i) v_j; lse (B, nh, T) = the softmax's log-sum-exp.
// Dynamic shared memory: T values of A (the row's scores, then probabilities).
extern "C" __global__ void attention_fwd(const T* qkv, T* y, A* lse, int B, int Tn, int nh,
                                         int hs, A scale) {
    extern __shared__ unsigned char smem[];
    A* p = (A*)smem;
    __shared__ A shared[32];
    long long row = blockIdx.x;                     // ((b * nh) + h) * T + i
    if (row >= (long long)B * nh * Tn) return;
    int i = (int)(row % Tn), h = (int)((row / Tn) % nh);
    long long b = row / ((long long)Tn * nh);
    long long C = (long long)nh * hs, C3 = 3 * C;
    const T* q = qkv + (b * Tn + i) * C3 + (long long)h * hs;
    A mx = NEG_INF;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const T* k = qkv + (b * Tn + j) * C3 + C + (long long)h * hs;
        A s = 0;
        for (int d = 0; d < hs; d++) s += (A)q[d] * (A)k[d];
        s *= scale;
        p[j] = s;
        mx = max(mx, s);
    }
    mx = block_max(mx, shared);
    A sum = 0;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) { A e = exp(p[j] - mx); p[j] = e; sum += e; }
    sum = block_sum(sum, shared);                   // (its barrier also publishes p)
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        A acc = 0;
        for (int j = 0; j <= i; j++) acc += p[j] * (A)qkv[(b * Tn + j) * C3 + 2 * C + (long long)h * hs + d];
        y[(b * Tn + i) * C + (long long)h * hs + d] = (T)(acc / sum);
    }
    if (threadIdx.x == 0) lse[row] = mx + log(sum);
}
// The gradient dqkv (zeroed by the caller): per query i, D = dy_i . y_i;
// p_j = exp(scale q_i k_j - lse_i), ds_j = p_j (dy_i . v_j - D);
// dq_i = scale sum_j ds_j k_j; dk_j += scale ds_j q_i; dv_j += p_j dy_i (atomic over i).
extern "C" __global__ void attention_bwd(const T* qkv, const T* y, const T* dy, const A* lse,
                                         T* dqkv, int B, int Tn, int nh, int hs, A scale) {
    extern __shared__ unsigned char smem[];
    A* ds = (A*)smem;
    __shared__ A shared[32];
    long long row = blockIdx.x;
    if (row >= (long long)B * nh * Tn) return;
    int i = (int)(row % Tn), h = (int)((row / Tn) % nh);
    long long b = row / ((long long)Tn * nh);
    long long C = (long long)nh * hs, C3 = 3 * C;
    long long qo = (b * Tn + i) * C3 + (long long)h * hs, yo = (b * Tn + i) * C + (long long)h * hs;
    A D = 0;
    for (int d = threadIdx.x; d < hs; d += blockDim.x) D += (A)dy[yo + d] * (A)y[yo + d];
    D = block_sum(D, shared);
    A l = lse[row];
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        long long ko = (b * Tn + j) * C3 + C + (long long)h * hs, vo = ko + C;
        A s = 0, dp = 0;
        for (int d = 0; d < hs; d++) { s += (A)qkv[qo + d] * (A)qkv[ko + d]; dp += (A)dy[yo + d] * (A)qkv[vo + d]; }
        A pj = exp(s * scale - l);
        A dsj = pj * (dp - D);
        ds[j] = dsj;
        for (int d = 0; d < hs; d++) {
            atomicAdd(dqkv + ko + d, (T)(scale * dsj * (A)qkv[qo + d]));
            atomicAdd(dqkv + vo + d, (T)(pj * (A)dy[yo + d]));
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        A acc = 0;
        for (int j = 0; j <= i; j++) acc += ds[j] * (A)qkv[(b * Tn + j) * C3 + C + (long long)h * hs + d];
        dqkv[qo + d] = (T)(scale * acc);
    }
}
"""


def _qkv_heads(qkv, n_head):
    """q (B, nh, T, hs), k (B, nh, hs, T), v (B, nh, T, hs): views of qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    r = qkv.reshape(B, T, 3, n_head, hs)
    return (r[:, :, 0].transpose(0, 2, 1, 3), r[:, :, 1].transpose(0, 2, 3, 1),
            r[:, :, 2].transpose(0, 2, 1, 3))


def attention_twin(qkv, n_head, scale):
    """(y (B, T, C), lse (B, nh, T), the probabilities (B, nh, T, T) for the backward)."""
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    s = backend.matmul(q, k)
    att = softmax_causal_twin(s, scale)
    B, nh, T, hs = q.shape
    y = backend.matmul(att, v).transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
    z = xp.where(att > 0, s * scale, xp.asarray(-np.inf, dtype=s.dtype))
    zmax = z.max(axis=-1)
    lse = zmax + xp.log(xp.exp(z - zmax[..., None]).sum(axis=-1))
    return xp.ascontiguousarray(y), lse, att


def attention_bwd_twin(qkv, y, dy, lse, n_head, scale, att=None):
    """dqkv (B, T, 3C) of y = attention_twin(qkv)[0]."""
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    B, nh, T, hs = q.shape
    if att is None:
        att = xp.exp(backend.matmul(q, k) * scale - lse[..., None])
        att = xp.where(xp.arange(T)[None, :] > xp.arange(T)[:, None], 0, att)
    g = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)            # (B, nh, T, hs)
    dv = backend.matmul(xp.swapaxes(att, -1, -2), g)              # (B, nh, T, hs)
    datt = backend.matmul(g, xp.swapaxes(v, -1, -2))               # (B, nh, T, T)
    ds = softmax_causal_bwd_twin(datt, att, scale)
    dq = backend.matmul(ds, xp.swapaxes(k, -1, -2))                # (B, nh, T, hs)
    dk = backend.matmul(xp.swapaxes(ds, -1, -2), q)                # (B, nh, T, hs)
    out = xp.empty(qkv.shape, dtype=qkv.dtype)
    r = out.reshape(B, T, 3, nh, hs)
    for part, grad in enumerate((dq, dk, dv)):
        r[:, :, part] = grad.transpose(0, 2, 1, 3)
    return out


def _attention_launch(k, qkv, n_head, scale):
    xp = backend.xp()
    qkv = xp.ascontiguousarray(qkv)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    acc = np.float64 if qkv.dtype == np.float64 else np.float32
    y = xp.empty((B, T, C3 // 3), dtype=qkv.dtype)
    lse = xp.empty((B, n_head, T), dtype=acc)
    k("attention_fwd")((max(B * n_head * T, 1),), (128,),
                       (qkv, y, lse, np.int32(B), np.int32(T), np.int32(n_head), np.int32(hs),
                        _scalar(acc, scale)), shared_mem=T * np.dtype(acc).itemsize)
    return y, lse.astype(qkv.dtype, copy=False), None


def _attention_bwd_launch(k, qkv, y, dy, lse, n_head, scale, att=None):
    xp = backend.xp()
    qkv = xp.ascontiguousarray(qkv)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    acc = np.float64 if qkv.dtype == np.float64 else np.float32
    dqkv = xp.zeros_like(qkv)
    k("attention_bwd")((max(B * n_head * T, 1),), (128,),
                       (qkv, xp.ascontiguousarray(y), xp.ascontiguousarray(dy),
                        xp.ascontiguousarray(lse, dtype=acc), dqkv, np.int32(B), np.int32(T),
                        np.int32(n_head), np.int32(hs), _scalar(acc, scale)),
                       shared_mem=T * np.dtype(acc).itemsize)
    return dqkv


def _attention_cases(xp, rng, dt, backward=False):
    for B, T, nh, hs in ((1, 1, 1, 1), (2, 5, 3, 4), (1, 17, 2, 64), (2, 64, 4, 16)):
        qkv = xp.asarray(rng.standard_normal((B, T, 3 * nh * hs)).astype(dt))
        scale = 1.0 / math.sqrt(hs)
        if not backward:
            yield qkv, nh, scale
        else:
            y, lse, _ = attention_twin(qkv, nh, scale)
            yield qkv, y, xp.asarray(rng.standard_normal(y.shape).astype(dt)), lse, nh, scale


ATTENTION_FWD = Fused("attention_fwd", _ATTENTION, ["attention_fwd"], _attention_launch,
                      attention_twin, lambda xp, rng, dt: _attention_cases(xp, rng, dt),
                      compare=2)
ATTENTION_BWD = Fused("attention_bwd", _ATTENTION, ["attention_bwd"], _attention_bwd_launch,
                      attention_bwd_twin,
                      lambda xp, rng, dt: _attention_cases(xp, rng, dt, True), tolerance=1e-4)


# ---- a bias's gradient, added into its buffer ----------------------------------------------

_COLSUM = r"""
// out[c] += sum over rows of g[r, c]: one thread per column (adjacent threads read adjacent
// addresses of each row)
extern "C" __global__ void colsum_add(const T* g, T* out, long long rows, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    A s = 0;
    for (long long r = 0; r < rows; r++) s += (A)g[r * C + c];
    out[c] = (T)((A)out[c] + s);
}
"""


def colsum_add_twin(g, out):
    """``out += g.sum(axis=0)`` for g (N, C); returns out."""
    out += g.sum(axis=0)
    return out


def _colsum_launch(k, g, out):
    rows, C = _rows(g)
    k("colsum_add")(*grid(C), (backend.xp().ascontiguousarray(g), out, np.int64(rows),
                               np.int32(C)))
    return out


def _colsum_cases(xp, rng, dt):
    for rows, C in ((1, 1), (3, 7), (1000, 65), (4096, 768)):
        yield (xp.asarray(rng.standard_normal((rows, C)).astype(dt)),
               xp.asarray(rng.standard_normal(C).astype(dt)))


COLSUM_ADD = Fused("colsum_add", _COLSUM, ["colsum_add"], _colsum_launch, colsum_add_twin,
                   _colsum_cases, tolerance=1e-5)


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
