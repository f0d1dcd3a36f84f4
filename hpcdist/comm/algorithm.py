"""What a collective algorithm is: one record, declared in the file that implements it (the
registry that serves them by name is comm/registry.py: the records never import it).

The rest of this design: docs/communication.md, "hpcdist/comm/algorithm.py"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

ALWAYS, WHEN_AUTO = "always", "auto"
# The links an algorithm's "auto" rule compares on unless told otherwise (alpha seconds, beta
# seconds per byte): a shared-memory node and a 10 Gbit/s network (comm/select.py has the rest)
DEFAULT_LINKS = {"intra": (2e-6, 1 / 5e9), "inter": (30e-6, 1 / 1.25e9)}


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
