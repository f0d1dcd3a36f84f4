"""Which algorithm runs: the registries, the measured thresholds behind "auto", and the
bytes each algorithm puts on the wire."""
from __future__ import annotations

import functools
import os

from dataclasses import dataclass, field

from . import hierarchical, rabenseifner, recursive_doubling, ring, tree

# Thresholds measured on the 2-core development machine with
#   mpiexec -n N python -m hpcdist.bench collectives      (N = 2, 4, 8; see README)
# Recursive doubling sends the whole buffer log2(P) times but in the fewest rounds; it wins
# below ALLREDUCE_SMALL_BYTES. Rabenseifner sends 2(P-1)/P of it in 2 log2(P) rounds; the
# ring sends the same bytes in 2(P-1) rounds, each rank talking only to its neighbours.
#
# allreduce, microseconds per call by algorithm (``--algorithms``), float32, 2026-11-21:
#   bytes      N=2: RD / Rab / ring      N=4: RD / Rab / ring      N=8: RD / Rab / ring
#   32 KiB       44 /  132 /  215          155 /  214 /  260          882 / 1075 / 1437
#   128 KiB     150 /  344 /  129          223 /  267 /  306         1502 / 1354 / 2150
#   512 KiB     867 /  907 /  742          382 /  377 /  412         6255 / 3001 / 3961
#   2 MiB      1804 / 1600 / 1630          841 /  641 /  736        14089 / 7836 / 3443
#   8 MiB      3563 / 5532 / 2916         6183 / 3728 / 3502        24732 / 12069 / 8352
# Recursive doubling wins up to 64 KiB everywhere; the ring wins from 2 MiB (clearly at N=8,
# by 0-20% at N=2 and 4); Rabenseifner in between (at N=2 it is the ring's schedule).
ALLREDUCE_SMALL_BYTES = 64 << 10
# Short calls carry the agreement's header in their own messages (short.py): one recursive
# doubling, checked. Every recursive-doubling allreduce is short enough; the other kinds
# send their whole buffer log2(P) times that way, so only up to a size. Fused / plain (the
# check, then ring or binomial) time, median of 300 blocking calls, float32, 2026-11-22:
#   bytes    reduce-scatter N=2/4/8   allgather N=2/4/8     bcast N=2/4/8
#   4 KiB    0.30 / 0.31 / 0.22       0.47 / 0.39 / 0.31    0.55 / 0.56 / 0.51
#   8 KiB    0.31 / 0.38 / 0.42       0.59 / 0.64 / 0.70    0.75 / 0.82 / 1.21
#   16 KiB   0.63 / 1.10 / 0.43       0.82 / 1.36 / 0.79    1.12 / 1.00 / 0.97
#   64 KiB   1.56 / 1.31 / 0.44       1.31 / 1.35 / 0.56    2.52 / 1.76 / 1.17
FUSED = "recursive_doubling+check"
SHORT_ALLREDUCE = ALLREDUCE_SMALL_BYTES
SHORT_REDUCE_SCATTER = 16 << 10     # the whole buffer
SHORT_ALLGATHER = 8 << 10           # the whole gathered array
SHORT_BCAST = 8 << 10
ALLREDUCE_RING_BYTES = 2 << 20
# bcast, microseconds by algorithm (same sweep), binomial / scatter + ring allgather:
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

ALLREDUCE_ALGORITHMS = {
    "ring": ring.allreduce_inplace,
    "recursive_doubling": recursive_doubling.allreduce_inplace,
    "rabenseifner": rabenseifner.allreduce_inplace,
    "hierarchical": hierarchical.allreduce_inplace,
}
BCAST_ALGORITHMS = {
    "binomial": tree.bcast_binomial,
    "scatter_allgather": tree.bcast_scatter_allgather,
}


