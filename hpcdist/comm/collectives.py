"""The collectives, one class each: how a call is checked, what its short payload is, and how
its long algorithms run. The Communicator's one dispatch (``Communicator._collective``)
walks every call through the same steps:

    open     the ledger numbers the call and checks this rank's arguments   (ledger.py)
    choose   the algorithm for the size: FUSED for short calls, where the data rides in
             the ledger's agreement, else ring, trees, ...                   (select.py)
    short    FUSED: ``fill`` the exchange's payload, agree (which folds it), ``extract``
    run      any other algorithm: agree, then move the data                  (ring.py ...)

Every byte goes through the wire (wire.py), which stages device arrays and counts bytes.
A kind never keeps state: ``Args`` carries one call's arguments, the communicator its
rank and size.
"""
from __future__ import annotations

import numpy as np

from .. import backend, timeline
from . import algorithm, ledger, ring, sparse
from .layout import bounds_of, check_op, finish, reduce_ufunc, shard_bounds, shard_counts
from .select import FUSED, choose_allreduce, choose_bcast


class Args:
    """One call's arguments (the kinds read the ones they have)."""

    __slots__ = ("op", "root", "algorithm", "out", "wire_dtype", "total", "counts", "extra")

    def __init__(self, op=None, root=None, algorithm="auto", out=None, wire_dtype=None,
                 total=None, counts=None, extra=None):
        self.op, self.root, self.algorithm, self.out = op, root, algorithm, out
        self.wire_dtype, self.total, self.counts, self.extra = wire_dtype, total, counts, extra


class _Shape:
    """What ``ledger.out_problem`` needs of a result it is not given: shape and dtype."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class Kind:
    """A collective. ``open`` -> ``ledger.Call``; ``nbytes`` its payload; FUSED calls
    ``fill`` an exchange of ``payload`` (bytes, dtype) folded by ``fold``, then ``extract``;
    other algorithms ``run``. ``fields`` is the call as its cached key sees it."""

    name = ""
    writes_buf = False            # the call writes into its input (bcast)

    def nbytes(self, c, buf, a) -> int:
        return getattr(buf, "nbytes", 0)

    def label(self, call, a) -> str:          # the algorithm, as the timeline shows it
        return call.algorithm

    def payload(self, c, host, a):
        return host.nbytes, host.dtype

    def fold(self, a):
        return reduce_ufunc(a.op)

    def fields(self, host, a):
        return (self.name, host.size, host.dtype, a.op, -1)

    def fill(self, c, ex, host, a) -> None:
        ex.data[...] = host

    def run(self, c, wire, buf, a, record):
        raise NotImplementedError(f"{self.name} has no long algorithm")


class Allreduce(Kind):
    name = "allreduce"

    def open(self, c, led, buf, blocking, a):
        check_op(a.op)
        choose_allreduce(0, c.size, a.algorithm, env=False)   # an unknown name raises here
        if a.wire_dtype is not None:
            a.wire_dtype, a.algorithm = np.dtype(a.wire_dtype), "ring"
        return led.open("allreduce", buf, blocking=blocking, op=a.op, out=a.out)

    def label(self, call, a):
        return call.algorithm if a.wire_dtype is None else f"ring({a.wire_dtype.name} wire)"

    def extract(self, c, wire, ex, buf, a):
        if a.op == "avg":
            finish(ex.data, a.op, c.size)
        return wire.result(ex.data, buf, a.out)

    def run(self, c, wire, buf, a, record):
        out = a.out
        staged = wire.staged(buf)
        if staged:
            work = wire.stage_in(buf)          # a host copy: reduce there, copy back
        else:
            target = buf if out is None else out
            if out is None:
                target = buf.copy()            # out of place: leave buf as it was
            elif out is not buf:
                out[...] = buf                 # reduce in the caller's out, one copy
            work = target.reshape(-1)
        if c.size > 1 and work.size:
            if a.wire_dtype is not None:
                ring.allreduce_inplace(wire, work, a.op, a.wire_dtype)
            else:
                algorithm.get(a.algorithm).runs["allreduce"](wire, work, a.op)
        return wire.result(work, buf, out) if staged else target


class ReduceScatter(Kind):
    name = "reduce_scatter"

    def open(self, c, led, buf, blocking, a):
        check_op(a.op)
        return led.open("reduce_scatter", buf, blocking=blocking, op=a.op,
                        problem=ledger.counts_problem(a.counts, getattr(buf, "size", 0), c.size))

    def _mine(self, c, length, a):
        if a.counts is not None:
            return bounds_of(a.counts)[c.rank]
        return shard_bounds(length, c.size, c.rank)

    def extract(self, c, wire, ex, buf, a):
        lo, hi = self._mine(c, ex.data.size, a)
        mine = ex.data[lo:hi]
        if a.op == "avg":
            finish(mine, a.op, c.size)
        return wire.stage_out(mine.copy(), buf)

    def run(self, c, wire, buf, a, record):
        work = wire.stage_in(buf).copy()
        lo, hi = self._mine(c, work.size, a)
        if c.size > 1 and work.size:
            bounds = bounds_of(a.counts) if a.counts is not None else None
            algorithm.get(a.algorithm).runs["reduce_scatter"](wire, work, a.op, bounds)
        return wire.stage_out(work[lo:hi].copy(), buf)


class Allgather(Kind):
    """Zeros with this rank's piece in place, OR-folded when short: OR of zeros with one
    rank's bytes is exactly those bytes, for any dtype."""
    name = "allgather"

    def open(self, c, led, shard, blocking, a):
        P, n = c.size, getattr(shard, "size", 0)
        problem = None
        if a.counts is not None:
            a.total = sum(int(x) for x in a.counts)
            problem = ledger.counts_problem(a.counts, a.total, P)
            counts = a.counts = [int(x) for x in a.counts]
        else:
            counts = shard_counts(a.total, P) if a.total is not None else [n] * P
        if problem is None and a.total is not None and counts[c.rank] != n:
            problem = (f"shard has {n} elements, but rank {c.rank}'s shard of a "
                       f"length-{a.total} array over {P} ranks has {counts[c.rank]}")
        a.extra = counts
        if problem is None and a.out is not None:
            problem = ledger.out_problem(a.out, _Shape((sum(counts),), shard.dtype))
        return led.open("allgather", shard, "shard", blocking=blocking,
                        length=a.total if a.total is not None else n, problem=problem)

    def nbytes(self, c, shard, a):
        return sum(a.extra) * getattr(shard, "itemsize", 0)

    def payload(self, c, host, a):
        return sum(a.extra) * host.itemsize, np.uint8

    def fold(self, a):
        return np.bitwise_or

    def fields(self, host, a):
        return ("allgather", a.total if a.total is not None else host.size, host.dtype, None, -1)

    def fill(self, c, ex, host, a):
        lo = sum(a.extra[:c.rank]) * host.itemsize
        ex.data[...] = 0
        ex.data[lo:lo + host.nbytes] = host.view(np.uint8)

    def extract(self, c, wire, ex, shard, a):
        gathered = ex.data.view(shard.dtype)
        if a.out is not None:
            return wire.stage_out(gathered, shard, a.out)
        return wire.stage_out(gathered.copy(), shard)

    def run(self, c, wire, shard, a, record):
        return gather_pieces(c, wire, shard, a.extra, a.out, a.algorithm)


