"""Parallel strategies: where autograd meets communication.

Nothing is imported eagerly: ``hpcdist.parallel.schedules`` (pure planning, used by the
configuration and preflight on login nodes) must not start MPI.
"""
import importlib

_EXPORTS = {"DistributedDataParallel": "ddp", "plan_buckets": "ddp",
            "make_compression": "compression", "SCHEMES": "compression"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
