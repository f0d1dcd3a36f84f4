"""The collective algorithms by name: the table (comm/table.py, read on first use), then
whatever ``register`` added or replaced (a test, a user's experiment). The algorithms' own
files import only their record's class (comm/algorithm.py), never this registry."""
from __future__ import annotations

from .algorithm import Algorithm

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
