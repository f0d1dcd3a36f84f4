"""Binomial-tree broadcast and reduce, the scatter + allgather broadcast, and a barrier.

Ranks are renumbered relative to the root (``vrank = (rank - root) % P``) so the tree is
always rooted at 0: vrank v receives from v minus its lowest set bit and sends to v + 2^k
for every 2^k below that bit (arith.binomial_parent / binomial_children).
"""
from __future__ import annotations

from ..device import backend
from . import ring
from .algorithm import WHEN_AUTO, Algorithm, log2_ceil
from .arith import (as_bytes, binomial_children, binomial_parent, finish, reduce_into,
                     shard_bounds)

TAG = 104


def _real(vrank: int, root: int, P: int) -> int:
    return (vrank + root) % P


def bcast_binomial(wire, buf, root: int) -> None:
    """log2(P) rounds of whole-buffer sends down the tree: best for small messages."""
    P, r = wire.Get_size(), wire.Get_rank()
    v = (r - root) % P
    if v:
        wire.Recv(as_bytes(buf), _real(binomial_parent(v), root, P), TAG)
    for child in binomial_children(v, P):
        wire.Send(as_bytes(buf), _real(child, root, P), TAG)


def reduce_binomial(wire, buf, root: int, op: str) -> None:
    """Reduce up the tree into ``buf`` on the root (elsewhere ``buf`` becomes scratch)."""
    P, r = wire.Get_size(), wire.Get_rank()
    v = (r - root) % P
    tmp = backend.array_module(buf).empty_like(buf)
    # Children send in reverse order of the broadcast: the smallest subtree finishes first.
    for child in reversed(binomial_children(v, P)):
        wire.Recv(as_bytes(tmp), _real(child, root, P), TAG + 1)
        reduce_into(buf, tmp, op)
    if v:
        wire.Send(as_bytes(buf), _real(binomial_parent(v), root, P), TAG + 1)
    else:
        finish(buf, op, P)


def bcast_scatter_allgather(wire, buf, root: int) -> None:
    """Van de Geijn's broadcast for large messages: binomial scatter of P pieces, then ring
    allgather. Moves about 2x the buffer per rank instead of log2(P)x."""
    P, r = wire.Get_size(), wire.Get_rank()
    v = (r - root) % P
    bounds = [shard_bounds(buf.size, P, c) for c in range(P)]   # piece c belongs to vrank c

    def span(first, count):            # elements of pieces [first, first+count), clipped
        last = min(first + count, P)
        return bounds[first][0], bounds[last - 1][1]

    # Phase 1: binomial scatter. The subtree under vrank v covers pieces [v, v + lowbit(v)).
    if v:
        lo, hi = span(v, v & -v)
        wire.Recv(as_bytes(buf[lo:hi]), _real(binomial_parent(v), root, P), TAG + 2)
    for child in binomial_children(v, P):
        lo, hi = span(child, child & -child)
        wire.Send(as_bytes(buf[lo:hi]), _real(child, root, P), TAG + 2)
    # Phase 2: ring allgather in root-relative order.
    ring.allgather_inplace(wire, buf, bounds, pos=v,
                           left=_real(v - 1, root, P), right=_real(v + 1, root, P))


def barrier(wire) -> None:
    """Dissemination barrier: ceil(log2 P) rounds of empty messages at distance 1, 2, 4, .."""
    P, r = wire.Get_size(), wire.Get_rank()
    empty = bytearray(0)
    dist = 1
    while dist < P:
        wire.Sendrecv(empty, (r + dist) % P, TAG + 3, bytearray(0), (r - dist) % P, TAG + 3)
        dist <<= 1


# bcast, microseconds by algorithm (``bench collectives --algorithms``), binomial / scatter +
# ring allgather:
#   bytes         N=4              N=8
#   512 KiB     635 /   742     1636 /  1999
#   2 MiB      2143 /  2248     5123 /  4371
#   8 MiB      4800 /  5612    10124 /  9201
#   32 MiB    14624 / 10294    33129 / 23200
# Scatter-allgather moves ~2x the buffer per rank instead of log2(P)x, but in log2(P) + P-1
# steps: it pays off later at small P. Binomial below 16 MiB under 8 ranks (wins at 8 MiB,
# loses at 32 MiB at N=4), below 2 MiB from 8 ranks (wins at 512 KiB, loses at 2 MiB at N=8).
BCAST_SMALL_BYTES = 16 << 20
BCAST_SMALL_BYTES_MANY = 2 << 20     # from BCAST_MANY_RANKS ranks up
BCAST_MANY_RANKS = 8


def _binomial_wins(kind, nbytes, world):
    if kind == "reduce":
        return True
    small = BCAST_SMALL_BYTES_MANY if world >= BCAST_MANY_RANKS else BCAST_SMALL_BYTES
    return nbytes < small or world <= 2


BINOMIAL = Algorithm(
    "binomial", kinds=("bcast", "reduce"),
    runs={"bcast": bcast_binomial, "reduce": reduce_binomial},
    auto=_binomial_wins, rides_short={"bcast": WHEN_AUTO},
    cost=lambda kind, nbytes, P, a, b: log2_ceil(P) * (a + nbytes * b))
SCATTER_ALLGATHER = Algorithm(
    "scatter_allgather", kinds=("bcast",), runs={"bcast": bcast_scatter_allgather},
    auto=lambda kind, nbytes, world: not _binomial_wins(kind, nbytes, world),
    rides_short={"bcast": WHEN_AUTO},
    cost=lambda kind, nbytes, P, a, b: (log2_ceil(P) + P - 1) * a
    + 2 * (P - 1) / P * nbytes * b)
