"""The collectives, one class each: how a call is checked, what its short payload is, and how
its long algorithms run. ``dispatch.collective`` walks every call through them in one order
(check -> choose -> short exchange | algorithm -> wire). A kind has six hooks:

    check       this rank's arguments, as the ledger records them             (ledger.py)
    nbytes      the payload's size, for the choice of algorithm               (select.py)
    short_form  the short exchange's (bytes, dtype), its fold and the call as its cached
                key sees it; ``fill`` puts this rank's part in, ``extract`` takes the result out
    run         any other algorithm: move the data                            (ring.py ...)

The rest of this design: docs/communication.md, "hpcdist/comm/collectives.py"."""
from __future__ import annotations

import numpy as np

from ..device import backend
from . import alltoall, ledger, registry, ring, sparse
from .arith import bounds_of, check_op, finish, reduce_ufunc, shard_bounds, shard_counts


class Args:
    """One call's arguments (the kinds read the ones they have)."""

    __slots__ = ("op", "root", "algorithm", "out", "wire_dtype", "total", "counts", "extra",
                 "rank", "size")

    def __init__(self, op=None, root=None, algorithm="auto", out=None, wire_dtype=None,
                 total=None, *, counts=None, extra=None, rank=0, size=1):
        self.op, self.root, self.algorithm, self.out = op, root, algorithm, out
        self.wire_dtype, self.total, self.counts, self.extra = wire_dtype, total, counts, extra
        self.rank, self.size = rank, size


class _Shape:
    """What ``ledger.out_problem`` needs of a result it is not given: shape and dtype."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class Kind:
    """A collective (the module docstring lists its hooks)."""

    name = ""
    writes_buf = False            # the call writes into its input (bcast)

    def nbytes(self, buf, a) -> int:
        return getattr(buf, "nbytes", 0)

    def check(self, buf, a) -> dict:
        """This call's checks (a bad one raises, or returns it as "problem", which every
        rank learns in the agreement) and what the ledger records of it: ``Ledger.open``'s
        keyword arguments."""
        raise NotImplementedError

    def short_form(self, host, a):
        """(payload bytes, payload dtype, fold ufunc, the call's fields: kind, length, dtype,
        op, root) of the short exchange of this rank's ``host`` array."""
        return host.nbytes, host.dtype, reduce_ufunc(a.op), (self.name, host.size,
                                                              host.dtype, a.op, -1)

    def fill(self, ex, host, a) -> None:
        ex.data[...] = host

    def extract(self, wire, ex, buf, a):
        """The result, out of the short exchange ``ex`` (every rank's ``fill`` folded)."""
        raise NotImplementedError(f"{self.name} has no short form")

    def run(self, wire, buf, a, record):
        raise NotImplementedError(f"{self.name} has no long algorithm")


class Allreduce(Kind):
    name = "allreduce"

    def check(self, buf, a):
        check_op(a.op)
        if a.wire_dtype is not None:
            a.wire_dtype, a.algorithm = np.dtype(a.wire_dtype), "ring"
        return {"op": a.op, "out": a.out}

    def extract(self, wire, ex, buf, a):
        if a.op == "avg":
            finish(ex.data, a.op, a.size)
        return wire.result(ex.data, buf, a.out)

    def run(self, wire, buf, a, record):
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
        if a.size > 1 and work.size:
            if a.wire_dtype is not None:
                ring.allreduce_inplace(wire, work, a.op, a.wire_dtype)
            else:
                registry.get(a.algorithm).runs["allreduce"](wire, work, a.op)
        return wire.result(work, buf, out) if staged else target


class ReduceScatter(Kind):
    name = "reduce_scatter"

    def check(self, buf, a):
        check_op(a.op)
        return {"op": a.op,
                "problem": ledger.counts_problem(a.counts, getattr(buf, "size", 0), a.size)}

    def _mine(self, length, a):
        if a.counts is not None:
            return bounds_of(a.counts)[a.rank]
        return shard_bounds(length, a.size, a.rank)

    def extract(self, wire, ex, buf, a):
        lo, hi = self._mine(ex.data.size, a)
        mine = ex.data[lo:hi]
        if a.op == "avg":
            finish(mine, a.op, a.size)
        return wire.stage_out(mine.copy(), buf)

    def run(self, wire, buf, a, record):
        work = wire.stage_in(buf).copy()
        lo, hi = self._mine(work.size, a)
        if a.size > 1 and work.size:
            bounds = bounds_of(a.counts) if a.counts is not None else None
            registry.get(a.algorithm).runs["reduce_scatter"](wire, work, a.op, bounds)
        return wire.stage_out(work[lo:hi].copy(), buf)


