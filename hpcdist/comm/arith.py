"""The arithmetic every collective shares, and ZeRO: the shard rule, reduction ops, rank maps.

The shard rule, used everywhere in hpcdist: a length-L array over P ranks gives rank r the
elements ``[r*S, min((r+1)*S, L))`` with ``S = ceil(L/P)`` — empty where that range is empty.
So every shard but the last non-empty one has exactly S elements, and padding L up to P*S
makes all shards equal (what ZeRO stores). Ring algorithms cut their chunks the same way.
"""
from __future__ import annotations

import numpy as np

from ..device import backend

OPS = ("sum", "avg", "max", "min")


def shard_size(length: int, world: int) -> int:
    """S = ceil(L/P), the size of a full shard (0 for an empty array)."""
    return -(-length // world)


def shard_bounds(length: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's shard of a length-``length`` array."""
    s = shard_size(length, world)
    lo = min(rank * s, length)
    return lo, min(lo + s, length)


def shard_counts(length: int, world: int) -> list[int]:
    """Number of elements in each rank's shard."""
    return [hi - lo for lo, hi in (shard_bounds(length, world, r) for r in range(world))]


def bounds_of(counts) -> list[tuple[int, int]]:
    """[lo, hi) of consecutive pieces of the given sizes: [(0, c0), (c0, c0 + c1), ...]."""
    out, off = [], 0
    for c in counts:
        out.append((off, off + int(c)))
        off += int(c)
    return out


def padded_length(length: int, world: int) -> int:
    """L rounded up to a multiple of P: the flat size ZeRO stores, padding included."""
    return shard_size(length, world) * world


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return op


_UFUNCS = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum"}
_NUMPY_UFUNCS = {op: getattr(np, name) for op, name in _UFUNCS.items()}   # the hot case


def reduce_ufunc(op: str, xp=np):
    """The elementwise ufunc of an op in module ``xp`` ("avg" sums; ``finish`` divides)."""
    return _NUMPY_UFUNCS[op] if xp is np else getattr(xp, _UFUNCS[op])


def reduce_into(acc, incoming, op: str) -> None:
    """acc <- acc (op) incoming, elementwise in place. "avg" sums; ``finish`` divides."""
    reduce_ufunc(op, backend.array_module(acc))(acc, incoming, out=acc)


def finish(buf, op: str, world: int) -> None:
    """Apply the last step of an op after the sum: avg divides by the world size.

    Integer averages round toward negative infinity (floor division), as numpy's ``//``.
    """
    if op == "avg" and world > 1:
        if buf.dtype.kind in "iu":
            buf //= world
        else:
            buf /= world


def ring_peers(rank: int, world: int) -> tuple[int, int]:
    """(left, right) neighbours on the ring: data flows from left to rank to right."""
    return (rank - 1) % world, (rank + 1) % world


def fold_rank(rank: int, world: int) -> tuple[int, int]:
    """Non-power-of-two folding (MPICH): the first 2*rem ranks pair up, evens drop out.

    Returns (pof2, new_rank) where new_rank is -1 for a rank that sits out the
    power-of-two phase, else its rank among the pof2 participants.
    """
    pof2 = 1 << (world.bit_length() - 1)
    rem = world - pof2
    if rank < 2 * rem:
        return pof2, (rank // 2 if rank % 2 else -1)
    return pof2, rank - rem


def unfold_rank(new_rank: int, world: int) -> int:
    """Inverse of ``fold_rank``: the real rank of power-of-two participant ``new_rank``."""
    pof2 = 1 << (world.bit_length() - 1)
    rem = world - pof2
    return new_rank * 2 + 1 if new_rank < rem else new_rank + rem


def binomial_children(vrank: int, world: int) -> list[int]:
    """Relative ranks that ``vrank`` sends to in a binomial tree rooted at 0, in send order."""
    mask = 1
    while mask < world and not vrank & mask:
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < world:
            children.append(vrank + mask)
        mask >>= 1
    return children


def binomial_parent(vrank: int) -> int:
    """Relative rank that ``vrank`` receives from (-1 for the root)."""
    if vrank == 0:
        return -1
    return vrank & (vrank - 1)   # clear the lowest set bit


def as_bytes(arr):
    """A uint8 view of a contiguous array (what crosses MPI: any dtype, fp16 and bf16 too)."""
    return arr.reshape(-1).view(np.uint8)      # numpy and cupy both take numpy's dtype