def _forced(algorithm: str, env: str | None, table: dict, what: str):
    """The algorithm forced by argument or by the variable ``env``; None when both say
    "auto" (``env`` None: the caller looked at the variable already)."""
    if algorithm == "auto" and env is not None:
        algorithm = os.environ.get(env, "auto")
    if algorithm == "auto":
        return None
    if algorithm not in table:
        raise ValueError(f"unknown {what} algorithm {algorithm!r}: choose auto, "
                         f"{', '.join(table)}")
    return algorithm


def choose_allreduce(nbytes: int, world: int, algorithm: str = "auto", env: bool = True) -> str:
    """The allreduce algorithm for a message size (``HPCDIST_ALLREDUCE`` overrides "auto"
    unless ``env`` is False)."""
    forced = _forced(algorithm, "HPCDIST_ALLREDUCE" if env else None, ALLREDUCE_ALGORITHMS,
                     "allreduce")
    if forced:
        return forced
    if nbytes <= ALLREDUCE_SMALL_BYTES:
        return "recursive_doubling"
    return "rabenseifner" if nbytes < ALLREDUCE_RING_BYTES else "ring"


def choose_bcast(nbytes: int, world: int, algorithm: str = "auto", env: bool = True) -> str:
    """The broadcast algorithm for a message size (``HPCDIST_BCAST`` overrides "auto" unless
    ``env`` is False)."""
    forced = _forced(algorithm, "HPCDIST_BCAST" if env else None, BCAST_ALGORITHMS, "bcast")
    if forced:
        return forced
    small = BCAST_SMALL_BYTES_MANY if world >= BCAST_MANY_RANKS else BCAST_SMALL_BYTES
    return "binomial" if nbytes < small or world <= 2 else "scatter_allgather"


SHORT_LIMITS = {"allreduce": SHORT_ALLREDUCE, "reduce_scatter": SHORT_REDUCE_SCATTER,
                "allgather": SHORT_ALLGATHER, "bcast": SHORT_BCAST, "barrier": 0}
TWO_LEVEL = ("allreduce", "reduce_scatter", "allgather")
FIXED = {"reduce_scatter": "ring", "allgather": "ring", "allgatherv": "ring",
         "reduce": "binomial", "sparse_allreduce": "topk-allgatherv", "barrier": FUSED}


# ---- two levels: nodes -----------------------------------------------------------------------
# Per-level links (alpha seconds, beta seconds per byte) for the choice between flat and
# hierarchical algorithms. The defaults are a shared-memory node and a 10 Gbit/s network;
# HPCDIST_LINKS="intra=ALPHA_US:GBPS,inter=ALPHA_US:GBPS" gives measured ones
# (``python -m hpcdist.bench collectives --hierarchical`` measures both on the machine).
DEFAULT_LINKS = {"intra": (2e-6, 1 / 5e9), "inter": (30e-6, 1 / 1.25e9)}


def parse_links(text: str | None) -> dict:
    links = dict(DEFAULT_LINKS)
    for part in filter(None, (text or "").split(",")):
        try:
            level, spec = part.split("=")
            alpha_us, gbps = spec.split(":")
            links[level.strip()] = (float(alpha_us) * 1e-6, 1 / (float(gbps) * 1e9))
        except ValueError:
            raise ValueError(f"HPCDIST_LINKS: cannot read {part!r}; say e.g. "
                             "intra=2:5,inter=30:1.25 (alpha in us, GB/s)") from None
    return links


@dataclass(frozen=True)
class Topology:
    """How a communicator's ranks sit on nodes: ``nodes``, ``per_node`` (0 when uneven) and
    the per-level ``links``."""
    nodes: int = 1
    per_node: int = 0
    links: dict = field(default_factory=lambda: dict(DEFAULT_LINKS))

    @property
    def two_level(self) -> bool:
        return self.nodes > 1 and self.per_node > 1