class Allgather(Kind):
    """Zeros with this rank's piece in place, OR-folded when short: OR of zeros with one
    rank's bytes is exactly those bytes, for any dtype."""
    name = "allgather"

    def check(self, shard, a):
        P, n = a.size, getattr(shard, "size", 0)
        problem = None
        if a.counts is not None:
            a.total = sum(int(x) for x in a.counts)
            problem = ledger.counts_problem(a.counts, a.total, P)
            counts = a.counts = [int(x) for x in a.counts]
        else:
            counts = shard_counts(a.total, P) if a.total is not None else [n] * P
        if problem is None and a.total is not None and counts[a.rank] != n:
            problem = (f"shard has {n} elements, but rank {a.rank}'s shard of a "
                       f"length-{a.total} array over {P} ranks has {counts[a.rank]}")
        a.extra = counts
        if problem is None and a.out is not None:
            problem = ledger.out_problem(a.out, _Shape((sum(counts),), shard.dtype))
        return {"name": "shard", "length": a.total if a.total is not None else n,
                "problem": problem}

    def nbytes(self, shard, a):
        return sum(a.extra) * getattr(shard, "itemsize", 0)

    def short_form(self, host, a):
        return sum(a.extra) * host.itemsize, np.uint8, np.bitwise_or, (
            "allgather", a.total if a.total is not None else host.size, host.dtype, None, -1)

    def fill(self, ex, host, a):
        lo = sum(a.extra[:a.rank]) * host.itemsize
        ex.data[...] = 0
        ex.data[lo:lo + host.nbytes] = host.view(np.uint8)

    def extract(self, wire, ex, shard, a):
        gathered = ex.data.view(shard.dtype)
        if a.out is not None:
            return wire.stage_out(gathered, shard, a.out)
        return wire.stage_out(gathered.copy(), shard)

    def run(self, wire, shard, a, record):
        return gather_pieces(a, wire, shard, a.extra, a.out, a.algorithm)


def gather_pieces(a, wire, piece, counts, out=None, name: str = "ring"):
    """Allgather (by algorithm ``name``) of pieces of the given per-rank sizes into one array
    (``out``)."""
    bounds = bounds_of(counts)
    length = bounds[-1][1]
    work = wire.stage_in(piece)
    in_place = out is not None and not wire.staged(out)
    full = out.reshape(-1) if in_place else \
        backend.array_module(work).empty(length, dtype=work.dtype)
    full[bounds[a.rank][0]:bounds[a.rank][1]] = work
    if a.size > 1 and length:
        registry.get(name).runs["allgather"](wire, full, bounds)
    if in_place:
        return out
    return wire.stage_out(full, piece, out)


class Allgatherv(Kind):
    name = "allgatherv"

    def check(self, buf, a):
        return {"length": 0}

    def nbytes(self, buf, a):
        return 0                               # known after the sizes are exchanged

    def run(self, wire, buf, a, record):
        counts = np.zeros(a.size, dtype=np.int64)
        counts[a.rank] = buf.size
        ring.allgather_inplace(wire, counts, [(i, i + 1) for i in range(a.size)])
        if record is not None:
            record["bytes"] = int(counts.sum()) * buf.itemsize
        return gather_pieces(a, wire, buf, counts)


class Bcast(Kind):
    """Short: root's bytes and everyone else's zeros, OR-folded."""
    name = "bcast"
    writes_buf = True

    def check(self, buf, a):
        valid = ledger.argument_problem(buf, "buf", a.root, a.size) is None
        read_only = valid and getattr(buf, "flags", None) is not None \
            and not backend.writeable(buf)
        return {"root": a.root,
                "problem": "buf is read-only (bcast writes into it)" if read_only else None}

    def short_form(self, host, a):
        return host.nbytes, np.uint8, np.bitwise_or, ("bcast", host.size, host.dtype, None,
                                                      a.root)

    def fill(self, ex, host, a):
        if a.rank == a.root:
            ex.data[...] = host.view(np.uint8)
        else:
            ex.data[...] = 0

    def extract(self, wire, ex, buf, a):
        if a.rank != a.root:
            buf.reshape(-1)[...] = wire.stage_out(ex.data.view(buf.dtype), buf)
        return buf

    def run(self, wire, buf, a, record):
        work = wire.stage_in(buf)
        if a.size > 1 and work.size:
            registry.get(a.algorithm).runs["bcast"](wire, work, a.root)
        if wire.staged(buf):
            buf[...] = wire.stage_out(work, buf).reshape(buf.shape)
        return buf


