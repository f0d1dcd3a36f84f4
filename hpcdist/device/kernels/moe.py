"""Mixture-of-experts kernels, one CUDA block per row: the permutation that sorts each
token's k assignments by expert, and the combine that gates the experts' outputs and adds
them back per token (its inverse), forward and backward. No atomics: a token's k rows are
found through the inverse permutation, so every sum runs in slot order, the same bits on
every run.

    order (P,): assignment a = token x k + slot at sorted place p is order[p]
    inv (P,):   the sorted place of assignment a (order's inverse)
    permute:        xs[p] = x[order[p] / k]                      (gather)
    permute bwd:    gx[t] = sum_j gxs[inv[t k + j]]              (= combine with unit gates)
    combine:        y[t]  = sum_j w[inv[t k + j]] ys[inv[t k + j]]
    combine bwd:    gys[p] = g[order[p] / k] w[p],  gw[p] = <g[order[p] / k], ys[p]>
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _COMMON, _VECTOR, _rows, row_threads, vector_width

_MOE = _COMMON + _VECTOR + r"""
// one block per sorted row p: the row of the token it belongs to; VEC elements a thread at a
// time (C divides by VEC), the block as wide as the row's vectors (common.row_threads)
extern "C" __global__ void moe_permute(const T* x, const long long* order, T* xs,
                                       long long P, int C, int k) {
    long long p = blockIdx.x;
    if (p >= P) return;
    const T* src = x + (order[p] / k) * (long long)C;
    alignas(16) T v[VEC];
    for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
        copy_vec(v, src + c);
        copy_vec(xs + p * C + c, v);
    }
}
// one block per token t: its k rows (found through inv), each times its gate, added in slot
// order; gated == 0: gates of one (the permutation's backward; w is not read)
extern "C" __global__ void moe_combine(const T* ys, const T* w, int gated,
                                       const long long* inv, T* y, long long N, int C, int k) {
    long long t = blockIdx.x;
    if (t >= N) return;
    alignas(16) T v[VEC];
    for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
        A s[VEC];
        for (int q = 0; q < VEC; q++) s[q] = 0;
        for (int j = 0; j < k; ++j) {
            long long p = inv[t * k + j];
            A gate = gated ? (A)w[p] : (A)1;
            copy_vec(v, ys + p * C + c);
            for (int q = 0; q < VEC; q++) s[q] += (A)v[q] * gate;
        }
        for (int q = 0; q < VEC; q++) v[q] = (T)s[q];
        copy_vec(y + t * C + c, v);
    }
}
// one block per sorted row p: the gradient of its output (the token's, times its gate) and
// of its gate (the token's gradient dotted with the output)
extern "C" __global__ void moe_combine_bwd(const T* g, const T* ys, const T* w,
                                           const long long* order, T* gys, T* gw,
                                           long long P, int C, int k) {
    __shared__ A shared[32];
    long long p = blockIdx.x;
    if (p >= P) return;
    const T* gt = g + (order[p] / k) * (long long)C;
    A wp = (A)w[p], d = 0;
    alignas(16) T gv[VEC], yv[VEC], ov[VEC];
    for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
        copy_vec(gv, gt + c);
        copy_vec(yv, ys + p * C + c);
        for (int q = 0; q < VEC; q++) {
            A gc = (A)gv[q];
            ov[q] = (T)(gc * wp);
            d += gc * (A)yv[q];
        }
        copy_vec(gys + p * C + c, ov);
    }
    d = block_sum(d, shared);
    if (threadIdx.x == 0) gw[p] = (T)d;
}
"""


# ---- the twins: the definition ------------------------------------------------------------

def permute_twin(x, order, k: int):
    """(P, C): row p is token order[p] // k's."""
    return x[order // k]


def combine_twin(ys, w, inv, k: int):
    """(N, C): token t's k rows (places inv[t k + j]) times their gates, in slot order;
    ``w`` None: gates of one."""
    xp = backend.array_module(ys)
    N, C = inv.size // k, ys.shape[-1]
    rows = ys[inv].reshape(N, k, C)
    if w is not None:
        rows = rows * w[inv].reshape(N, k, 1)
    out = rows[:, 0].copy() if k else xp.zeros((N, C), dtype=ys.dtype)
    for j in range(1, k):                                  # slot order, as the kernel adds
        out += rows[:, j]
    return out


def combine_bwd_twin(g, ys, w, order, k: int):
    """(gys, gw) of ``combine``: each row's token gradient times its gate, and that gradient
    dotted with the row."""
    gt = g[order // k]
    return gt * w[:, None], (gt * ys).sum(axis=-1)


# ---- launchers ---------------------------------------------------------------------------

def _permute_launch(kernel, x, order, k):
    xp = backend.xp()
    P, C = int(order.size), int(x.shape[-1])
    xs = xp.empty((P, C), dtype=x.dtype)
    if P and C:
        x = xp.ascontiguousarray(x)
        vec = vector_width(x.size, x, xs, row=C)
        kernel("moe_permute", {"VEC": vec})((P,), (row_threads(C, vec),),
                                            (x, xp.ascontiguousarray(order, np.int64), xs,
                                             np.int64(P), np.int32(C), np.int32(k)))
    return xs


def _combine_launch(kernel, ys, w, inv, k):
    xp = backend.xp()
    N, C = int(inv.size // k), int(ys.shape[-1])
    y = xp.empty((N, C), dtype=ys.dtype)
    if N and C:
        ys = xp.ascontiguousarray(ys)
        vec = vector_width(ys.size, ys, y, row=C)
        kernel("moe_combine", {"VEC": vec})((N,), (row_threads(C, vec),),
                                            (ys, ys if w is None else xp.ascontiguousarray(w),
                                             np.int32(w is not None),
                                             xp.ascontiguousarray(inv, np.int64), y,
                                             np.int64(N), np.int32(C), np.int32(k)))
    return y


def _combine_bwd_launch(kernel, g, ys, w, order, k):
    xp = backend.xp()
    P, C = _rows(ys)
    ys = xp.ascontiguousarray(ys)
    gys, gw = xp.empty_like(ys), xp.empty(P, dtype=ys.dtype)
    if P:
        g = xp.ascontiguousarray(g)
        vec = vector_width(ys.size, g, ys, gys, row=C)
        kernel("moe_combine_bwd", {"VEC": vec})((P,), (row_threads(C, vec),),
                                                (g, ys, xp.ascontiguousarray(w),
                                                 xp.ascontiguousarray(order, np.int64), gys, gw,
                                                 np.int64(P), np.int32(C), np.int32(k)))
    return gys, gw


def _routing(xp, rng, N: int, k: int, E: int):
    """A random top-k routing of N tokens over E experts: (order, inv)."""
    chosen = np.argsort(rng.random((N, E)), axis=1)[:, :k].reshape(-1)
    order = np.argsort(chosen, kind="stable").astype(np.int64)
    return xp.asarray(order), xp.asarray(np.argsort(order).astype(np.int64))


def _cases(xp, rng, dt, which: str):
    # one token, one column, k = 1 and k = E, widths over a block of threads, a big batch
    for N, C, k, E in ((1, 1, 1, 1), (1, 7, 2, 4), (5, 64, 2, 8), (33, 257, 3, 4),
                       (16, 768, 4, 4), (512, 96, 2, 16)):
        order, inv = _routing(xp, rng, N, k, E)
        P = N * k
        if which == "permute":
            yield xp.asarray(rng.standard_normal((N, C)).astype(dt)), order, k
            continue
        ys = xp.asarray(rng.standard_normal((P, C)).astype(dt))
        w = xp.asarray(rng.random(P).astype(dt))
        if which == "combine":
            yield ys, w, inv, k
            yield ys, None, inv, k                               # the permutation's backward
        else:
            yield xp.asarray(rng.standard_normal((N, C)).astype(dt)), ys, w, order, k


MOE_PERMUTE = Fused("moe_permute", _MOE, ["moe_permute"], _permute_launch, permute_twin,
                    lambda xp, rng, dt: _cases(xp, rng, dt, "permute"), tolerance=0.0,
                    cpu="cpu_moe.moe_permute")
MOE_COMBINE = Fused("moe_combine", _MOE, ["moe_combine"], _combine_launch, combine_twin,
                    lambda xp, rng, dt: _cases(xp, rng, dt, "combine"), tolerance=1e-6,
                    cpu="cpu_moe.moe_combine")
MOE_COMBINE_BWD = Fused("moe_combine_bwd", _MOE, ["moe_combine_bwd"], _combine_bwd_launch,
                        combine_bwd_twin, lambda xp, rng, dt: _cases(xp, rng, dt, "bwd"),
                        tolerance=1e-5,
                        cpu="cpu_moe.moe_combine_bwd")   # gw: a block's sum, NumPy's order
