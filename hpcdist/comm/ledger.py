"""The collective ledger: every call numbered, checked and agreed on by all ranks before any
result is used; errors of non-blocking calls never lost.

The rest of this design: docs/communication.md, "hpcdist/comm/ledger.py"."""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np

from ..device import backend
from .arith import OPS
from .select import SHORT
from . import p2p, ring, watchdog
from .p2p import DTYPE_NAMES, dtype_code

KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "bcast", "reduce",
         "sparse_allreduce", "barrier", "alltoall")
LINE = 240                      # bytes of each rank's description on a mismatch
KEY_MASK = (1 << 62) - 1
_HPCDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not agree."""


def caller() -> str:
    """file:line of the first frame outside hpcdist (the user's call; debug mode only)."""
    f = sys._getframe(2)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_HPCDIST):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f is not None else "?"


class Call:
    """One rank's side of one collective call: the key it agrees on, and its description."""

    __slots__ = ("kind", "seq", "blocking", "length", "dtype", "op", "root", "k", "problem",
                 "shape", "where", "algorithm")

    def __init__(self, kind, seq, blocking, length=0, dtype=None, op=None, *, root=-1, k=-1,
                 problem=None, shape=None, where=None, algorithm=""):
        self.kind, self.seq, self.blocking, self.length, self.dtype = kind, seq, blocking, length, dtype
        self.op, self.root, self.k, self.problem, self.shape, self.where = op, root, k, problem, shape, where
        self.algorithm = algorithm        # ranks must run the same one (e.g. all short)

    def key(self) -> int:
        """The call as a number every rank computes alike (see ``key``)."""
        ok = self.problem is None
        return key(self.kind, self.seq, self.blocking, self.algorithm,
                   self.length if ok else -1, self.dtype if ok else None, op=self.op,
                   root=self.root, k=self.k, ok=ok, where=self.where, shape=self.shape)

    def describe(self) -> str:
        s = f"call #{self.seq} {self.kind}" + ("" if self.blocking else " (non-blocking)")
        if self.problem is not None:
            return f"{s} with a bad argument: {self.problem}"
        if self.kind != "barrier":
            dtype = DTYPE_NAMES[dtype_code(self.dtype)] if self.dtype is not None else "?"
            s += f" {self.length:,} x {dtype}"
            if self.shape is not None and self.where is not None:
                s += f" shape {tuple(self.shape)}"
        if self.op is not None:
            s += f" {self.op}"
        if self.root >= 0:
            s += f" root {self.root}"
        if self.k >= 0:
            s += f" k {self.k:,}"
        if self.algorithm and self.algorithm != SHORT:     # the usual path goes unsaid
            s += f" via {self.algorithm}"
        if self.where is not None:
            s += f" at {self.where}"
        return s


def key(kind, seq, blocking, algorithm, length, dtype, *, op, root, k, ok, where=None,
        shape=None) -> int:
    """A call as a 62-bit number: ``hash`` of ints, which is not salted per process (``hash``
    of a str is). ``where`` and ``shape`` count only in debug mode (``where`` set)."""
    return hash((seq, static_key(kind, blocking, algorithm, length, dtype, op, root=root, k=k,
                                 ok=ok, where=where, shape=shape))) & KEY_MASK


def static_key(kind, blocking, algorithm, length, dtype, op, *, root, k, ok, where=None,
               shape=None) -> int:
    """Everything of a call's key but its number (cacheable: ``key`` is
    ``hash((seq, static_key)) & KEY_MASK``)."""
    return hash((KINDS.index(kind), blocking, _name_code(algorithm), length,
                 -1 if dtype is None else dtype_code(dtype), OPS.index(op) if op in OPS else -1,
                 root, k, ok,
                 0 if where is None else zlib.crc32(where.encode()),
                 0 if where is None or shape is None
                 else zlib.crc32(repr(tuple(shape)).encode())))


_NAME_CODES: dict = {}


def _name_code(name: str) -> int:
    """A number for an algorithm's name, the same in every process (crc32, cached)."""
    code = _NAME_CODES.get(name)
    if code is None:
        code = _NAME_CODES[name] = zlib.crc32(name.encode())
    return code