class Reduce(Kind):
    name = "reduce"

    def check(self, buf, a):
        check_op(a.op)
        return {"op": a.op, "root": a.root}

    def run(self, wire, buf, a, record):
        work = wire.stage_in(buf).copy()
        if a.size > 1 and work.size:
            registry.get(a.algorithm).runs["reduce"](wire, work, a.root, a.op)
        return wire.stage_out(work, buf).reshape(buf.shape) if a.rank == a.root else None


class Barrier(Kind):
    """The agreement round is itself the barrier: no rank leaves before every rank entered,
    and a rank that calls another collective instead is named rather than matched."""
    name = "barrier"

    def check(self, buf, a):
        return {}

    def short_form(self, host, a):
        return 0, np.uint8, None, ("barrier", 0, None, None, -1)

    def fill(self, ex, host, a):
        pass

    def extract(self, wire, ex, buf, a):
        return None


class Alltoall(Kind):
    """Piece j of this rank's buffer to rank j; the pieces from every rank, in rank order, as
    views of one array. ``a.counts``: the pieces' sizes (None: P equal pieces, whose size
    the agreement checks alike on every rank); ``a.extra``: the sizes coming in (None: sent
    first, one number per peer). The v-form runs pairwise under "auto": its sizes differ by
    rank, and the choice must be every rank's."""
    name = "alltoall"

    def check(self, buf, a):
        n, P = getattr(buf, "size", 0), a.size
        problem = ledger.counts_problem(a.counts, n, P) or alltoall.unequal_problem(
            n, a.counts, P)
        if problem is None and a.extra is not None and (
                len(a.extra) != P or any(int(c) < 0 for c in a.extra)):
            problem = f"recv_counts must give {P} non-negative sizes, got {list(a.extra)}"
        if a.counts is not None and a.algorithm == "auto":
            a.algorithm = "pairwise"
        return {"length": n if a.counts is None else -1, "problem": problem}

    def run(self, wire, buf, a, record):
        send = wire.stage_in(buf).reshape(-1)
        P = a.size
        counts = [send.size // P] * P if a.counts is None else [int(c) for c in a.counts]
        incoming = counts if a.counts is None else a.extra
        if incoming is None:                    # the sizes first: one number per peer
            incoming = np.empty(P, dtype=np.int64)
            registry.get(a.algorithm).runs["alltoall"](
                wire, np.array(counts, dtype=np.int64), [1] * P, incoming, [1] * P)
        incoming = [int(c) for c in incoming]
        out = backend.array_module(send).empty(sum(incoming), dtype=send.dtype)
        if P > 1:
            registry.get(a.algorithm).runs["alltoall"](wire, send, counts, out, incoming,
                                                        a.counts is None)
        else:
            out[...] = send
        return alltoall.split(wire.stage_out(out, buf), incoming)


class SparseExchange(Kind):
    """Sum every rank's (index, value) pairs into a dense length-n array (ring allgatherv of
    the pairs); ``buf`` is the values, ``a.extra`` = (indices, n)."""
    name = "sparse_allreduce"

    def check(self, vals, a):
        idx, n = a.extra
        return {"name": "vals", "op": a.op, "length": n, "k": idx.size}

    def nbytes(self, vals, a):             # every rank's pairs reach every rank
        return (getattr(a.extra[0], "nbytes", 0) + getattr(vals, "nbytes", 0)) * a.size

    def run(self, wire, vals, a, record):
        idx, n = a.extra
        out = wire.stage_out(sparse.exchange(wire, wire.stage_in(idx, 1),
                                             wire.stage_in(vals, 2), n), vals)
        if a.op == "avg":
            out /= a.size
        return out


ALLREDUCE, REDUCE_SCATTER, ALLGATHER, ALLGATHERV = Allreduce(), ReduceScatter(), Allgather(), Allgatherv()
BCAST, REDUCE, BARRIER, SPARSE = Bcast(), Reduce(), Barrier(), SparseExchange()
ALLTOALL = Alltoall()
