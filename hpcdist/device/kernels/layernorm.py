"""LayerNorm's kernels beside their NumPy twins: the forward one warp per row, the backward a
block per few rows (its weight and bias gradients summed in shared memory); both read 16
bytes a thread at a time where the arrays allow (common.py's vectors)."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .elementwise import bias_residual_twin
from .common import (_COMMON, _FINISH, _VECTOR, WARP_ROWS, _rows, _scalar, accumulator, finishes,
                     kept_zeros, low, row_threads, rows_per_block, sums, summed, vector_width,
                     wide)


# ---- LayerNorm -----------------------------------------------------------------------------

# a norm's first pass over a row (the lane's sum of its values, or of their squares), and the
# same made where the row is made in place: x += bias + residual (flags say which), by the
# lanes that read it back (their own elements: no barrier)
RESIDUAL_ROW = r"""
__device__ __forceinline__ A row_sum(const T* xr, int C, int lane, int squares) {
    alignas(16) T xv[VEC];
    A s = 0;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        for (int j = 0; j < VEC; j++) { A v = (A)xv[j]; s += squares ? v * v : v; }
    }
    return s;
}
__device__ __forceinline__ A residual_row(T* xr, const T* bias, const T* rr, int C, int lane,
                                          int has_bias, int has_res, int squares) {
    alignas(16) T xv[VEC], bv[VEC], rv[VEC];
    A s = 0;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        if (has_bias) copy_vec(bv, bias + c);
        if (has_res) copy_vec(rv, rr + c);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            A v = (A)xv[j];
            if (has_bias) v += (A)bv[j];
            if (has_res) v += (A)rv[j];
            xv[j] = (T)v;
            v = (A)xv[j];                                // (the stored value, as the twin's)
            s += squares ? v * v : v;
        }
        copy_vec(xr + c, xv);
    }
    return s;
}
"""

_LAYERNORM = _COMMON + _VECTOR + _FINISH + RESIDUAL_ROW + r"""
// one warp per row of C (blockDim.x / 32 rows a block), VEC elements a lane at a time (C
// divides by VEC): y = (x - mean) * rstd * w + b; mean and rstd kept for backward. No block
// barrier; GPT-2 medium's row of 1,024 bf16 is four 16-byte loads a lane a pass (a block a
// row with 2-byte loads took 30 us a call on an H200, a quarter of its memory's speed).
// ``layernorm_row``: the passes after the lane's sum s of the row
__device__ __forceinline__ void layernorm_row(const T* xr, const T* w, const T* b, T* yr,
                                              A* mean, A* rstd, int C, A eps, int lane, A s) {
    alignas(16) T xv[VEC], wv[VEC], bv[VEC], yv[VEC];
    A m = lane_sum(s) / (A)C;
    A q = 0;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        for (int j = 0; j < VEC; j++) { A d = (A)xv[j] - m; q += d * d; }
    }
    A rs = (A)1 / sqrt(lane_sum(q) / (A)C + eps);
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        copy_vec(xv, xr + c);
        copy_vec(wv, w + c);
        copy_vec(bv, b + c);