def agree(exchanges, call: Call, label: str = "this communicator", payload=None,
          fold=None) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks make the same call.

    A rank whose own argument is bad gets ValueError(its problem); the others get the mismatch
    error, which quotes it. ``payload`` (an ``Exchange`` already filled) rides along, folded
    with ``fold`` (short.py); its ``data`` holds the result when this returns.
    """
    comm = exchanges.wire
    if comm.Get_size() == 1:
        if call.problem is not None:
            raise ValueError(call.problem)
        return
    ex = payload if payload is not None else exchanges.get(0, np.uint8)
    if ex.run(call.key(), fold):
        if call.problem is not None:             # every rank has the same (bad) call
            raise ValueError(call.problem)
        return
    mismatch(comm, call, label)


def mismatch(comm, call: Call, label: str):
    """After keys differed: every rank's one-line description, and the error on every rank."""
    lines = _gather_lines(comm, call.describe())
    if call.problem is not None:
        raise ValueError(call.problem)
    bad = [r for r, line in enumerate(lines) if "with a bad argument" in line]
    if bad:
        what = "; ".join(f"rank {r}: {lines[r]}" for r in bad)
        raise CollectiveMismatchError(
            f"{call.kind}: a rank passed a bad argument, so every rank stops here instead of "
            f"waiting — {what}")
    raise CollectiveMismatchError(
        f"{call.kind}: ranks disagree at call #{call.seq} of {label} — {group_lines(lines)}")


