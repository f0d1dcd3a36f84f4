"""Activation memory of a training step, measured (``--trace-memory``).

Two numbers per step, both above what the rank held when the step began (the model state,
its buffers) — the list goes on in docs/observability.md, "hpcdist/autograd/memtrace.py"."""
from __future__ import annotations

import tracemalloc

from ..device import backend

_on = False
_base = 0
_held = 0
_first: dict = {}           # the run's first step (it also makes lazily built buffers)
_most: dict = {}            # the largest of the steps after it
_started = False            # tracemalloc is ours to stop


def enable(on: bool = True) -> None:
    """Measure this run's steps (its ``--trace-memory``), from nothing; ``False``: stop."""
    global _on, _started
    _on = on
    _first.clear()
    _most.clear()
    if on and backend.device_label() != "gpu" and not tracemalloc.is_tracing():
        tracemalloc.start()
        _started = True
    elif not on and _started:
        tracemalloc.stop()
        _started = False


def _gpu() -> bool:
    """Device arrays: the pool's bytes in use (the GPU stand-in's pool reads tracemalloc)."""
    return backend.device() == "gpu"


def _current() -> int:
    if _gpu():
        return int(backend.xp().get_default_memory_pool().used_bytes())
    return tracemalloc.get_traced_memory()[0]


def start() -> None:
    """A step begins: what is held now is the baseline."""
    global _base, _held
    if not _on:
        return
    _held = 0
    _base = _current()
    if tracemalloc.is_tracing():
        tracemalloc.reset_peak()


def sample() -> None:
    """A graph is whole (a backward begins): note what it holds."""
    global _held
    if _on:
        _held = max(_held, _current() - _base)


def finish() -> dict:
    """The step's {"activations", "peak"} in bytes."""
    if not _on:
        return {}
    peak = tracemalloc.get_traced_memory()[1] - _base if tracemalloc.is_tracing() else _held
    step = {"activations": _held, "peak": max(peak, _held)}
    if not _first:
        _first.update(step)
    else:
        for k, v in step.items():
            _most[k] = max(_most.get(k, 0), v)
    return step


def most() -> dict:
    """The largest of the steps after the run's first (whose numbers include the buffers
    made once, on first use), or the first when it was the only one; {} when off."""
    return dict(_most or _first) if _on else {}
