"""Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling
allgather. Sends 2(P-1)/P of the buffer like the ring, but in 2*log2(P) steps instead of
2(P-1): the ring's bandwidth with far fewer latencies, for mid-sized and large messages.

The buffer is cut into pof2 pieces by the shard rule. Halving: at distance pof2/2, pof2/4,
.., 1 each rank keeps the half of its current piece range on its side of the partner and
sends the other half; after log2(pof2) steps new rank i holds reduced piece i. Doubling
reverses it. Non-powers of two fold in and out as in recursive doubling.
"""
from __future__ import annotations

from ..device import backend
from .arith import as_bytes, finish, reduce_into, shard_bounds, unfold_rank
from .recursive_doubling import fold_in, fold_out
from .algorithm import Algorithm, fold_time, rounds
from .recursive_doubling import ALLREDUCE_SMALL_BYTES
from .ring import ALLREDUCE_RING_BYTES

TAG = 103


def allreduce_inplace(wire, buf, op: str) -> None:
    P = wire.Get_size()
    pof2 = 1 << (P.bit_length() - 1)
    L = buf.size
    tmp = backend.array_module(buf).empty_like(buf)
    new_rank = fold_in(wire, buf, op, tmp)
    if new_rank >= 0:
        bounds = [shard_bounds(L, pof2, c) for c in range(pof2)]

        def elems(first, last):        # element range of pieces [first, last)
            return bounds[first][0], bounds[last - 1][1]

        # Phase 2: recursive-halving reduce-scatter.
        lo, hi = 0, pof2
        mask = pof2 >> 1
        while mask > 0:
            partner = unfold_rank(new_rank ^ mask, P)
            mid = (lo + hi) // 2
            keep, send = ((mid, hi), (lo, mid)) if new_rank & mask else ((lo, mid), (mid, hi))
            (s0, s1), (k0, k1) = elems(*send), elems(*keep)
            part = tmp[:k1 - k0]
            wire.Sendrecv(as_bytes(buf[s0:s1]), partner, TAG, as_bytes(part), partner, TAG)
            reduce_into(buf[k0:k1], part, op)
            lo, hi = keep
            mask >>= 1
        a, b = elems(lo, hi)                                # == piece new_rank
        finish(buf[a:b], op, P)

        # Phase 3: recursive-doubling allgather, the halving in reverse.
        mask = 1
        while mask < pof2:
            partner = unfold_rank(new_rank ^ mask, P)
            other = (lo - mask, lo) if new_rank & mask else (hi, hi + mask)
            (m0, m1), (o0, o1) = elems(lo, hi), elems(*other)
            wire.Sendrecv(as_bytes(buf[m0:m1]), partner, TAG + 1,
                          as_bytes(buf[o0:o1]), partner, TAG + 1)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    fold_out(wire, buf)        # folded-out ranks receive the finished result here


def _wire_bytes(kind, n, P, itemsize):
    pof2, _ = rounds(P)
    fold = n * itemsize if pof2 != P else 0
    return fold + 2 * (pof2 - 1) * -(-n // pof2) * itemsize


def _cost(kind, nbytes, P, a, b):
    pof2, steps = rounds(P)
    return fold_time(nbytes, P, a, b) + 2 * steps * a + 2 * (pof2 - 1) / pof2 * nbytes * b


RABENSEIFNER = Algorithm(
    "rabenseifner", kinds=("allreduce",), runs={"allreduce": allreduce_inplace},
    auto=lambda kind, nbytes, world: ALLREDUCE_SMALL_BYTES < nbytes < ALLREDUCE_RING_BYTES,
    wire_bytes=_wire_bytes, cost=_cost)
