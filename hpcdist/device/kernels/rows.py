"""Row kernels, one CUDA block per row: scale + causal mask + softmax of attention scores,
cross-entropy; forward and backward (LayerNorm's: layernorm.py)."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import ROW_THREADS, Fused
from .common import _COMMON, _VECTOR, _rows, _scalar, vector_width


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
            y = softmax_causal_twin(x, 0.125, past).astype(dt)
            yield xp.asarray(rng.standard_normal(shape).astype(dt)), y, 0.125


SOFTMAX_CAUSAL_FWD = Fused("softmax_causal_fwd", _SOFTMAX, ["softmax_causal_fwd"],
                           _softmax_launch, softmax_causal_twin,
                           lambda xp, rng, dt: _softmax_cases(xp, rng, dt),
                           cpu="cpu.softmax_causal")
SOFTMAX_CAUSAL_BWD = Fused("softmax_causal_bwd", _SOFTMAX, ["softmax_causal_bwd"],
                           _softmax_bwd_launch, softmax_causal_bwd_twin,
                           lambda xp, rng, dt: _softmax_cases(xp, rng, dt, True),
                           cpu="cpu.softmax_causal_bwd")


# ---- cross-entropy -------------------------------------------------------------------------

_CROSS_ENTROPY = _COMMON + _VECTOR + r"""
// one block per row of V logits, of which the first Vv are the vocabulary (the rest: padding
// to an aligned width, never in the loss): lse = log sum exp; nll = lse - z[t] (0 where t is
// ignored). One pass over the row, VEC logits a thread at a time (V divides by VEC): each
// thread keeps a running max and its sum of exp(z - max), rescaled as the max grows (the
// online softmax); the block then rescales the threads' sums to the row's max.
extern "C" __global__ void cross_entropy_fwd(const T* z, const long long* t, A* nll, A* lse,
                                             long long rows, int V, int Vv, long long ignore) {
    __shared__ A shared[32];
    long long r = blockIdx.x;
    if (r >= rows) return;
    const T* zr = z + r * V;
    alignas(16) T zv[VEC];
    A mx = NEG_INF, s = 0;
    for (int c = threadIdx.x * VEC; c < Vv; c += blockDim.x * VEC) {
        copy_vec(zv, zr + c);
        for (int j = 0; j < VEC && c + j < Vv; j++) {
            A v = (A)zv[j];
            if (v > mx) { s = s * exp(mx - v) + (A)1; mx = v; }
            else if (!(v == NEG_INF)) s += exp(v - mx);    // (a NaN goes in: it shows)
        }
    }
    A m = block_max(mx, shared);
    s = block_sum(s * exp(mx - m), shared);
    if (threadIdx.x == 0) {
        A l = m + log(s);
        long long target = t[r];
        lse[r] = l;
        nll[r] = (target == ignore || target < 0 || target >= Vv) ? (A)0 : l - (A)zr[target];
    }
}
// the gradient: (softmax - onehot(t)) * weight, 0 on ignored rows and padding columns
// (weight: the loss's gradient over the positions scored, in the accumulator's type)
extern "C" __global__ void cross_entropy_bwd(const T* z, const long long* t, const A* lse,
                                             T* gz, long long rows, int V, int Vv,
                                             long long ignore, const A* weight) {
    long long r = blockIdx.x;
    if (r >= rows) return;
    long long target = t[r];
    bool skip = target == ignore || target < 0 || target >= Vv;
    A l = lse[r], wt = weight[0];
    alignas(16) T zv[VEC], gv[VEC];
    for (int c = threadIdx.x * VEC; c < V; c += blockDim.x * VEC) {
        copy_vec(zv, z + r * V + c);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            gv[j] = (T)(skip || c + j >= Vv ? (A)0
                        : (exp((A)zv[j] - l) - (c + j == target ? (A)1 : (A)0)) * wt);
        copy_vec(gz + r * V + c, gv);
    }
}
"""

_CE_MEAN = _COMMON + r"""
// the mean loss over the positions scored, and 1 / their count (at least 1), from the rows'
// nll: one block, the threads' strided sums added in the block's fixed order
extern "C" __global__ void cross_entropy_mean(const T* nll, const long long* t, T* out,
                                              long long rows, long long ignore) {
    __shared__ A shared[32];
    A s = 0, c = 0;
    for (long long r = threadIdx.x; r < rows; r += blockDim.x) {
        s += (A)nll[r];
        if (t[r] != ignore) c += (A)1;
    }
    s = block_sum(s, shared);
    c = block_sum(c, shared);
    if (threadIdx.x == 0) {
        A n = c > (A)1 ? c : (A)1;
        out[0] = (T)(s / n);
        out[1] = (T)((A)1 / n);
    }
}
"""


def cross_entropy_twin(z, t, ignore, vocab=None):
    """(nll per row, 0 where ignored; log-sum-exp per row) of logits z (R, V) whose first
    ``vocab`` columns are the vocabulary (None: all; the rest is padding). bf16 logits are
    read into float32 and both results stay float32, as the kernel keeps them (its ``A``);
    fp16 (no kernel: this twin runs) too, as autograd.ops.cross_entropy sums the loss."""
    xp = backend.array_module(z)
    z = z if vocab is None else z[:, :vocab]
    z = z.astype(np.float32) if z.dtype.itemsize < 4 else z
    valid = t != ignore
    safe = xp.where(valid, t, 0)
    shifted = z - z.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=1))
    rows = xp.arange(z.shape[0])
    nll = (lse - shifted[rows, safe]) * valid
    return nll, lse + z.max(axis=1)


def cross_entropy_mean_twin(nll, t, ignore):
    """(the mean of ``nll`` over the positions whose target is not ``ignore``, 1 / their count
    (at least 1)) as 0-d arrays of nll's dtype: the loss and its gradient's weight, on the
    device (no read)."""
    xp = backend.array_module(nll)
    count = xp.maximum((t != ignore).sum(), 1).astype(nll.dtype)
    return nll.sum() / count, 1 / count


def cross_entropy_bwd_twin(z, t, lse, ignore, weight, vocab=None):
    """(softmax(z) - onehot(t)) * weight per row, 0 on ignored rows and on the padding columns
    past ``vocab`` (``weight``: a 0-d array, so that no value leaves the device)."""
    xp = backend.array_module(z)
    low = z.dtype if z.dtype.itemsize < 4 else None  # (computed in float32, stored so)
    z = z.astype(np.float32) if low else z
    valid = t != ignore
    p = xp.exp(z - lse[:, None].astype(z.dtype))
    if vocab is not None:
        p[:, vocab:] = 0
    rows = xp.arange(z.shape[0])
    p[rows, xp.where(valid, t, 0)] -= 1
    p *= (valid * weight.astype(z.dtype))[:, None].astype(p.dtype)
    return p.astype(low) if low else p


def _ce_launch(k, z, t, ignore, vocab=None):
    xp = backend.xp()
    rows, V = _rows(z)
    acc = np.float64 if z.dtype == np.float64 else np.float32
    nll, lse = xp.empty(rows, dtype=acc), xp.empty(rows, dtype=acc)
    z = xp.ascontiguousarray(z)
    vec = vector_width(z.size, z, row=V)
    k("cross_entropy_fwd", {"VEC": vec})((max(rows, 1),), (ROW_THREADS,),
                                         (z, xp.ascontiguousarray(t, dtype=np.int64), nll, lse,
                                          np.int64(rows), np.int32(V),
                                          np.int32(V if vocab is None else vocab),
                                          np.int64(ignore)))
    if z.dtype.itemsize < 4:           # kept in A (float32): the loss is summed in float32
        return nll, lse
    return nll.astype(z.dtype, copy=False), lse.astype(z.dtype, copy=False)


def _ce_bwd_launch(k, z, t, lse, ignore, weight, vocab=None):
    xp = backend.xp()
    rows, V = _rows(z)
    acc = np.float64 if z.dtype == np.float64 else np.float32
    z = xp.ascontiguousarray(z)
    gz = xp.empty_like(z)
    vec = vector_width(z.size, z, gz, row=V)
    k("cross_entropy_bwd", {"VEC": vec})((max(rows, 1),), (ROW_THREADS,),
                                         (z, xp.ascontiguousarray(t, dtype=np.int64),
                                          xp.ascontiguousarray(lse, dtype=acc), gz,
                                          np.int64(rows), np.int32(V),
                                          np.int32(V if vocab is None else vocab),
                                          np.int64(ignore),
                                          xp.ascontiguousarray(weight, dtype=acc).reshape(1)))
    return gz


def _ce_mean_launch(k, nll, t, ignore):
    xp = backend.xp()
    out = xp.empty(2, dtype=nll.dtype)
    k("cross_entropy_mean")((1,), (ROW_THREADS,),
                            (xp.ascontiguousarray(nll), xp.ascontiguousarray(t, dtype=np.int64),
                             out, np.int64(nll.size), np.int64(ignore)))
    return out[0], out[1]


def _ce_mean_cases(xp, rng, dt):
    for rows in (1, 7, 1000, 4096, 9001):
        t = rng.integers(0, 50, rows)
        t[::3] = -100
        yield xp.asarray(rng.exponential(3.0, rows).astype(dt)), xp.asarray(t), -100
    yield xp.zeros(5, dtype=dt), xp.asarray(np.full(5, -100)), -100     # nothing scored


def _ce_cases(xp, rng, dt, backward=False):
    """Rows of every length, with and without padding columns (GPT-2's 50,257 padded to
    50,304)."""
    for R, V, vocab in ((1, 1, None), (1, 5, None), (7, 13, None), (7, 13, 10), (5, 96, None),
                        (5, 96, 90), (33, 50304, 50257)):
        host = (rng.standard_normal((R, V)) * 4).astype(dt)
        if V == 96:
            host[:, 1::7] = -np.inf                     # masked logits: exp 0, no NaN
        z = xp.asarray(host)
        t = rng.integers(0, vocab or V, R)
        t[::3] = -100
        t = xp.asarray(t)
        if not backward:
            yield z, t, -100, vocab
        else:
            yield (z, t, cross_entropy_twin(z, t, -100, vocab)[1], -100,
                   xp.asarray(0.25, dtype=dt), vocab)


CROSS_ENTROPY_FWD = Fused("cross_entropy_fwd", _CROSS_ENTROPY, ["cross_entropy_fwd"],
                          _ce_launch, cross_entropy_twin,
                          lambda xp, rng, dt: _ce_cases(xp, rng, dt), tolerance=1e-5,
                          cpu="cpu.cross_entropy")
CROSS_ENTROPY_MEAN = Fused("cross_entropy_mean", _CE_MEAN, ["cross_entropy_mean"],
                           _ce_mean_launch, cross_entropy_mean_twin, _ce_mean_cases,
                           tolerance=1e-5, dtypes=("float32", "float64"))
CROSS_ENTROPY_BWD = Fused("cross_entropy_bwd", _CROSS_ENTROPY, ["cross_entropy_bwd"],
                          _ce_bwd_launch, cross_entropy_bwd_twin,
                          lambda xp, rng, dt: _ce_cases(xp, rng, dt, True),
                          cpu="cpu.cross_entropy_bwd")
