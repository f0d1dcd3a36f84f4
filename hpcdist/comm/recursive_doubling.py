"""Recursive-doubling allreduce: log2(P) exchanges of the whole buffer. Latency-optimal.

For P not a power of two the first 2*rem ranks fold in pairs first (the even one hands its
data to the odd one and sits out), the pof2 survivors run recursive doubling, and the result is
folded back out — as MPICH does. Every rank ends with bitwise-identical values: each pairwise
step computes a+b on one side and b+a on the other, and IEEE addition is commutative.
"""
from __future__ import annotations

from ..device import backend
from .arith import as_bytes, finish, fold_rank, reduce_into, unfold_rank
from .algorithm import ALWAYS, Algorithm, fold_time, rounds

TAG = 102


def fold_in(wire, buf, op, tmp) -> int:
    """Phase 1 (non-powers of two): evens among the first 2*rem ranks send to their odd
    neighbour, which reduces. Returns this rank's new rank (-1: it sits out)."""
    P, r = wire.Get_size(), wire.Get_rank()
    pof2, new_rank = fold_rank(r, P)
    if r < 2 * (P - pof2):
        if r % 2 == 0:
            wire.Send(as_bytes(buf), r + 1, TAG)
        else:
            wire.Recv(as_bytes(tmp), r - 1, TAG)
            reduce_into(buf, tmp, op)
    return new_rank


def fold_out(wire, buf) -> None:
    """Last phase: the odd ranks of the folded pairs hand the result back to the evens."""
    P, r = wire.Get_size(), wire.Get_rank()
    pof2 = 1 << (P.bit_length() - 1)
    if r < 2 * (P - pof2):
        if r % 2:
            wire.Send(as_bytes(buf), r - 1, TAG + 1)
        else:
            wire.Recv(as_bytes(buf), r + 1, TAG + 1)


def allreduce_inplace(wire, buf, op: str) -> None:
    P = wire.Get_size()
    pof2 = 1 << (P.bit_length() - 1)
    tmp = backend.array_module(buf).empty_like(buf)
    new_rank = fold_in(wire, buf, op, tmp)
    if new_rank >= 0:
        mask = 1
        while mask < pof2:
            partner = unfold_rank(new_rank ^ mask, P)       # distance doubles every round
            wire.Sendrecv(as_bytes(buf), partner, TAG + 2, as_bytes(tmp), partner, TAG + 2)
            reduce_into(buf, tmp, op)
            mask <<= 1
    fold_out(wire, buf)
    finish(buf, op, P)


# Thresholds measured on the 2-core development machine with
#   mpiexec -n N python -m hpcdist.bench collectives      (N = 2, 4, 8; docs/communication.md)
# Recursive doubling sends the whole buffer log2(P) times but in the fewest rounds; it wins
# below ALLREDUCE_SMALL_BYTES. Rabenseifner sends 2(P-1)/P of it in 2 log2(P) rounds; the
# ring sends the same bytes in 2(P-1) rounds, each rank talking only to its neighbours.
#
# allreduce, microseconds per call by algorithm (``--algorithms``), float32, 2-core machine:
#   bytes      N=2: RD / Rab / ring      N=4: RD / Rab / ring      N=8: RD / Rab / ring
#   32 KiB       44 /  132 /  215          155 /  214 /  260          882 / 1075 / 1437
#   128 KiB     150 /  344 /  129          223 /  267 /  306         1502 / 1354 / 2150
#   512 KiB     867 /  907 /  742          382 /  377 /  412         6255 / 3001 / 3961
#   2 MiB      1804 / 1600 / 1630          841 /  641 /  736        14089 / 7836 / 3443
#   8 MiB      3563 / 5532 / 2916         6183 / 3728 / 3502        24732 / 12069 / 8352
# Recursive doubling wins up to 64 KiB everywhere; the ring wins from 2 MiB (clearly at N=8,
# by 0-20% at N=2 and 4); Rabenseifner in between (at N=2 it is the ring's schedule).
ALLREDUCE_SMALL_BYTES = 64 << 10


def wire_bytes(kind, n, P, itemsize):
    """The fold (beyond a power of two), then the whole buffer once per round."""
    pof2, steps = rounds(P)
    return (n * itemsize if pof2 != P else 0) + steps * n * itemsize


def cost(kind, nbytes, P, a, b):
    return fold_time(nbytes, P, a, b) + rounds(P)[1] * (a + nbytes * b)


RECURSIVE_DOUBLING = Algorithm(
    "recursive_doubling", kinds=("allreduce",), runs={"allreduce": allreduce_inplace},
    auto=lambda kind, nbytes, world: nbytes <= ALLREDUCE_SMALL_BYTES,
    rides_short={"allreduce": ALWAYS}, wire_bytes=wire_bytes, cost=cost)