def _gather_lines(comm, line: str) -> list[str]:
    """Every rank's one-line description (a ring allgather of fixed-width bytes)."""
    P, r = comm.Get_size(), comm.Get_rank()
    buf = np.zeros(P * LINE, dtype=np.uint8)
    raw = line.encode()[:LINE]
    buf[r * LINE:r * LINE + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    ring.allgather_inplace(comm, buf, [(i * LINE, (i + 1) * LINE) for i in range(P)])
    return [bytes(buf[i * LINE:(i + 1) * LINE]).rstrip(b"\0").decode(errors="replace")
            for i in range(P)]


def group_lines(lines: list[str]) -> str:
    """'rank 1: X; ranks 0, 2, 3: Y' — ranks grouped by what they said, fewest first."""
    groups: dict = {}
    for r, line in enumerate(lines):
        groups.setdefault(line, []).append(r)
    parts = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    return "; ".join(("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs)) + ": " + line
                     for line, rs in parts)


# ---- this rank's arguments, checked before the agreement ------------------------------

def argument_problem(buf, name: str, root: int | None, size: int) -> str | None:
    """What is wrong with this rank's arguments (None if nothing)."""
    if (type(buf) is np.ndarray and buf.flags.c_contiguous and buf.dtype in p2p.KNOWN
            and (root is None or 0 <= root < size)):
        return None                               # the common case, quickly
    if not hasattr(buf, "dtype") or not hasattr(buf, "flags"):
        return f"{name} must be a NumPy or CuPy array, got {type(buf).__name__}"
    if not buf.flags.c_contiguous:
        return f"{name} must be C-contiguous (pass xp.ascontiguousarray({name}))"
    if not buf.dtype.isnative:
        return (f"{name} has non-native byte order ({buf.dtype.str}); pass "
                f"{name}.astype({name}.dtype.newbyteorder('='))")
    if root is not None and not 0 <= root < size:
        return f"root must be in [0, {size}), got {root}"
    try:
        p2p.dtype_code(buf.dtype)
    except TypeError as e:
        return f"{name}: {e}"
    return None


def out_problem(out, buf) -> str | None:
    """What is wrong with ``out=`` for a result shaped like ``buf``."""
    if not hasattr(out, "dtype") or not hasattr(out, "flags"):
        return f"out must be a NumPy or CuPy array, got {type(out).__name__}"
    if not backend.writeable(out):
        return "out is read-only"
    if tuple(out.shape) != tuple(buf.shape) or out.dtype != buf.dtype:
        return (f"out is {out.dtype}{list(out.shape)}, the result is "
                f"{buf.dtype}{list(buf.shape)}")
    if not out.flags.c_contiguous:
        return "out must be C-contiguous"
    return None


def counts_problem(counts, total: int, size: int) -> str | None:
    """What is wrong with per-rank ``counts`` for a ``total``-element array over ``size``."""
    if counts is None:
        return None
    if len(counts) != size or any(int(c) < 0 for c in counts):
        return f"counts must give {size} non-negative sizes, got {list(counts)}"
    if sum(int(c) for c in counts) != total:
        return f"counts add up to {sum(int(c) for c in counts)}, the array has {total}"
    return None


_LABELS: dict = {}      # label -> communicators with those members made by this process


def communicator_label(mpi) -> str:
    """A name for a communicator that every member computes alike: "world", or its members'
    world ranks ("world ranks 0, 2, 4"), with a count where one set of members has several."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if mpi.Get_size() == world.Get_size():
        base = "world"
    else:
        group, wgroup = mpi.Get_group(), world.Get_group()
        members = group.Translate_ranks(list(range(mpi.Get_size())), wgroup)
        group.Free(), wgroup.Free()
        base = "world ranks " + ", ".join(str(r) for r in members)
    _LABELS[base] = n = _LABELS.get(base, 0) + 1
    return base if n == 1 else f"{base} (#{n})"


# ---- one communicator's book --------------------------------------------------------------

class Ledger:
    """Numbering, agreement and unretrieved errors of one communicator (``label``, whose
    members are ``peers`` in reports; ``size`` ranks; ``debug`` adds call sites to keys)."""

    def __init__(self, label: str, peers: str, size: int, debug: bool):
        self.label, self.peers, self.size, self.debug = label, peers, size, debug
        self.seq = 0                    # calls made on this communicator
        self._open: list = []           # handles of non-blocking calls not yet waited
        self._lean_wait = watchdog.Wait(label, 0, "", 0, peers)

    def open(self, kind, buf=None, name="buf", blocking=True, op=None, root=None,
             *, length=None, k=-1, problem=None, out=None) -> Call:
        """This rank's side of the next call (in the caller's thread, so blocking and
        non-blocking calls share one numbering). Raises here an error of an earlier
        non-blocking call that nobody waited for."""
        self.raise_unretrieved()
        self.seq += 1
        watchdog.note_call(self.label, self.seq)
        if kind != "barrier":
            problem = argument_problem(buf, name, root, self.size) or problem
            if problem is None and out is not None and out is not buf:
                problem = out_problem(out, buf)
        ok = problem is None and buf is not None
        return Call(kind, self.seq, blocking,
                    length=(length if length is not None else buf.size) if ok else 0,
                    dtype=buf.dtype if ok else None, op=op, root=-1 if root is None else root,
                    k=k, problem=problem, shape=buf.shape if ok else None,
                    where=caller() if self.debug else None)

    def agree(self, exchanges, call: Call, payload=None, fold=None) -> None:
        """``agree`` on this communicator (see there)."""
        agree(exchanges, call, self.label, payload, fold)

    def agree_static(self, exchanges, ex, fold, static: int, fields) -> None:
        """The agreement of a blocking short call taken by a cached plan: numbered here, its
        key ``hash((seq, static))`` as ``Call.key`` would make it (``static``: its
        ``static_key``; ``fields`` = (kind, length, dtype, op, root) describe it on a
        mismatch)."""
        if self._open:
            self.raise_unretrieved()
        self.seq = seq = self.seq + 1
        watchdog.note_call(self.label, seq)
        wait = self._lean_wait
        wait.seq, wait.kind, wait.nbytes = seq, fields[0], ex.data.nbytes
        if not ex.run(hash((seq, static)) & KEY_MASK, fold, wait):
            kind, length, dtype, op, root = fields
            mismatch(exchanges.wire, Call(kind, seq, True, length, dtype, op, root=root,
                                          algorithm=SHORT), self.label)

    # handles of non-blocking calls
    def track(self, handle) -> None:
        self._open.append(handle)

    def release(self, handle) -> None:
        """``handle`` was waited: no longer this ledger's to raise."""
        if self._open:
            self._open = [h for h in self._open if h is not handle and not h.waited]

    def raise_unretrieved(self) -> None:
        if not self._open:
            return
        for h in list(self._open):
            e = h.unretrieved_error()
            if e is not None:
                h.waited = True
                self.release(h)
                try:
                    said = type(e)(f"an earlier non-blocking call #{h.call.seq} "
                                   f"{h.call.kind} failed and was not waited for: {e}")
                except TypeError:           # MPI's own errors carry a code, not a message
                    raise e from None
                raise said from e
        self._open = [h for h in self._open if not h.test()]
