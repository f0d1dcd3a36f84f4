"""Cross-rank agreement on a collective's arguments, before any data moves.

Every collective first reduces a small int64 header — what is called, length, dtype, op,
root, and whether this rank found its own arguments bad — with a recursive-doubling MAX over
[h, -h]. Every rank gets the same max and min of every field, so a mismatch (or one rank's bad
argument) raises the same error on every rank instead of leaving some of them waiting.
``HPCDIST_DEBUG=1`` adds the shape and a per-communicator call counter (call order).
"""
from __future__ import annotations

import zlib

import numpy as np

from . import recursive_doubling
from .layout import OPS
from .p2p import DTYPE_NAMES, dtype_code

KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "bcast", "reduce",
         "sparse_allreduce")
FIELDS = ("collective", "length", "dtype", "op", "root", "argument error", "k", "call order",
          "shape")


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not agree."""


def header(kind, length, dtype, op=None, root=-1, local_error=False, seq=0, shape=None,
           debug=False, k=-1) -> np.ndarray:
    h = np.zeros(len(FIELDS), dtype=np.int64)
    h[0] = KINDS.index(kind)
    h[1] = length
    h[2] = dtype_code(dtype) if dtype is not None else -1
    h[3] = OPS.index(op) if op in OPS else -1
    h[4] = root
    h[5] = int(bool(local_error))
    h[6] = k
    if debug:
        h[7] = seq
        h[8] = zlib.crc32(repr(tuple(shape)).encode()) if shape is not None else 0
    return h


def agree(comm, h: np.ndarray) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks passed the same header."""
    if comm.Get_size() == 1:
        if h[5]:
            raise CollectiveMismatchError("argument error")
        return
    n = len(h)
    both = np.empty(2 * n, dtype=np.int64)
    both[:n], both[n:] = h, -h
    recursive_doubling.allreduce_inplace(comm, both, "max")
    hi, lo = both[:n], -both[n:]
    bad = np.flatnonzero(hi != lo)           # vectorized: this runs on every collective
    if not len(bad) and not hi[5]:           # all agree, and no rank found a bad argument
        return
    kind = KINDS[int(h[0])]
    if hi[5]:
        raise CollectiveMismatchError(
            f"{kind}: a rank passed a bad argument (its own error says which); "
            "every rank stops here instead of waiting")
    i = int(bad[0])
    if FIELDS[i] == "collective":
        what = f"ranks called different collectives ({KINDS[lo[i]]} and {KINDS[hi[i]]})"
    elif FIELDS[i] == "call order":
        what = f"ranks are at different calls of this communicator (#{lo[i]} .. #{hi[i]})"
    elif FIELDS[i] == "dtype":
        names = [DTYPE_NAMES[c] if c >= 0 else "none" for c in (lo[i], hi[i])]
        what = f"dtypes differ across ranks ({names[0]} and {names[1]})"
    elif FIELDS[i] == "shape":
        what = "array shapes differ across ranks"
    else:
        what = f"{FIELDS[i]} differs across ranks (min {lo[i]}, max {hi[i]})"
    raise CollectiveMismatchError(
        f"{kind}: {what}; every rank must pass the same "
        f"{'length and dtype' if i in (1, 2) else FIELDS[i]}")
