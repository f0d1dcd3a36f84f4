"""All-to-all: rank r's piece j goes to rank j; every rank ends with a piece from every rank,
in rank order. Pieces may differ in size and be empty (the v-form: ``counts``). A rank holds
N bytes; a message of n bytes costs alpha + n beta:

    pairwise  P - 1 rounds, round k to r + k and from r - k:  (P-1) alpha + (P-1)/P N beta
    bruck     ceil(log2 P) rounds (Bruck et al. 1997): slot i holds the piece for r + i; round
              k sends the slots with bit k set to r + 2^k:       log2 P (alpha + N/2 beta)

Bruck's sends fewer messages and more bytes, so it wins for short pieces; "auto" compares the
two on the default intra-node link. The v-form runs pairwise unless named (its sizes differ by
rank, and every rank must choose alike); Bruck's unequal pieces carry a header of sizes."""
from __future__ import annotations

import numpy as np

from ..device import backend
from .algorithm import DEFAULT_LINKS, Algorithm, log2_ceil
from .arith import as_bytes

TAG = 110                       # pairwise 110; Bruck's headers 111, its data 112


def offsets(counts) -> list[int]:
    """[0, c0, c0 + c1, ...]: where each piece starts, and the end."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def pieces_of(buf, counts, P: int):
    """(one flat array, counts) of an all-to-all's input: a list of P arrays is joined (their
    sizes are the counts, None where all are equal)."""
    if not isinstance(buf, (list, tuple)):
        return buf, counts
    if len(buf) != P or counts is not None:
        raise ValueError(f"alltoall takes a list of {P} arrays (one per rank) and no counts, "
                         f"got {len(buf)} arrays" + (" and counts" if counts is not None else ""))
    sizes = [int(p.size) for p in buf]
    flat = backend.array_module(buf[0]).concatenate([p.reshape(-1) for p in buf])
    return flat, None if len(set(sizes)) == 1 else sizes


def unequal_problem(n: int, counts, P: int) -> str | None:
    """Why ``n`` elements without counts are not P equal pieces (None: they are)."""
    if counts is None and n % P:
        return f"buf of {n} elements does not split into {P} equal pieces: give counts " \
               "(the v-form)"
    return None


def split(out, counts) -> list:
    """``out`` as the pieces of the given sizes (views), in rank order."""
    o = offsets(counts)
    return [out[o[r]:o[r + 1]] for r in range(len(counts))]


def pairwise(wire, send, send_counts, out, recv_counts, uniform: bool = True) -> None:
    """``out`` (the pieces from every rank, in rank order) from ``send`` (the pieces for every
    rank): P - 1 rounds, round k to r + k and from r - k."""
    P, r = wire.Get_size(), wire.Get_rank()
    so, ro = offsets(send_counts), offsets(recv_counts)
    out[ro[r]:ro[r + 1]] = send[so[r]:so[r + 1]]
    for k in range(1, P):
        to, frm = (r + k) % P, (r - k) % P
        wire.Sendrecv(as_bytes(send[so[to]:so[to + 1]]), to, TAG,
                      as_bytes(out[ro[frm]:ro[frm + 1]]), frm, TAG)


def bruck(wire, send, send_counts, out, recv_counts, uniform: bool = True) -> None:
    """As ``pairwise``, in ceil(log2 P) rounds; ``uniform``: every piece of every rank has the
    same size (agreed by the caller), so no round needs a header of sizes."""
    P, r = wire.Get_size(), wire.Get_rank()
    xp = backend.array_module(send)
    so = offsets(send_counts)
    slot = [send[so[(r + i) % P]:so[(r + i) % P + 1]] for i in range(P)]   # i: for r + i
    k = 1
    while k < P:
        moving = [i for i in range(P) if i & k]
        to, frm = (r + k) % P, (r - k) % P
        sizes = np.array([slot[i].size for i in moving], dtype=np.int64)
        coming = sizes.copy()
        if not uniform:
            wire.Sendrecv(as_bytes(sizes), to, TAG + 1, as_bytes(coming), frm, TAG + 1)
        packed = xp.concatenate([slot[i] for i in moving])
        incoming = xp.empty(int(coming.sum()), dtype=send.dtype)
        wire.Sendrecv(as_bytes(packed), to, TAG + 2, as_bytes(incoming), frm, TAG + 2)
        for i, lo, hi in zip(moving, offsets(coming), offsets(coming)[1:]):
            slot[i] = incoming[lo:hi]
        k <<= 1
    ro = offsets(recv_counts)
    for i in range(P):                               # slot i now holds rank r - i's piece
        src = (r - i) % P
        if slot[i].size != ro[src + 1] - ro[src]:
            raise RuntimeError(f"all-to-all: rank {src} sent {slot[i].size} elements, "
                               f"{ro[src + 1] - ro[src]} were expected")
        out[ro[src]:ro[src + 1]] = slot[i]


def pairwise_cost(kind, nbytes, P, a, b) -> float:
    return (P - 1) * (a + nbytes / P * b)


def bruck_cost(kind, nbytes, P, a, b) -> float:
    return log2_ceil(P) * (a + nbytes / 2 * b)


def _bruck_wins(kind, nbytes, world) -> bool:
    a, b = DEFAULT_LINKS["intra"]
    return bruck_cost(kind, nbytes, world, a, b) < pairwise_cost(kind, nbytes, world, a, b)


PAIRWISE = Algorithm(
    "pairwise", kinds=("alltoall",), runs={"alltoall": pairwise},
    auto=lambda kind, nbytes, world: not _bruck_wins(kind, nbytes, world),
    wire_bytes=lambda kind, n, P, itemsize: (P - 1) * (n // P) * itemsize,
    cost=pairwise_cost)
BRUCK = Algorithm(
    "bruck", kinds=("alltoall",), runs={"alltoall": bruck}, auto=_bruck_wins,
    wire_bytes=lambda kind, n, P, itemsize: sum(bin(i).count("1") for i in range(P))
    * (n // P) * itemsize,                      # slot i travels once per set bit of i
    cost=bruck_cost)
