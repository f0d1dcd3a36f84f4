"""Sparse Top-K exchange: each rank keeps its k largest-magnitude entries, the (index, value)
pairs of all ranks travel through a ring allgatherv, and duplicates are summed into a dense
result. Moves (P-1) * k * (index + value bytes) per rank, against 2(P-1)/P * n * value bytes
for the dense ring: sparse wins while k/n < 2s / (P (4 + s)) — for fp32 values, k/n < 1/P.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device import backend
from . import ring
from .arith import as_bytes
from .algorithm import Algorithm


@dataclass
class SparseStats:
    """What the last sparse_allreduce did (bytes are what this rank sent)."""
    n: int = 0
    k: int = 0
    sparse_bytes: int = 0   # bytes the sparse exchange sends (or would send)
    dense_bytes: int = 0    # bytes a dense ring allreduce sends (or would send)
    bytes_sent: int = 0     # what was actually sent
    fell_back: bool = False  # True when dense was cheaper and was used instead


def choose_k(n: int, density: float | None, k: int | None) -> int:
    if (density is None) == (k is None):
        raise ValueError("pass exactly one of density= or k=")
    if k is None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        k = int(round(density * n))
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    return min(max(k, 1 if n else 0), n)


def top_k(flat, k: int):
    """(indices, values) of the k largest |flat| entries, in no particular order.

    NumPy: argpartition, O(n). CuPy's argpartition sorts the whole array (O(n log n)); at
    the densities used here it is still one kernel launch.
    """
    xp = backend.array_module(flat)
    n = flat.size
    if k >= n:
        idx = xp.arange(n, dtype=np.int64)
    else:
        idx = xp.argpartition(xp.abs(flat), n - k)[n - k:].astype(np.int64)
    return idx, flat[idx]


def wire_bytes(n: int, k: int, itemsize: int, world: int) -> tuple[int, int]:
    """(sparse, dense) bytes one rank sends: ring allgather of k (int32 index + value) pairs
    vs the ring allreduce of n values."""
    sparse = (world - 1) * k * (4 + itemsize)
    dense = 2 * (world - 1) * -(-n // world) * itemsize
    return sparse, dense


def exchange(wire, idx, vals, n: int):
    """Ring allgather of every rank's k (int32 index, value) pairs; dense sum of them."""
    P, r = wire.Get_size(), wire.Get_rank()
    xp = backend.array_module(vals)
    k, itemsize = idx.size, vals.dtype.itemsize
    rec = 4 + itemsize                                    # bytes per pair on the wire
    packed = xp.empty(P * k * rec, dtype=xp.uint8)        # piece i: rank i's pairs
    mine = packed[r * k * rec:(r + 1) * k * rec]
    mine[:k * 4] = as_bytes(idx.astype(np.int32))
    mine[k * 4:] = as_bytes(vals)
    ring.allgather_inplace(wire, packed, [(i * k * rec, (i + 1) * k * rec) for i in range(P)])
    pieces = packed.reshape(P, k * rec)
    all_idx = pieces[:, :k * 4].copy().view(np.int32).reshape(-1)
    all_vals = pieces[:, k * 4:].copy().view(vals.dtype).reshape(-1)
    dense = xp.zeros(n, dtype=vals.dtype)
    backend.scatter_add(dense, all_idx, all_vals)         # duplicates add up
    return dense


TOPK_ALLGATHERV = Algorithm(
    "topk-allgatherv", kinds=("sparse_allreduce",),
    auto=lambda kind, nbytes, world: True,
    cost=lambda kind, nbytes, P, a, b: (P - 1) * a + (P - 1) / P * nbytes * b)
