"""Layout-free tensors: where a rank's piece of a tensor sits in the one logical model, and how
any layout cuts its own piece back out. Pure logic on NumPy arrays: no MPI.

A piece of logical tensor ``name`` (shape S) is described by its cut — None for a tensor
held whole, else (axis, blocks, tp, rank[, multiple]): the rank-th of tp parts of each of
``blocks`` blocks along ``axis``, the axis first rounded up to a multiple of blocks x tp x
multiple with zeros (a vocabulary padded for tensor parallelism and GEMM alignment) — and the
range [a, b) of the flattened local block it covers.

The rest of this design: docs/checkpoints.md, "hpcdist/checkpoint/reshard.py"."""
from __future__ import annotations

import numpy as np

from ..optim import intersect


def padded(length: int, blocks, tp: int, multiple: int = 1) -> int:
    """``length`` rounded up to a multiple of blocks x tp x multiple (``blocks``: a count of
    equal blocks, or the widths of unequal ones — grouped-query attention's q | k | v — which
    split over tp unpadded; ``multiple``: a vocabulary's alignment, ``Shard.multiple``)."""
    if not isinstance(blocks, int):
        return length
    unit = blocks * tp * multiple
    return -(-length // unit) * unit


def normal(cut):
    """A cut as a hashable tuple (a checkpoint's JSON holds unequal widths as a list):
    (axis, blocks, tp, rank), with a fifth element, the multiple, where it is not 1 (a
    padded vocabulary; a whole padded table is the cut (axis, 1, 1, 0, multiple))."""
    if cut is None:
        return None
    axis, blocks, tp, rank, multiple = _fields(cut)
    blocks = blocks if isinstance(blocks, int) else tuple(blocks)
    return (axis, blocks, tp, rank) + ((multiple,) if multiple != 1 else ())


def _fields(cut) -> tuple:
    return tuple(cut) if len(cut) == 5 else (*cut, 1)


def ranges(cut, logical_shape) -> list[tuple[int, int]]:
    """[lo, hi) along the cut axis, in padded logical coordinates, that the local block holds."""
    axis, blocks, tp, rank, multiple = _fields(cut)
    if not isinstance(blocks, int):
        out, at = [], 0
        for width in blocks:
            out.append((at + rank * (width // tp), at + (rank + 1) * (width // tp)))
            at += width
        return out
    block = padded(logical_shape[axis], blocks, tp, multiple) // blocks
    part = block // tp
    return [(j * block + rank * part, j * block + (rank + 1) * part) for j in range(blocks)]


def local_shape(cut, logical_shape) -> tuple:
    if cut is None:
        return tuple(logical_shape)
    axis, blocks, tp, _, multiple = _fields(cut)
    shape = list(logical_shape)
    shape[axis] = padded(logical_shape[axis], blocks, tp, multiple) // tp
    return tuple(shape)


def cut_local(full: np.ndarray, cut) -> np.ndarray:
    """This rank's local block of the logical tensor ``full`` (padding rows are zeros)."""
    if cut is None:
        return np.ascontiguousarray(full)
    axis, logical = cut[0], full.shape
    Lp = padded(logical[axis], cut[1], cut[2], _fields(cut)[4])
    if Lp != logical[axis]:
        pad = [(0, 0)] * full.ndim
        pad[axis] = (0, Lp - logical[axis])
        full = np.pad(full, pad)
    return np.ascontiguousarray(np.concatenate(
        [np.take(full, np.arange(lo, hi), axis=axis) for lo, hi in ranges(cut, logical)],
        axis=axis))


def assemble(logical_shape, dtype, pieces) -> np.ndarray:
    """The logical tensor from ``pieces`` = [(cut, (a, b), data)]; raises ValueError unless they
    cover every element."""
    logical_shape = tuple(logical_shape)
    blocks: dict = {}                           # cut -> (local block, filled mask)
    for cut, (a, b), data in pieces:
        key = normal(cut)
        if key not in blocks:
            shape = local_shape(key, logical_shape)
            blocks[key] = (np.zeros(int(np.prod(shape)), dtype=dtype),
                           np.zeros(int(np.prod(shape)), dtype=bool), shape)
        flat, filled, _ = blocks[key]
        flat[a:b] = np.asarray(data).reshape(-1)
        filled[a:b] = True
    if None in blocks:
        flat, filled, shape = blocks[None]
        if not filled.all():
            raise ValueError(f"pieces cover {int(filled.sum())} of {filled.size} elements")
        return flat.reshape(shape)
    axis, nblocks, tp, _, multiple = _fields(next(iter(blocks)))
    L = logical_shape[axis]
    shape = list(logical_shape)
    shape[axis] = padded(L, nblocks, tp, multiple)
    full = np.zeros(shape, dtype=dtype)
    seen = np.zeros(shape[axis], dtype=bool)
    for cut, (flat, filled, lshape) in blocks.items():
        if not filled.all():
            raise ValueError(f"tensor-parallel rank {cut[3]}'s block is incomplete "
                             f"({int(filled.sum())} of {filled.size} elements)")
        local = flat.reshape(lshape)
        o = 0
        for lo, hi in ranges(cut, logical_shape):
            idx = [slice(None)] * len(shape)
            idx[axis] = slice(lo, hi)
            src = [slice(None)] * len(shape)
            src[axis] = slice(o, o + hi - lo)
            full[tuple(idx)] = local[tuple(src)]
            seen[lo:hi] = True
            o += hi - lo
    if not seen.all():
        raise ValueError("pieces miss some tensor-parallel ranks' blocks")
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(0, L)
    return np.ascontiguousarray(full[tuple(idx)])


def flat_pieces(entries, lo: int, hi: int, array):
    """Split ``array`` (elements [lo, hi) of a flat buffer) into per-tensor pieces.

    ``entries`` = [(name, offset, size)] in flat order; yields (name, (a, b), data) where
    [a, b) is the range within that tensor's local block."""
    for name, off, size in entries:
        s, e = intersect(off, off + size, lo, hi)
        if s < e:
            yield name, (s - off, e - off), array[s - lo:e - lo]