def gather_pieces(c, wire, piece, counts, out=None, name: str = "ring"):
    """Allgather (by algorithm ``name``) of pieces of the given per-rank sizes into one array
    (``out``)."""
    bounds = bounds_of(counts)
    length = bounds[-1][1]
    work = wire.stage_in(piece)
    in_place = out is not None and not wire.staged(out)
    full = out.reshape(-1) if in_place else \
        backend.array_module(work).empty(length, dtype=work.dtype)
    full[bounds[c.rank][0]:bounds[c.rank][1]] = work
    if c.size > 1 and length:
        algorithm.get(name).runs["allgather"](wire, full, bounds)
    if in_place:
        return out
    return wire.stage_out(full, piece, out)


class Allgatherv(Kind):
    name = "allgatherv"

    def open(self, c, led, buf, blocking, a):
        return led.open("allgatherv", buf, blocking=blocking, length=0)

    def nbytes(self, c, buf, a):
        return 0                               # known after the sizes are exchanged

    def run(self, c, wire, buf, a, record):
        counts = np.zeros(c.size, dtype=np.int64)
        counts[c.rank] = buf.size
        ring.allgather_inplace(wire, counts, [(i, i + 1) for i in range(c.size)])
        if record is not None:
            record["bytes"] = int(counts.sum()) * buf.itemsize
        return gather_pieces(c, wire, buf, counts)


class Bcast(Kind):
    """Short: root's bytes and everyone else's zeros, OR-folded."""
    name = "bcast"
    writes_buf = True

    def open(self, c, led, buf, blocking, a):
        choose_bcast(0, c.size, a.algorithm, env=False)       # an unknown name raises here
        call = led.open("bcast", buf, blocking=blocking, root=a.root)
        if call.problem is None and getattr(buf, "flags", None) is not None \
                and not backend.writeable(buf):
            call.problem = "buf is read-only (bcast writes into it)"
        return call

    def payload(self, c, host, a):
        return host.nbytes, np.uint8

    def fold(self, a):
        return np.bitwise_or

    def fields(self, host, a):
        return ("bcast", host.size, host.dtype, None, a.root)

    def fill(self, c, ex, host, a):
        if c.rank == a.root:
            ex.data[...] = host.view(np.uint8)
        else:
            ex.data[...] = 0

    def extract(self, c, wire, ex, buf, a):
        if c.rank != a.root:
            buf.reshape(-1)[...] = wire.stage_out(ex.data.view(buf.dtype), buf)
        return buf

    def run(self, c, wire, buf, a, record):
        work = wire.stage_in(buf)
        if c.size > 1 and work.size:
            algorithm.get(a.algorithm).runs["bcast"](wire, work, a.root)
        if wire.staged(buf):
            buf[...] = wire.stage_out(work, buf).reshape(buf.shape)
        return buf


