"""RMSNorm's fused kernels (forward, backward), each beside its NumPy twin: x / rms(x) * w,
one warp a row forward; the weight's gradient summed by the last block. Their CPU kernels:
cpu_norm_gate_rope.py."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .elementwise import bias_residual_twin
from .layernorm import RESIDUAL_ROW
from .common import (_COMMON, _FINISH, _VECTOR, WARP_ROWS, _rows, _scalar, accumulator, finishes,
                     kept_zeros, low, row_threads, rows_per_block, sums, summed, vector_width,
                     wide)

# ---- RMSNorm -------------------------------------------------------------------------------

_RMSNORM = _COMMON + _VECTOR + _FINISH + RESIDUAL_ROW + r"""
// one warp per row of C, VEC elements a lane at a time (LayerNorm's forward says why): y = x
// rstd w, rstd = 1 / sqrt(mean(x^2) + eps), kept for backward. ``rmsnorm_row``: the pass
// after the lane's sum of squares q of the row
__device__ __forceinline__ void rmsnorm_row(const T* xr, const T* w, T* yr, A* rstd, int C,
                                            A eps, int lane, A q) {
    alignas(16) T xv[VEC], wv[VEC], yv[VEC];
    A rs = (A)1 / sqrt(lane_sum(q) / (A)C + eps);
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        copy_vec(wv, w + c);
#pragma unroll
        for (int j = 0; j < VEC; j++) yv[j] = (T)((A)xv[j] * rs * (A)wv[j]);
        copy_vec(yr + c, yv);
    }
    if (lane == 0) *rstd = rs;
}
extern "C" __global__ void rmsnorm_fwd(const T* x, const T* w, T* y, A* rstd, long long rows,
                                       int C, A eps) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;                               // (the whole warp: one row a warp)
    rmsnorm_row(x + r * C, w, y + r * C, rstd + r, C, eps, lane, row_sum(x + r * C, C, lane, 1));
}
// x += bias + residual in place (the residual stream after a projection), then its RMSNorm
extern "C" __global__ void residual_rmsnorm_fwd(T* x, const T* bias, const T* res, const T* w,
                                                T* y, A* rstd, long long rows, int C, A eps,
                                                int has_bias, int has_res) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    A q = residual_row(x + r * C, bias, res + r * C * has_res, C, lane, has_bias, has_res, 1);
    rmsnorm_row(x + r * C, w, y + r * C, rstd + r, C, eps, lane, q);
}
// one block per ``per`` rows (<= 32): gx = rstd (g w - xhat mean(g w xhat)), xhat = x rstd;
// the weight's gradient summed over the block's rows in shared memory (each thread owns its
// VEC-wide columns) and added once a block into gw (zeros, or its own gradient buffer);
// per == 1 (a row too wide for the shared sums): added row by row. ``finish``: gw a kept
// workspace added into the 2-byte buffer gw_low by the last block. gx in a second, flat pass
// (LayerNorm's backward says why), ``adds``: with x's gradient from elsewhere added to it
extern "C" __global__ void rmsnorm_bwd(const T* g, const T* x, const T* w, const A* rstd,
                                       const T* add, T* gx, A* gw, T* gw_low, unsigned* done,
                                       long long rows, int C, int per, int finish, int adds) {
    __shared__ A shared[32];
    __shared__ A stats[32];                              // each row's mean(g w xhat)
    extern __shared__ unsigned char smem[];
    A* part = (A*)smem;                                  // [C] when per > 1
    long long r0 = (long long)blockIdx.x * per;
    if (r0 >= rows) return;
    int n = (int)((r0 + per < rows ? r0 + per : rows) - r0);
    alignas(16) T gv[VEC], xv[VEC], wv[VEC], av[VEC], ov[VEC];
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
        if (adds) copy_vec(av, add + at);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            ov[j] = (T)(rs * ((A)gv[j] * (A)wv[j] - (A)xv[j] * rs * s) +
                        (adds ? (A)av[j] : (A)0));
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


def residual_rmsnorm_twin(x, bias, residual, w, eps):
    """``x += bias; x += residual`` in place (either None: left out), then RMSNorm of x:
    (x, y, rstd, xhat)."""
    bias_residual_twin(x, bias, residual)
    return (x,) + rmsnorm_twin(x, w, eps)


def rmsnorm_bwd_twin(g, x, w, rstd, xhat=None, gw_into=None, add=None):
    """(gx, gw) of y = x rstd w; ``gw_into``: the weight's gradient added into it; ``add``:
    x's gradient from elsewhere, added to gx. 2-byte floats in float32, gx and gw rounded
    back."""
    if low(x):
        gx, gw = rmsnorm_bwd_twin(wide(g), wide(x), wide(w), rstd,
                                  wide(xhat) if xhat is not None else None,
                                  add=None if add is None else wide(add))
        return gx.astype(x.dtype), summed(gw, gw_into, x.dtype)
    if xhat is None:
        xhat = x * rstd[..., None]
    gxhat = g * w
    m = (gxhat * xhat).sum(axis=-1, keepdims=True) * (1.0 / x.shape[-1])
    gx = (gxhat - xhat * m) * rstd[..., None]
    if add is not None:
        gx += add
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


def _residual_rmsnorm_launch(k, x, bias, residual, w, eps):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    y = xp.empty_like(x)
    rstd = xp.empty(rows, dtype=acc)
    w = xp.ascontiguousarray(w)
    given = [xp.ascontiguousarray(a) for a in (bias, residual) if a is not None]
    vec = vector_width(x.size, x, w, y, *given, row=C)
    k("residual_rmsnorm_fwd", {"VEC": vec})(
        (max(-(-rows // WARP_ROWS), 1),), (32 * WARP_ROWS,),
        (x, x if bias is None else given[0], x if residual is None else given[-1], w, y, rstd,
         np.int64(rows), np.int32(C), _scalar(acc, eps), np.int32(bias is not None),
         np.int32(residual is not None)))
    return x, y, rstd.reshape(x.shape[:-1]), None


def _rmsnorm_bwd_launch(k, g, x, w, rstd, xhat=None, gw_into=None, add=None):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    gx = xp.empty_like(x)
    finish = finishes(x, acc, gw_into)
    gw = kept_zeros(xp, C, acc, "norm sums")[:C] if finish else sums(gw_into, C, acc)
    per, shm = rows_per_block(rows, C * np.dtype(acc).itemsize)
    g, w = xp.ascontiguousarray(g, dtype=x.dtype), xp.ascontiguousarray(w)
    add = None if add is None else xp.ascontiguousarray(add, dtype=x.dtype)
    vec = vector_width(x.size, g, x, w, gx, *(() if add is None else (add,)), row=C)
    k("rmsnorm_bwd", {"VEC": vec})((max(-(-rows // per), 1),), (row_threads(C, vec),),
                                   (g, x, w, xp.ascontiguousarray(rstd, dtype=acc).reshape(-1),
                                    g if add is None else add, gx, gw,
                                    gw_into if finish else gx,
                                    kept_zeros(xp, 1, np.uint32, "norm counter"),
                                    np.int64(rows), np.int32(C), np.int32(per),
                                    np.int32(finish), np.int32(add is not None)),
                                   shared_mem=shm)
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
            add = xp.asarray(rng.standard_normal(shape).astype(dt))
            yield g, x, w, rstd, None, None, add              # x's other gradient
    x = xp.zeros((2, 8), dtype=dt)                  # all-zero rows: rstd = 1/sqrt(eps)
    yield (x, xp.ones(8, dtype=dt), 1e-6) if not backward else \
        (xp.ones((2, 8), dtype=dt), x, xp.ones(8, dtype=dt), rmsnorm_twin(x, x[0], 1e-6)[1])


RMSNORM_FWD = Fused("rmsnorm_fwd", _RMSNORM, ["rmsnorm_fwd"], _rmsnorm_launch, rmsnorm_twin,
                    lambda xp, rng, dt: _rmsnorm_cases(xp, rng, dt), compare=2,
                    cpu="cpu_norm_gate_rope.rmsnorm")

def _residual_rms_cases(xp, rng, dt):
    for x, w, eps in _rmsnorm_cases(xp, rng, dt):
        bias = xp.asarray(rng.standard_normal(x.shape[-1]).astype(dt))
        residual = xp.asarray(rng.standard_normal(x.shape).astype(dt))
        for given in ((None, residual), (bias, residual), (bias, None)):
            yield (x.copy(),) + given + (w, eps)


RESIDUAL_RMSNORM = Fused("residual_rmsnorm_fwd", _RMSNORM, ["residual_rmsnorm_fwd"],
                         _residual_rmsnorm_launch, residual_rmsnorm_twin, _residual_rms_cases,
                         compare=3, cpu="cpu_norm_gate_rope.residual_rmsnorm")
RMSNORM_BWD = Fused("rmsnorm_bwd", _RMSNORM, ["rmsnorm_bwd"], _rmsnorm_bwd_launch,
                    rmsnorm_bwd_twin, lambda xp, rng, dt: _rmsnorm_cases(xp, rng, dt, True),
                    tolerance=1e-4,
                    cpu="cpu_norm_gate_rope.rmsnorm_bwd")
