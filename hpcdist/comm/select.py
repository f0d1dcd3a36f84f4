"""Which algorithm runs: "auto" asks every registered algorithm that serves the collective
(comm/algorithm.py) — a two-level one first where the ranks span nodes — and a short call of a
rides_short choice rides in the agreement (short.py). No algorithm is named here: each says in
its own file what it serves, for which sizes "auto" picks it, and what it costs."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .algorithm import ALWAYS, DEFAULT_LINKS
from .registry import CHANGES, get, serving
from .short import SHORT, SHORT_LIMITS

# what "auto" means may be set per collective by an environment variable
FORCED_BY = {"allreduce": "HPCDIST_ALLREDUCE", "bcast": "HPCDIST_BCAST"}


def forced_by_env(kind: str) -> str:
    """The algorithm the environment forces for ``kind`` ("auto": none)."""
    return os.environ.get(FORCED_BY[kind], "auto") if kind in FORCED_BY else "auto"


def _named(kind: str, name: str):
    """The algorithm ``name`` for a ``kind`` call, or a ValueError naming those that serve."""
    runnable = [a.name for a in serving(kind) if kind in a.runs]
    if name not in runnable:
        raise ValueError(f"unknown {kind} algorithm {name!r}: choose auto, "
                         f"{', '.join(runnable)}")
    return get(name)


def choose_allreduce(nbytes: int, world: int, algorithm: str = "auto", env: bool = True) -> str:
    """The allreduce algorithm for a message size, without the short call
    (``HPCDIST_ALLREDUCE`` overrides "auto" unless ``env`` is False)."""
    forced = forced_by_env("allreduce") if env else "auto"
    return choose("allreduce", nbytes, world, algorithm, forced, short=False)


def choose_bcast(nbytes: int, world: int, algorithm: str = "auto", env: bool = True) -> str:
    """The broadcast algorithm for a message size, without the short call (``HPCDIST_BCAST``
    overrides "auto" unless ``env`` is False)."""
    forced = forced_by_env("bcast") if env else "auto"
    return choose("bcast", nbytes, world, algorithm, forced, short=False)


def __getattr__(name):
    """``ALLREDUCE_ALGORITHMS`` / ``BCAST_ALGORITHMS``: name -> run, from the registry."""
    kinds = {"ALLREDUCE_ALGORITHMS": "allreduce", "BCAST_ALGORITHMS": "bcast"}
    if name in kinds:
        kind = kinds[name]
        return {a.name: a.runs[kind] for a in serving(kind) if kind in a.runs}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- two levels: nodes -----------------------------------------------------------------------
# Per-level links (alpha seconds, beta seconds per byte) for the choice between flat and
# two-level algorithms. The defaults are a shared-memory node and a 10 Gbit/s network;
# HPCDIST_LINKS="intra=ALPHA_US:GBPS,inter=ALPHA_US:GBPS" gives measured ones
# (``python -m hpcdist.bench collectives --hierarchical`` measures both on the machine).
# (DEFAULT_LINKS lives with the record, comm/algorithm.py: the algorithms' rules read it too)


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


_CHOSEN: dict = {}       # a memo of choose: every collective call asks, and the answer is a
#                          pure function of the call and the registry (two levels aside)


def check_name(kind: str, algorithm: str) -> None:
    """Raise ValueError for an algorithm that does not serve ``kind`` ("auto" always does)."""
    if algorithm != "auto" and any(kind in a.runs for a in serving(kind)):
        _named(kind, algorithm)


def choose(kind: str, nbytes: int, world: int, algorithm: str = "auto", forced: str = "auto",
           short: bool = True, *, topology: Topology | None = None) -> str:
    """``choose_among``'s answer, remembered (not where the ranks span nodes: the links
    decide there)."""
    if topology is not None and topology.two_level:
        return choose_among(kind, nbytes, world, algorithm, forced, short, topology=topology)
    key = (kind, nbytes, world, algorithm, forced, short, CHANGES[0])
    name = _CHOSEN.get(key)
    if name is None:
        name = choose_among(kind, nbytes, world, algorithm, forced, short, topology=None)
        if len(_CHOSEN) > 4096:
            _CHOSEN.clear()
        _CHOSEN[key] = name
    return name


def choose_among(kind: str, nbytes: int, world: int, algorithm: str = "auto",
                 forced: str = "auto", short: bool = True,
                 *, topology: Topology | None = None) -> str:
    """The algorithm a ``kind`` call of ``nbytes`` (payload) runs. SHORT — the data carried
    by the ledger's agreement (short.py) — is one more algorithm, chosen for short calls of
    a rides_short choice where ``short`` (the buffer is on the host or staged there); a
    two-level algorithm where the ranks span nodes and it says it is faster.
    ``algorithm``: the caller's choice; ``forced``: what "auto" means (HPCDIST_ALLREDUCE /
    HPCDIST_BCAST, read once by the caller)."""
    want = forced if algorithm == "auto" else algorithm
    limit = SHORT_LIMITS.get(kind, -1) if short else -1
    if want == "auto" and topology is not None and topology.two_level:
        for a in serving(kind):
            if a.prefer is not None and a.prefer(kind, nbytes, world, topology, limit):
                return a.name
    if want != "auto":
        chosen = _named(kind, want)
    else:
        chosen = next((a for a in serving(kind) if a.auto and a.auto(kind, nbytes, world)),
                      None)
        if chosen is None:
            raise ValueError(f"no algorithm serves {kind!r}")
    fuse = chosen.rides_short.get(kind)
    if fuse and (fuse == ALWAYS or want == "auto") and world > 1 and nbytes <= limit:
        return SHORT
    return chosen.name


def is_short(kind: str, nbytes: int, world: int) -> bool:
    """Whether "auto" runs a ``kind`` call of ``nbytes`` (payload) as a short call carried by
    the agreement (short.py)."""
    return kind in SHORT_LIMITS and world > 1 and choose(kind, nbytes, world) == SHORT


def wire_bytes(kind: str, algorithm: str, n: int, world: int, itemsize: int) -> int:
    """Payload bytes a rank sends in a ``kind`` call of n elements by ``algorithm`` (exact
    where ``world`` is a power of two that divides n; the agreement's keys are not counted)."""
    if world == 1 or n == 0:
        return 0
    return get(algorithm).wire_bytes(kind, n, world, itemsize)


def topology_of(mpi, node) -> tuple:
    """(node of each rank, select.Topology) of ``mpi``: a node is named by its lowest rank
    (setup calls, like Split: not a data path)."""
    leader = np.array([mpi.Get_rank()], dtype=np.int64)
    node.Bcast(leader, root=0)
    node_of = np.empty(mpi.Get_size(), dtype=np.int64)
    mpi.Allgather(leader, node_of)
    node_of = [int(n) for n in node_of]
    counts = {n: node_of.count(n) for n in set(node_of)}
    even = len(set(counts.values())) == 1
    return node_of, Topology(len(counts), next(iter(counts.values())) if even else 0,
                                    parse_links(os.environ.get("HPCDIST_LINKS")))
