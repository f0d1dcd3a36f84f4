"""A bias's gradient added into its buffer, ``out += g.sum(axis=0)``, in one kernel beside its
NumPy twin: the rows split over a 2-D grid so that every SM has work, the chunks' sums added
in a fixed order by the chunk that finishes last (the same bits every run, no atomics on
``out``), 16 bytes a thread where the arrays allow (common.py's vectors)."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _FINISH, _VECTOR, _rows, accumulator, kept_zeros, vector_width

# the block's column sums — thread (x, y)'s ``s`` over its VEC columns from c0, for rows y,
# y + 8, ... of its chunk — added into out: thread (x, 0) adds the 8 partial sums in order. One
# chunk: into out directly. Several: into part[chunk][c], then the block that finishes its
# column group last (a counter per group, after a fence) adds the chunks' sums in chunk order
# into out and zeroes the counter for the next call (gelu_colsum.py shares it)
COLSUM_STORE = r"""
// out[c0 + j] += t[j] for the VEC columns, 16 bytes at a time
__device__ __forceinline__ void colsum_into(T* out, const A* t, int c0) {
    alignas(16) T o[VEC];
    copy_vec(o, out + c0);
#pragma unroll
    for (int j = 0; j < VEC; j++) o[j] = (T)((A)o[j] + t[j]);
    copy_vec(out + c0, o);
}
__device__ __forceinline__ void colsum_store(const A* s, A (*acc)[32 * VEC + 1], T* out,
                                             A* part, unsigned* done, int C, int c0) {
    A t[VEC];
    for (int j = 0; j < VEC; j++) acc[threadIdx.y][threadIdx.x * VEC + j] = s[j];
    __syncthreads();
    if (threadIdx.y == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            t[j] = 0;
            for (int y = 0; y < 8; y++) t[j] += acc[y][threadIdx.x * VEC + j];
        }
        if (gridDim.y == 1) colsum_into(out, t, c0);
        else
            for (int j = 0; j < VEC; j++) part[blockIdx.y * C + c0 + j] = t[j];
    }
    if (gridDim.y == 1 || !last_to_arrive(done + blockIdx.x, gridDim.y)) return;
    if (threadIdx.y == 0 && c0 < C) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            t[j] = 0;
            for (unsigned k = 0; k < gridDim.y; k++) t[j] += read_l2(part + k * C + c0 + j);
        }
        colsum_into(out, t, c0);
    }
    if (threadIdx.x == 0 && threadIdx.y == 0) done[blockIdx.x] = 0;
}
"""

_COLSUM = _VECTOR + _FINISH + COLSUM_STORE + r"""
// out[c] += sum over rows of g[r, c]. blockIdx.x: a group of 32 VEC columns; blockIdx.y: a
// chunk of the rows. Thread (x, y) of a 32 x 8 block sums rows y, y + 8, ... of its chunk over
// its VEC columns (a warp reads 32 x 16 contiguous bytes of a row), then colsum_store. (One
// block per 32 columns over every row left most of an H200 idle: 20 us a call at GPT-2
// medium, 400 us before that at one thread a column.)
extern "C" __global__ void colsum_add(const T* g, T* out, A* part, unsigned* done,
                                      long long rows, int C) {
    __shared__ A acc[8][32 * VEC + 1];
    int c0 = (blockIdx.x * 32 + threadIdx.x) * VEC;   // (C divides by VEC)
    long long per = (rows + gridDim.y - 1) / gridDim.y;
    long long r0 = blockIdx.y * per, r1 = r0 + per < rows ? r0 + per : rows;
    alignas(16) T gv[VEC];
    A s[VEC];
    for (int j = 0; j < VEC; j++) s[j] = 0;
    if (c0 < C)
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            copy_vec(gv, g + r * C + c0);
            for (int j = 0; j < VEC; j++) s[j] += (A)gv[j];
        }
    colsum_store(s, acc, out, part, done, C, c0);
}
"""

BLOCKS_WANTED = 256          # about two blocks an SM of an H100/H200
MIN_ROWS = 64                # a chunk's rows at least (fewer: the chunks' sums cost more)


def colsum_add_twin(g, out):
    """``out += g.sum(axis=0)`` for g (N, C); returns out (2-byte floats summed in float32,
    as the kernel does)."""
    out += g.sum(axis=0, dtype=np.float32) if g.dtype.itemsize == 2 else g.sum(axis=0)
    return out


def chunks(rows: int, groups: int) -> int:
    """Chunks of the rows: about BLOCKS_WANTED blocks in all, MIN_ROWS rows a chunk at least."""
    return max(1, min(-(-BLOCKS_WANTED // groups), rows // MIN_ROWS))


def _colsum_launch(k, g, out):
    xp = backend.xp()
    rows, C = _rows(g)
    g = xp.ascontiguousarray(g)
    vec = vector_width(g.size, g, out, row=C)
    groups = max(1, -(-C // (32 * vec)))
    ys = chunks(rows, groups)
    part = xp.empty(ys * C if ys > 1 else 1, dtype=accumulator(g.dtype))
    done = kept_zeros(xp, groups, np.uint32, "colsum counters")   # (zero between calls)
    k("colsum_add", {"VEC": vec})((groups, ys), (32, 8),
                                  (g, out, part, done, np.int64(rows), np.int32(C)))
    return out


def _colsum_cases(xp, rng, dt):
    for rows, C in ((1, 1), (3, 7), (1000, 65), (4096, 768), (700, 96), (300, 4096)):
        yield (xp.asarray(rng.standard_normal((rows, C)).astype(dt)),
               xp.asarray(rng.standard_normal(C).astype(dt)))


COLSUM_ADD = Fused("colsum_add", _COLSUM, ["colsum_add"], _colsum_launch, colsum_add_twin,
                   _colsum_cases, tolerance=1e-5,
                   cpu="cpu.colsum_add")