class Reduce(Kind):
    name = "reduce"

    def open(self, c, led, buf, blocking, a):
        check_op(a.op)
        return led.open("reduce", buf, blocking=blocking, op=a.op, root=a.root)

    def run(self, c, wire, buf, a, record):
        work = wire.stage_in(buf).copy()
        if c.size > 1 and work.size:
            algorithm.get(a.algorithm).runs["reduce"](wire, work, a.root, a.op)
        return wire.stage_out(work, buf).reshape(buf.shape) if c.rank == a.root else None


class Barrier(Kind):
    """The agreement round is itself the barrier: no rank leaves before every rank entered,
    and a rank that calls another collective instead is named rather than matched."""
    name = "barrier"

    def open(self, c, led, buf, blocking, a):
        return led.open("barrier", blocking=blocking)

    def payload(self, c, host, a):
        return 0, np.uint8

    def fold(self, a):
        return None

    def fields(self, host, a):
        return ("barrier", 0, None, None, -1)

    def fill(self, c, ex, host, a):
        pass

    def extract(self, c, wire, ex, buf, a):
        return None


class SparseExchange(Kind):
    """Sum every rank's (index, value) pairs into a dense length-n array (ring allgatherv of
    the pairs); ``buf`` is the values, ``a.extra`` = (indices, n)."""
    name = "sparse_allreduce"

    def open(self, c, led, vals, blocking, a):
        idx, n = a.extra
        return led.open("sparse_allreduce", vals, "vals", blocking=blocking, op=a.op,
                        length=n, k=idx.size)

    def nbytes(self, c, vals, a):             # every rank's pairs reach every rank
        return (getattr(a.extra[0], "nbytes", 0) + getattr(vals, "nbytes", 0)) * c.size

    def run(self, c, wire, vals, a, record):
        idx, n = a.extra
        out = wire.stage_out(sparse.exchange(wire, wire.stage_in(idx, 1),
                                             wire.stage_in(vals, 2), n), vals)
        if a.op == "avg":
            out /= c.size
        return out


ALLREDUCE, REDUCE_SCATTER, ALLGATHER, ALLGATHERV = Allreduce(), ReduceScatter(), Allgather(), Allgatherv()
BCAST, REDUCE, BARRIER, SPARSE = Bcast(), Reduce(), Barrier(), SparseExchange()


class CachedPlan:
    """A blocking short call as made before: its exchange's shape, fold and key, so the next
    call of the same kind, size, dtype and arguments goes straight to the exchange."""

    __slots__ = ("kind", "args", "payload", "fold", "fields", "static", "check_out", "writes",
                 "args_out")

    def __init__(self, kind, buf, a):
        host = None if buf is None else buf.reshape(-1)
        self.kind, self.writes = kind, kind.writes_buf
        # the call's arguments but ``out`` (which the key leaves out): the same for every
        # call this plan takes
        self.args = Args(a.op, a.root, a.algorithm, None, None, a.total, None, a.extra)
        self.args_out = Args(a.op, a.root, a.algorithm, None, None, a.total, None, a.extra)
        self.payload = kind.payload(None, host, a)
        self.fold, self.fields = kind.fold(a), kind.fields(host, a)
        self.static = ledger.static_key(self.fields[0], True, FUSED, *self.fields[1:],
                                        -1, True)
        self.check_out = a.out is not None

    def fits(self, buf, out) -> bool:
        """Whether this call may take the plan: what the key leaves out still holds."""
        if not buf.flags.c_contiguous or timeline._active is not None:
            return False
        if self.check_out and out is not buf and not (
                type(out) is np.ndarray and out.shape == buf.shape and out.dtype == buf.dtype
                and out.flags.c_contiguous and out.flags.writeable):
            return False
        return not self.writes or buf.flags.writeable

    def run(self, c, buf, out):
        wire, kind, a = c._wire, self.kind, self.args
        if out is not None:                  # (blocking calls: one at a time)
            a = self.args_out
            a.out = out
        ex = wire.exchanges.get(*self.payload)
        kind.fill(c, ex, None if buf is None else buf.reshape(-1), a)
        c._ledger.agree_static(wire.exchanges, ex, self.fold, self.static, self.fields)
        return kind.extract(c, wire, ex, buf, a)
