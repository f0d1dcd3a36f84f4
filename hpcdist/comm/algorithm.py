"""What a collective algorithm is: one record, declared in the file that implements it.

The rest of this design: docs/communication.md, "hpcdist/comm/algorithm.py"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

ALWAYS, WHEN_AUTO = "always", "auto"


@dataclass(frozen=True)
class Algorithm:
    name: str
    kinds: tuple = ()                   # the collectives it serves
    runs: dict = field(default_factory=dict)   # collective -> run(wire, buf, ...)
    auto: Callable | None = None        # (kind, nbytes, world) -> whether "auto" picks it
    rides_short: dict = field(default_factory=dict)  # collective -> ALWAYS | WHEN_AUTO
    prefer: Callable | None = None      # (kind, nbytes, world, topology, short) -> bool
    wire_bytes: Callable | None = None  # (kind, n, world, itemsize) -> bytes a rank sends
    #                                     (exact where world is a power of two dividing n)
    cost: Callable | None = None        # (kind, nbytes, P, alpha, beta) -> seconds on the wire
    checked: bool = True                # the agreement's round trips come before it (not short)

    def serves(self, kind: str) -> bool:
        return kind in self.kinds


REGISTRY: dict = {}


_SERVING: dict = {}                 # kind -> [Algorithm]: every call chooses; cached
CHANGES = [0]                       # bumped on every change: select's memo is keyed by it


def register(algorithm: Algorithm) -> Algorithm:
    """Add (or replace, by name) an algorithm."""
    registry()
    REGISTRY[algorithm.name] = algorithm
    _SERVING.clear()
    CHANGES[0] += 1
    return algorithm


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)
    _SERVING.clear()
    CHANGES[0] += 1


def registry() -> dict:
    """name -> Algorithm: the table (comm/table.py, read on first use), then whatever
    ``register`` added or replaced."""
    if not REGISTRY:
        from .table import TABLE
        for a in TABLE:
            REGISTRY.setdefault(a.name, a)
    return REGISTRY


def serving(kind: str) -> list:
    """The algorithms that serve collective ``kind``, in registration order."""
    found = _SERVING.get(kind)
    if found is None:
        found = _SERVING[kind] = [a for a in registry().values() if a.serves(kind)]
    return found


def get(name: str) -> Algorithm:
    return registry()[name]


# ---- helpers the records share -------------------------------------------------------------

def rounds(P: int) -> tuple[int, int]:
    """(the largest power of two <= P, log2 of it): the folding algorithms' shape."""
    pof2 = 1 << (P.bit_length() - 1)
    return pof2, pof2.bit_length() - 1


def fold_time(nbytes: int, P: int, a: float, b: float) -> float:
    """Folding the ranks beyond a power of two in and out (two messages of the buffer)."""
    return 0.0 if rounds(P)[0] == P else 2 * (a + nbytes * b)


def log2_ceil(P: int) -> int:
    return math.ceil(math.log2(P)) if P > 1 else 0
