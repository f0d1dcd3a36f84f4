"""Recursive-doubling allreduce: log2(P) exchanges of the whole buffer. Latency-optimal.

For P not a power of two the first 2*rem ranks fold in pairs first (the even one hands its
data to the odd one and sits out), the pof2 survivors run recursive doubling, and the result is
folded back out — as MPICH does. Every rank ends with bitwise-identical values: each pairwise
step computes a+b on one side and b+a on the other, and IEEE addition is commutative.
"""
from __future__ import annotations

from .. import backend
from .layout import as_bytes, finish, fold_rank, reduce_into, unfold_rank

TAG = 102


def fold_in(comm, buf, op, tmp) -> int:
    """Phase 1 (non-powers of two): evens among the first 2*rem ranks send to their odd
    neighbour, which reduces. Returns this rank's new rank (-1: it sits out)."""
    P, r = comm.Get_size(), comm.Get_rank()
    pof2, new_rank = fold_rank(r, P)
    if r < 2 * (P - pof2):
        if r % 2 == 0:
            comm.Send(as_bytes(buf), r + 1, TAG)
        else:
            comm.Recv(as_bytes(tmp), r - 1, TAG)
            reduce_into(buf, tmp, op)
    return new_rank


def fold_out(comm, buf) -> None:
    """Last phase: the odd ranks of the folded pairs hand the result back to the evens."""
    P, r = comm.Get_size(), comm.Get_rank()
    pof2 = 1 << (P.bit_length() - 1)
    if r < 2 * (P - pof2):
        if r % 2:
            comm.Send(as_bytes(buf), r - 1, TAG + 1)
        else:
            comm.Recv(as_bytes(buf), r + 1, TAG + 1)


def allreduce_inplace(comm, buf, op: str) -> None:
    P = comm.Get_size()
    pof2 = 1 << (P.bit_length() - 1)
    tmp = backend.array_module(buf).empty_like(buf)
    new_rank = fold_in(comm, buf, op, tmp)
    if new_rank >= 0:
        mask = 1
        while mask < pof2:
            partner = unfold_rank(new_rank ^ mask, P)       # distance doubles every round
            comm.Sendrecv(as_bytes(buf), partner, TAG + 2, as_bytes(tmp), partner, TAG + 2)
            reduce_into(buf, tmp, op)
            mask <<= 1
    fold_out(comm, buf)
    finish(buf, op, P)
