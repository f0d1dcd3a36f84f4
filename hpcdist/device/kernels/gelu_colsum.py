"""The MLP's GELU backward and its bias's gradient in one pass, beside the twin that runs them
apart: ``gh = g * gelu'(h)`` written, and ``out += gh.sum(axis=0)`` — the up projection's bias
gradient added straight into its buffer — from the same registers (one launch where
GELU_BWD and COLSUM_ADD took two, and gh read once fewer). The grid and the sums' order are
colsum.py's: a 2-D grid of column groups and row chunks, each chunk's sums added in chunk
order by the chunk that finishes last (the same bits every run, no atomics)."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .colsum import COLSUM_STORE, chunks, colsum_add_twin
from .common import _FINISH, _VECTOR, _rows, accumulator, kept_zeros, vector_width
from .elementwise import GELU_GRAD, gelu_bwd_twin

_GELU_COLSUM = _VECTOR + _FINISH + COLSUM_STORE + GELU_GRAD + r"""
// thread (x, y) of a 32 x 8 block: rows y, y + 8, ... of its chunk, VEC columns from c0;
// gh = g * gelu'(h) stored and summed, then colsum_store (colsum.py)
extern "C" __global__ void gelu_bwd_colsum(const T* h, const T* g, T* gh, T* out, A* part,
                                           unsigned* done, long long rows, int C) {
    __shared__ A acc[8][32 * VEC + 1];
    int c0 = (blockIdx.x * 32 + threadIdx.x) * VEC;   // (C divides by VEC)
    long long per = (rows + gridDim.y - 1) / gridDim.y;
    long long r0 = blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
    alignas(16) T hv[VEC], gv[VEC], ov[VEC];
    A s[VEC];
    for (int j = 0; j < VEC; j++) s[j] = 0;
    if (c0 < C)
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            copy_vec(hv, h + r * C + c0);
            copy_vec(gv, g + r * C + c0);
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                ov[j] = (T)((A)gv[j] * gelu_grad_of((A)hv[j]));
                s[j] += (A)ov[j];                       // (the stored value, as the twin sums)
            }
            copy_vec(gh + r * C + c0, ov);
        }
    colsum_store(s, acc, out, part, done, C, c0);
}
"""


def gelu_bwd_colsum_twin(h, g, t, out):
    """(gh = g * gelu'(h), with ``out += gh.sum(axis=0)`` done) for h, g (..., C); ``t``: the
    forward's tanh where it kept one."""
    gh = gelu_bwd_twin(h, g, t)
    colsum_add_twin(gh.reshape(-1, gh.shape[-1]), out)
    return gh


def _launch(k, h, g, t, out):
    xp = backend.xp()
    rows, C = _rows(h)
    h, g = xp.ascontiguousarray(h), xp.ascontiguousarray(g, dtype=h.dtype)
    gh = xp.empty_like(h)
    vec = vector_width(h.size, h, g, gh, out, row=C)
    groups = max(1, -(-C // (32 * vec)))
    ys = chunks(rows, groups)
    part = xp.empty(ys * C if ys > 1 else 1, dtype=accumulator(h.dtype))
    done = kept_zeros(xp, groups, np.uint32, "colsum counters")   # (zero between calls)
    k("gelu_bwd_colsum", {"VEC": vec})((groups, ys), (32, 8),
                                       (h, g, gh, out, part, done, np.int64(rows), np.int32(C)))
    return gh


def _cases(xp, rng, dt):
    for rows, C in ((1, 1), (3, 7), (1000, 65), (4096, 768), (300, 3072)):
        h, g = (xp.asarray((rng.standard_normal((rows, C)) * 3).astype(dt)) for _ in range(2))
        yield h, g, None, xp.asarray(rng.standard_normal(C).astype(dt))
    h, g = (xp.asarray(rng.standard_normal((2, 5, 96)).astype(dt)) for _ in range(2))
    yield h, g, None, xp.zeros(96, dtype=dt)                        # (B, T, C) rows


GELU_BWD_COLSUM = Fused("gelu_bwd_colsum", _GELU_COLSUM, ["gelu_bwd_colsum"], _launch,
                        gelu_bwd_colsum_twin, _cases, tolerance=1e-5,
                        cpu="cpu.gelu_bwd_colsum")
