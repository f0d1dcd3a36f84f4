"""The alpha-beta cost model of our collectives, and the ping-pong that measures alpha and beta.

A message of n bytes costs ``alpha + n * beta`` (latency plus inverse bandwidth; reduction
arithmetic is left out). Each formula below counts the rounds and the bytes one rank sends in
our implementation of that algorithm — each algorithm's record says it (``cost``, in its own
file: comm/algorithm.py) — plus the agreement check every collective starts with: one
recursive-doubling round trip of a small header per doubling step (ledger.py) — except for
short calls, whose data rides in the agreement's own messages (short.py).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .registry import get, serving
from .select import SHORT, choose, forced_by_env, is_short

MiB = 1 << 20


def pingpong(mpi, nbytes: int, iters: int, a: int = 0, b: int = 1) -> float:
    """One-way seconds per message between ranks ``a`` and ``b`` (0 on a single rank);
    collective over ``mpi``, the result broadcast from rank ``a``."""
    if mpi.Get_size() < 2:
        return 0.0
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    r = mpi.Get_rank()
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        if r == a:
            mpi.Send(buf, b, 7)
            mpi.Recv(buf, b, 7)
        elif r == b:
            mpi.Recv(buf, a, 7)
            mpi.Send(buf, a, 7)
    t = (time.perf_counter() - t0) / iters / 2
    return mpi.bcast(t, root=a)


def fit_alpha_beta(mpi, big: int = 16 * MiB, iters: tuple = (200, 5)):
    """(alpha seconds, beta seconds/byte): alpha from an 8-byte ping-pong between ranks 0 and
    1, beta from a ``big``-byte one. Collective; (0, 0) on a single rank."""
    a = pingpong(mpi, 8, iters[0])
    b = max(pingpong(mpi, big, iters[1]) - a, 0.0) / big
    return a, b


def fit_links(comm, big: int = 4 * MiB) -> dict:
    """{"intra": (alpha, beta), "inter": (alpha, beta)}: ``fit_alpha_beta`` between rank 0
    and a rank on its node, and between rank 0 and the first rank on another node (a level
    with no such pair is left out). Collective over ``comm`` (a Communicator)."""
    links = {}
    node0 = comm.node_of[0]
    pairs = {"intra": next((r for r in range(1, comm.size) if comm.node_of[r] == node0), None),
             "inter": next((r for r in range(1, comm.size) if comm.node_of[r] != node0), None)}
    for level, peer in pairs.items():
        if peer is not None:
            a = pingpong(comm.mpi, 8, 200, 0, peer)
            b = max(pingpong(comm.mpi, big, 5, 0, peer) - a, 0.0) / big
            links[level] = (a, b)
    return links or {"intra": (0.0, 0.0)}


def predict(kind: str, nbytes: int, P: int, a: float, b: float, algorithm: str = "") -> float:
    """Seconds the alpha-beta model gives for our ``kind`` collective of ``nbytes`` bytes (the
    whole buffer; for allgather the gathered result) on ``P`` ranks. ``algorithm`` defaults to
    what "auto" picks; the agreement check adds ceil(log2 P) latencies (none for a short
    call: one recursive doubling of the payload, which is the whole buffer)."""
    if P == 1:
        return 0.0
    if kind in ("send", "recv", "sendrecv"):
        return a + nbytes * b
    check = math.ceil(math.log2(P)) * a
    if kind == "barrier":
        return check
    if not serving(kind):
        raise ValueError(f"no cost model for {kind!r}: no algorithm serves it")
    if not algorithm:
        algorithm = SHORT if is_short(kind, nbytes, P) else \
            choose(kind, nbytes, P, forced=forced_by_env(kind), short=False)
    record = get(algorithm)
    if record.cost is None:
        raise ValueError(f"no cost model for {kind!r} by {algorithm!r}")
    return (check if record.checked else 0.0) + record.cost(kind, nbytes, P, a, b)


# nccl-tests' bus bandwidth factors: busbw = algbw x factor(P) makes every collective's number
# comparable with the link bandwidth (allreduce moves 2(P-1)/P of the buffer per rank).
BUSBW_FACTOR = {
    "allreduce": lambda P: 2 * (P - 1) / P,
    "reduce_scatter": lambda P: (P - 1) / P,
    "allgather": lambda P: (P - 1) / P,
    "allgatherv": lambda P: (P - 1) / P,
    "sparse_allreduce": lambda P: (P - 1) / P,
    "alltoall": lambda P: (P - 1) / P,
}


def busbw_factor(kind: str, P: int) -> float:
    """nccl-tests' factor for ``kind`` (1 for broadcast, reduce and point-to-point)."""
    return BUSBW_FACTOR[kind](P) if kind in BUSBW_FACTOR and P > 1 else 1.0