def two_level_times(kind: str, nbytes: int, topo: Topology) -> tuple[float, float]:
    """(flat ring, hierarchical) seconds the per-level alpha-beta model gives. A flat ring
    over block-placed ranks crosses a node link at every one of its steps, so the slow link
    sets each step's time; the hierarchical one crosses it only in its inter-node phase,
    where the node's L ranks share the link (S/N bytes per step on it)."""
    N, L = topo.nodes, topo.per_node
    P = N * L
    (ai, bi), (ae, be) = topo.links["intra"], topo.links["inter"]
    phases = 2 if kind == "allreduce" else 1
    flat = phases * (P - 1) * (ae + nbytes / P * be)
    hier = phases * ((L - 1) * (ai + nbytes / L * bi) + (N - 1) * (ae + nbytes / N * be))
    return flat, hier


def choose(kind: str, nbytes: int, world: int, algorithm: str = "auto", forced: str = "auto",
           short: bool = True, topology: Topology | None = None) -> str:
    """The algorithm a ``kind`` call of ``nbytes`` (payload) runs. FUSED — the data carried
    by the ledger's agreement (short.py) — is one more algorithm, chosen for short calls of
    the kinds that have it where ``short`` (the buffer is on the host or staged there);
    "hierarchical" where the ranks span nodes and the per-level model says it is faster.
    ``algorithm``: the caller's choice; ``forced``: what "auto" means (HPCDIST_ALLREDUCE /
    HPCDIST_BCAST, read once by the caller)."""
    auto = algorithm == "auto" and forced == "auto"
    if auto and topology is not None and topology.two_level and kind in TWO_LEVEL:
        flat, hier = two_level_times(kind, nbytes, topology)
        if short and nbytes <= SHORT_LIMITS[kind]:     # the short call: log2(P) whole-buffer
            ae, be = topology.links["inter"]           # rounds, across nodes
            flat = min(flat, (world - 1).bit_length() * (ae + nbytes * be))
        if hier < flat:
            return "hierarchical"
    if kind == "allreduce":
        name = choose_allreduce(nbytes, world, forced if algorithm == "auto" else algorithm,
                                env=False)
        fusable = name == "recursive_doubling"
    elif kind == "bcast":
        name = choose_bcast(nbytes, world, forced if algorithm == "auto" else algorithm,
                            env=False)
        fusable = algorithm == "auto" and forced == "auto"
    else:
        name, fusable = FIXED[kind], kind in SHORT_LIMITS
        if algorithm == "hierarchical" and kind in TWO_LEVEL:
            name, fusable = algorithm, False
        elif algorithm not in ("auto", name):
            raise ValueError(f"unknown {kind} algorithm {algorithm!r}: choose auto, {name}"
                             + (", hierarchical" if kind in TWO_LEVEL else ""))
    if fusable and short and world > 1 and nbytes <= SHORT_LIMITS[kind]:
        return FUSED
    return name


def is_short(kind: str, nbytes: int, world: int) -> bool:
    """Whether "auto" runs a ``kind`` call of ``nbytes`` (payload) as a short call carried by
    the agreement (short.py)."""
    return kind in SHORT_LIMITS and world > 1 and choose(kind, nbytes, world) == FUSED


@functools.lru_cache(maxsize=256)
def allreduce_wire_bytes(algorithm: str, n: int, world: int, itemsize: int) -> int:
    """Payload bytes one rank sends in our allreduce of n elements (rank 0's count for the
    folding algorithms; the agreement header is not counted)."""
    P = world
    if P == 1 or n == 0:
        return 0
    if algorithm == "ring":
        S = -(-n // P)
        return 2 * (P - 1) * S * itemsize
    pof2 = 1 << (P.bit_length() - 1)
    fold = n * itemsize if pof2 != P else 0
    rounds = pof2.bit_length() - 1
    if algorithm in ("recursive_doubling", FUSED):
        return fold + rounds * n * itemsize
    S = -(-n // pof2)
    return fold + 2 * (pof2 - 1) * S * itemsize        # rabenseifner