#pragma unroll
        for (int j = 0; j < VEC; j++) yv[j] = (T)(((A)xv[j] - m) * rs * (A)wv[j] + (A)bv[j]);
        copy_vec(yr + c, yv);
    }
    if (lane == 0) { *mean = m; *rstd = rs; }
}
extern "C" __global__ void layernorm_fwd(const T* x, const T* w, const T* b, T* y,
                                         A* mean, A* rstd, long long rows, int C, A eps) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;                               // (the whole warp: one row a warp)
    layernorm_row(x + r * C, w, b, y + r * C, mean + r, rstd + r, C, eps, lane,
                  row_sum(x + r * C, C, lane, 0));
}
// x += bias + residual in place (the residual stream after a projection), then its LayerNorm
extern "C" __global__ void residual_layernorm_fwd(T* x, const T* bias, const T* res,
                                                  const T* w, const T* b, T* y, A* mean,
                                                  A* rstd, long long rows, int C, A eps,
                                                  int has_bias, int has_res) {
    int lane = threadIdx.x & 31;
    long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    A s = residual_row(x + r * C, bias, res + r * C * has_res, C, lane, has_bias, has_res, 0);
    layernorm_row(x + r * C, w, b, y + r * C, mean + r, rstd + r, C, eps, lane, s);
}
// one block per ``per`` rows (<= 32): gx = rstd (gxhat - mean(gxhat) - xhat mean(gxhat xhat)),
// gxhat = g w; the weight and bias gradients summed over the block's rows in shared memory
// (each thread owns its VEC-wide columns) and added once a block into gw, gb (in the
// accumulator's type: zeros, or the parameters' own gradient buffers). per == 1 (a row too
// wide for the shared partial sums): added row by row. An atomic a row and column contended
// 8,192 ways at GPT-2 medium's shape: 100 us a call on an H200. ``finish``: gw, gb are a kept
// workspace (gb = gw + C) added into the 2-byte buffers gw_low, gb_low by the last block
// (common.py's finish_into). gx is written in a second
// pass over the block's rows and columns as one flat loop: inside a loop over rows, NVVM split
// each 16-byte store into scalar ones. ``adds``: the gradient x already has from its other
// consumers (the residual stream's) is added to gx in that pass, rounded once.
extern "C" __global__ void layernorm_bwd(const T* g, const T* x, const T* w, const A* mean,
                                         const A* rstd, const T* add, T* gx, A* gw, A* gb,
                                         T* gw_low, T* gb_low, unsigned* done, long long rows,
                                         int C, int per, int finish, int adds) {
    __shared__ A shared[32];
    __shared__ A stats[64];                              // each row's two means
    extern __shared__ unsigned char smem[];
    A* part = (A*)smem;                                  // [2][C] when per > 1
    long long r0 = (long long)blockIdx.x * per;
    if (r0 >= rows) return;
    int n = (int)((r0 + per < rows ? r0 + per : rows) - r0);
    alignas(16) T gv[VEC], xv[VEC], wv[VEC], av[VEC], ov[VEC];
    if (per > 1)
        for (int c = threadIdx.x; c < C; c += blockDim.x) { part[c] = 0; part[C + c] = 0; }
    __syncthreads();                       // (threads zero other columns than they add to)
    for (int k = 0; k < n; k++) {
        const T* gr = g + (r0 + k) * C;
        const T* xr = x + (r0 + k) * C;
        A m = mean[r0 + k], rs = rstd[r0 + k], s1 = 0, s2 = 0;
        for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
            copy_vec(gv, gr + c);
            copy_vec(xv, xr + c);
            copy_vec(wv, w + c);
            for (int j = 0; j < VEC; j++) {
                A xhat = ((A)xv[j] - m) * rs, gc = (A)gv[j], gh = gc * (A)wv[j];
                s1 += gh;
                s2 += gh * xhat;
                if (per > 1) { part[c + j] += gc * xhat; part[C + c + j] += gc; }
                else { atomicAdd(gw + c + j, gc * xhat); atomicAdd(gb + c + j, gc); }
            }
        }
        s1 = block_sum(s1, shared);
        s2 = block_sum(s2, shared);
        if (threadIdx.x == 0) { stats[2 * k] = s1 / (A)C; stats[2 * k + 1] = s2 / (A)C; }
    }
    __syncthreads();
    int vectors = C / VEC;
    for (int i = threadIdx.x; i < n * vectors; i += blockDim.x) {
        int k = i / vectors;
        long long at = (r0 + k) * C + (long long)(i - k * vectors) * VEC;
        A m = mean[r0 + k], rs = rstd[r0 + k], s1 = stats[2 * k], s2 = stats[2 * k + 1];
        copy_vec(gv, g + at);
        copy_vec(xv, x + at);
        copy_vec(wv, w + (i - k * vectors) * VEC);
        if (adds) copy_vec(av, add + at);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            A xhat = ((A)xv[j] - m) * rs, gh = (A)gv[j] * (A)wv[j];
            ov[j] = (T)(rs * (gh - s1 - xhat * s2) + (adds ? (A)av[j] : (A)0));
        }
        copy_vec(gx + at, ov);
    }
    __syncthreads();
    if (per > 1)
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            atomicAdd(gw + c, part[c]);
            atomicAdd(gb + c, part[C + c]);
        }
    if (finish) finish_into(gw, gw_low, gb_low, C, 1, done);    // (gb is gw + C then)
}
"""


def layernorm_twin(x, w, b, eps):
    """(y, mean, rstd, xhat) over the last axis; mean and rstd of shape x.shape[:-1]. 2-byte
    floats are normalised in float32 (mean, rstd and xhat stay float32), y rounded back."""
    if low(x):
        y, mean, rstd, xhat = layernorm_twin(wide(x), wide(w), wide(b), eps)
        return y.astype(x.dtype), mean, rstd, xhat
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


def residual_layernorm_twin(x, bias, residual, w, b, eps):
    """``x += bias; x += residual`` in place (either None: left out), then LayerNorm of x:
    (x, y, mean, rstd, xhat)."""
    bias_residual_twin(x, bias, residual)
    return (x,) + layernorm_twin(x, w, b, eps)


def layernorm_bwd_twin(g, x, w, mean, rstd, xhat=None, gw_into=None, gb_into=None, add=None):
    """(gx, gw, gb) of y = (x - mean) rstd w + b; ``xhat`` the forward's normalised x when it
    kept it; ``gw_into``/``gb_into``: add the weight and bias gradients into these (returned
    as gw, gb) instead of new arrays; ``add``: x's gradient from elsewhere, added to gx.
    2-byte floats: in float32, gx rounded back, the sums added into the buffers (or
    returned) in their dtype."""
    if low(x):
        gx, gw, gb = layernorm_bwd_twin(wide(g), wide(x), wide(w), mean, rstd, wide(xhat)
                                        if xhat is not None else None,
                                        add=None if add is None else wide(add))
        return (gx.astype(x.dtype),) + tuple(summed(sums_, into, x.dtype) for sums_, into in
                                             ((gw, gw_into), (gb, gb_into)))
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
    if add is not None:
        gx += add
    C = x.shape[-1]
    flat_g = g.reshape(-1, C)
    gw = xp.einsum("nc,nc->c", flat_g, xhat.reshape(-1, C))
    return (gx,) + added_into(gw, flat_g.sum(axis=0), gw_into, gb_into)


def added_into(gw, gb, gw_into, gb_into) -> tuple:
    """(gw, gb) of LayerNorm's backward, each added into its buffer where one is given (and
    returned as it)."""
    if gw_into is not None:
        gw_into += gw
        gw = gw_into
    if gb_into is not None:
        gb_into += gb
        gb = gb_into
    return gw, gb


def _layernorm_launch(k, x, w, b, eps):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    y = xp.empty_like(x)
    mean, rstd = xp.empty(rows, dtype=acc), xp.empty(rows, dtype=acc)
    vec = vector_width(x.size, x, w, b, y, row=C)
    k("layernorm_fwd", {"VEC": vec})((max(-(-rows // WARP_ROWS), 1),), (32 * WARP_ROWS,),
                                     (x, w, b, y, mean, rstd, np.int64(rows), np.int32(C),
                                      _scalar(acc, eps)))
    return y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1]), None


def _residual_layernorm_launch(k, x, bias, residual, w, b, eps):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    y = xp.empty_like(x)
    mean, rstd = xp.empty(rows, dtype=acc), xp.empty(rows, dtype=acc)
    given = [xp.ascontiguousarray(a) for a in (bias, residual) if a is not None]
    vec = vector_width(x.size, x, w, b, y, *given, row=C)
    k("residual_layernorm_fwd", {"VEC": vec})(
        (max(-(-rows // WARP_ROWS), 1),), (32 * WARP_ROWS,),
        (x, x if bias is None else given[0], x if residual is None else given[-1], w, b, y,
         mean, rstd, np.int64(rows), np.int32(C), _scalar(acc, eps),
         np.int32(bias is not None), np.int32(residual is not None)))
    return x, y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1]), None


def _layernorm_bwd_launch(k, g, x, w, mean, rstd, xhat=None, gw_into=None, gb_into=None,
                          add=None):
    xp = backend.xp()
    rows, C = _rows(x)
    acc = accumulator(x.dtype)
    gx = xp.empty_like(x)
    # 2-byte buffers for both sums: added by the kernel's last block from a kept workspace
    finish = finishes(x, acc, gw_into, gb_into)
    if finish:
        ws = kept_zeros(xp, 2 * C, acc, "norm sums")
        gw, gb, lows = ws[:2 * C], ws[C:2 * C], (gw_into, gb_into)   # (gw: finish reads 2C)
    else:
        gw, gb = sums(gw_into, C, acc), sums(gb_into, C, acc)
        lows = (gx, gx)                                  # (valid pointers, not written)
    per, shm = rows_per_block(rows, 2 * C * np.dtype(acc).itemsize)
    g = xp.ascontiguousarray(g)
    add = None if add is None else xp.ascontiguousarray(add, dtype=x.dtype)
    vec = vector_width(x.size, g, x, w, gx, *(() if add is None else (add,)), row=C)
    k("layernorm_bwd", {"VEC": vec})((max(-(-rows // per), 1),), (row_threads(C, vec),),
                                     (g, x, w, xp.ascontiguousarray(mean, dtype=acc),
                                      xp.ascontiguousarray(rstd, dtype=acc),
                                      g if add is None else add, gx, gw, gb, *lows,
                                      kept_zeros(xp, 1, np.uint32, "norm counter"),
                                      np.int64(rows), np.int32(C), np.int32(per),
                                      np.int32(finish), np.int32(add is not None)),
                                     shared_mem=shm)
    if finish:
        return gx, gw_into, gb_into
    return gx, summed(gw, gw_into, x.dtype), summed(gb, gb_into, x.dtype)


def _ln_cases(xp, rng, dt, backward=False):
    for shape in ((1, 1), (1, 7), (3, 5, 64), (2, 257), (4, 3, 768), (37, 96), (3, 6200)):
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
            add = xp.asarray(rng.standard_normal(shape).astype(dt))
            yield g, x, w, mean, rstd, None, None, None, add        # x's other gradient


LAYERNORM_FWD = Fused("layernorm_fwd", _LAYERNORM, ["layernorm_fwd"], _layernorm_launch,
                      layernorm_twin, lambda xp, rng, dt: _ln_cases(xp, rng, dt), compare=3,
                      cpu="cpu.layernorm")

def _residual_ln_cases(xp, rng, dt):
    for x, w, b, eps in _ln_cases(xp, rng, dt):
        C = x.shape[-1]
        bias = xp.asarray(rng.standard_normal(C).astype(dt))
        residual = xp.asarray(rng.standard_normal(x.shape).astype(dt))
        for given in ((bias, residual), (None, residual), (bias, None)):
            yield (x.copy(),) + given + (w, b, eps)


RESIDUAL_LAYERNORM = Fused("residual_layernorm_fwd", _LAYERNORM, ["residual_layernorm_fwd"],
                           _residual_layernorm_launch, residual_layernorm_twin,
                           _residual_ln_cases, compare=4, cpu="cpu.residual_layernorm")
LAYERNORM_BWD = Fused("layernorm_bwd", _LAYERNORM, ["layernorm_bwd"], _layernorm_bwd_launch,
                      layernorm_bwd_twin, lambda xp, rng, dt: _ln_cases(xp, rng, dt, True),
                      tolerance=1e-4,
                      cpu="cpu.layernorm_bwd")     # gw, gb: atomic sums in another order
