"""Communicator: hpcdist's collectives over an mpi4py communicator.

Every collective here is one of our algorithms built on MPI point-to-point calls; MPI's own
collectives are only the oracle in tests and the baseline in benchmarks. Arrays cross MPI as
raw bytes (any dtype, fp16 and bf16 included); reductions run in the array's own module.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os

import numpy as np
from mpi4py import MPI

from .. import backend, threads, timeline
from . import abort, check, p2p, ring, short, sparse, tree, watchdog
from .wire import Wire
from .handle import Handle, _Done
from .layout import OPS, check_op, finish, reduce_ufunc, shard_bounds, shard_counts
from .select import (ALLREDUCE_ALGORITHMS, BCAST_ALGORITHMS, FUSED, SHORT_ALLGATHER,  # noqa: F401
                     SHORT_ALLREDUCE, SHORT_BCAST, SHORT_REDUCE_SCATTER, allreduce_wire_bytes,
                     choose_allreduce, choose_bcast)


def cuda_aware() -> bool:
    """Whether MPI can read GPU buffers directly (HPCDIST_CUDA_AWARE=0|1 overrides)."""
    env = os.environ.get("HPCDIST_CUDA_AWARE")
    if env in ("0", "1"):
        return env == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


class _Shape:
    """What ``check.out_problem`` needs of a result it is not given: shape and dtype."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class Communicator:
    """Collectives, point-to-point and sparse exchange over ``mpi_comm`` (default COMM_WORLD).

    Construction is collective: every rank of ``mpi_comm`` must construct it, in the same order.
    """

    def __init__(self, mpi_comm=None, abort_on_error: bool | None = None):
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        if mpi_comm is None:                 # the world: this node's ranks share its cores
            threads.configure(self.local_size)
        # Safe by default: an uncaught exception on any rank, in any thread, ends the job
        # (opt out: abort_on_error=False or HPCDIST_ABORT=0); the watchdog enforces deadlines.
        if abort_on_error is None:
            abort_on_error = os.environ.get("HPCDIST_ABORT", "1") != "0"
        if abort_on_error:
            abort.install()
        if self.size > 1 and MPI.Comm.Compare(self.mpi, MPI.COMM_WORLD) == MPI.IDENT:
            watchdog.start(MPI.COMM_WORLD)
        self.label = check.communicator_label(self.mpi)
        self._peers = "all ranks" if self.label == "world" else self.label
        self._seq = 0                        # the ledger: calls made on this communicator
        self._handles: list = []             # non-blocking calls not yet waited
        # Non-blocking collectives run on their own duplicate, in a progress thread, so their
        # messages can never match a blocking call's.
        self._bg_mpi = self.mpi.Dup()
        # Point-to-point has its own duplicate too: user tags never meet collective traffic.
        self._p2p_mpi = self.mpi.Dup()
        # Every byte reaches MPI through a wire (wire.py): it refuses unstaged device arrays
        # and counts what is sent. One per MPI communicator: the caller's thread uses
        # _wire, the progress thread _bg_wire, point-to-point _p2p_wire.
        self.cuda_aware = cuda_aware()
        self._wire, self._bg_wire, self._p2p_wire = (
            Wire(c, self.cuda_aware) for c in (self.mpi, self._bg_mpi, self._p2p_mpi))
        # The agreement's exchanges (short.py), one set per wire.
        self._exchanges = {id(w): short.Exchanges(w) for w in (self._wire, self._bg_wire)}
        self._send_seq: dict = {}            # dest -> messages sent (payload tags)
        self._executor = None
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.debug = os.environ.get("HPCDIST_DEBUG", "0") == "1"
        # Algorithms forced for "auto" (read once here: the environment is slow per call).
        self._auto = {"allreduce": os.environ.get("HPCDIST_ALLREDUCE", "auto"),
                      "bcast": os.environ.get("HPCDIST_BCAST", "auto")}
        # Blocking short calls may take the lean path (see "collectives").
        self._static_keys: dict = {}     # a lean call's fields -> check.static_key
        self._lean_wait = watchdog.Wait(self.label, 0, "", 0, self._peers)
        self.sparse_stats = sparse.SparseStats()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has handed to MPI to send, counted at the wires
        (collectives, their short exchanges' data and point-to-point; not the agreement's
        16-byte keys)."""
        return self._wire.sent + self._bg_wire.sent + self._p2p_wire.sent

    @contextlib.contextmanager
    def uncounted(self):
        """Blocking calls inside are left out of ``bytes_sent`` (a benchmark's probe)."""
        sent = self._wire.sent
        try:
            yield
        finally:
            self._wire.sent = sent

    def __repr__(self):
        return f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """A Communicator over the ranks that pass the same ``color``, ordered by ``key``."""
        return Communicator(self.mpi.Split(color, self.rank if key is None else key))

    # ---- argument handling and the ledger ------------------------------------------------
    def _problem(self, buf, name: str, root: int | None = None) -> str | None:
        return check.argument_problem(buf, name, root, self.size)

    def _call(self, kind, buf=None, name="buf", blocking=True, op=None, root=None, length=None,
              k=-1, problem=None, out=None) -> check.Call:
        """This rank's side of the next call on this communicator (in the caller's thread, so
        blocking and non-blocking calls share one numbering). Raises here an error of an
        earlier non-blocking call that nobody waited for."""
        self._raise_unretrieved()
        self._seq += 1
        watchdog.note_call(self.label, self._seq)
        if kind != "barrier":
            problem = self._problem(buf, name, root) or problem
            if problem is None and out is not None and out is not buf:
                problem = check.out_problem(out, buf)
        ok = problem is None and buf is not None
        return check.Call(
            kind, self._seq, blocking,
            length=(length if length is not None else buf.size) if ok else 0,
            dtype=buf.dtype if ok else None, op=op, root=-1 if root is None else root, k=k,
            problem=problem, shape=buf.shape if ok else None,
            where=check.caller() if self.debug else None)

    def _submit(self, call, fn, nbytes: int = 0, algorithm: str = "", info: bool = False,
                fused: bool = False):
        """Run ``fn(mpi)`` after the agreement on ``call``: now, or in the progress thread.
        The wait is registered with the watchdog; ``info``: ``fn`` also takes the timeline's
        record (to fill in bytes known only later); ``fused``: ``fn`` carries its data in the
        agreement itself (``_agree``)."""
        label = self.label

        def run(mpi):
            kind = call.kind if call.blocking else f"{call.kind} (non-blocking)"
            wait = watchdog.enter(label, call.seq, kind, nbytes, self._peers)
            try:
                with timeline.collective(call.kind, algorithm, nbytes, self.size) as record:
                    if fused:                # agrees first, then only local work is left
                        return fn(mpi, record) if info else fn(mpi)
                    self._agree(mpi, call)   # a mismatch raises alike on every rank
                    try:
                        return fn(mpi, record) if info else fn(mpi)
                    except BaseException as e:
                        if not call.blocking:   # peers may be mid-exchange: end the job
                            abort.fatal(f"non-blocking call #{call.seq} {call.kind} failed "
                                        f"in the progress thread: {type(e).__name__}: {e}", e)
                        raise
            finally:
                watchdog.leave(wait)
        if call.blocking:
            return run(self._wire)
        if self.size == 1:        # nothing to wait for: done now, no progress-thread handoff
            return Handle(_Done(lambda: run(self._bg_wire)), self, call)   # (13% of a DDP
        return Handle(self._run(run), self, call)                       # step at 1 rank)

    def agree_only(self, kind: str, buf, op=None, root=None) -> None:
        """The ledger's agreement on a collective whose data moves elsewhere (the NCCL
        backend): numbered, checked and agreed like ours, then nothing is exchanged."""
        self._agree(self._wire, self._call(kind, buf, op=op, root=root))

    def _agree(self, mpi, call, payload=None, fold=None) -> None:
        """The ledger's agreement on ``call`` (check.agree), carrying ``payload`` (a filled
        short.Exchange, folded with the ufunc ``fold``) for short collectives."""
        check.agree(self._exchanges[id(mpi)], call, self.label, payload, fold)

    def _forget(self, handle) -> None:
        self._handles = [h for h in self._handles if h is not handle and not h._waited]

    def _raise_unretrieved(self) -> None:
        if not self._handles:
            return
        for h in list(self._handles):
            e = h._unretrieved_error()
            if e is not None:
                h._waited = True
                self._forget(h)
                raise type(e)(f"an earlier non-blocking call #{h._call.seq} {h._call.kind} "
                              f"failed and was not waited for: {e}") from e
        self._handles = [h for h in self._handles if not h._future.done()]

    def _stage_in(self, buf, key: int = 0):
        """A flat buffer MPI may read: a device array's values in a reused pinned host
        buffer (``key`` tells two staged at once apart; valid until the next staging with
        the same key on this thread) unless MPI is CUDA-aware, else a view of ``buf``."""
        if backend.is_gpu_array(buf) and not self.cuda_aware:
            return backend.to_host(buf, key)  # synchronizes the producing stream
        return buf.reshape(-1)

    def _staged(self, buf) -> bool:
        """True when ``_stage_in(buf)`` is a host copy rather than a view of ``buf``."""
        return backend.is_gpu_array(buf) and not self.cuda_aware

    def _stage_out(self, host, like, out=None):
        """A staged result back on ``like``'s device (a new array, or into ``out``)."""
        if backend.is_gpu_array(like) and not backend.is_gpu_array(host):
            return backend.from_host(host, like, out)
        if out is not None:
            out.reshape(-1)[...] = host.reshape(-1)
            return out
        return host

    def _run(self, fn):
        """A future of ``fn(bg_mpi)`` in the progress thread (or run now without threads)."""
        if not self.threaded:
            # No MPI_THREAD_MULTIPLE: run now (correct, no overlap), in call order.
            return _Done(lambda: fn(self._bg_wire))
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"hpcdist-comm-{self.rank}")
        return self._executor.submit(fn, self._bg_wire)

    # ---- collectives --------------------------------------------------------------------
    # Short calls carry their data in the agreement (short.py): one recursive doubling in all.
    # Blocking short calls on host arrays take a lean path (``_lean``) that skips _call and
    # _submit — their layers cost as much as the exchange (bench collectives, 8 B: 9.5 us of
    # 16 us at N=2); non-blocking, GPU and timed calls take the general path. Both number the
    # call, compute its key and send its messages alike (``_exchange``).

    def _lean(self, buf) -> bool:
        """Whether a blocking call on ``buf`` may take the lean path."""
        return (self.size > 1 and type(buf) is np.ndarray and buf.flags.c_contiguous
                and buf.dtype in p2p.KNOWN and not self.debug and timeline.active() is None)

    def _exchange(self, mpi, ex, fold, call, fields) -> None:
        """Agree on a short call and fold its payload (``ex``, filled). ``call``: the general
        path's numbered call; None: a lean call, numbered here, whose key comes from
        ``fields`` = (kind, length, dtype, op, root) as ``check.Call.key`` would make it."""
        mpi.sent += ex.sent                    # the payload travels in the agreement
        if call is not None:
            self._agree(mpi, call, ex, fold)
            return
        if self._handles:
            self._raise_unretrieved()
        self._seq = seq = self._seq + 1
        watchdog.note_call(self.label, seq)
        static = self._static_keys.get(fields)
        if static is None:
            kind, length, dtype, op, root = fields
            static = self._static_keys[fields] = check.static_key(
                kind, True, FUSED, length, dtype, op, root, -1, True)
        wait = self._lean_wait
        wait.seq, wait.kind, wait.nbytes = seq, fields[0], ex.data.nbytes
        if not ex.run(hash((seq, static)) & check.KEY_MASK, fold, wait):
            kind, length, dtype, op, root = fields
            check.mismatch(mpi, check.Call(kind, seq, True, length, dtype, op, root,
                                           algorithm=FUSED), self.label)

    def _fused(self, call, buf, nbytes: int, limit: int) -> bool:
        """Whether a general-path call carries its data in the agreement (and says so in
        its key)."""
        if (call.problem is None and self.size > 1 and nbytes <= limit
                and (self._staged(buf) or not backend.is_gpu_array(buf))):
            call.algorithm = FUSED
        return call.algorithm == FUSED

    def _result(self, flat, buf, out=None):
        """A flat result shaped like ``buf`` on ``buf``'s device, in ``out`` when one is given
        (else a new array: ``flat`` may be a buffer that the next call reuses)."""
        if out is not None:
            return self._stage_out(flat, out, out)
        if self._staged(buf):
            return self._stage_out(flat, buf).reshape(buf.shape)
        return flat.reshape(buf.shape).copy()

    # allreduce
    def allreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                  wire_dtype=None):
        """Reduce ``buf`` over all ranks; every rank gets the result (a new array unless
        ``out`` is given — ``out=buf`` reduces in place).

        ``wire_dtype`` (e.g. "float16") sends that dtype while reducing in ``buf``'s dtype;
        it runs the ring algorithm.
        """
        if (wire_dtype is None and algorithm == "auto" and op in OPS
                and self._lean(buf) and buf.nbytes <= SHORT_ALLREDUCE
                and self._auto["allreduce"] in ("auto", "recursive_doubling")
                and (out is None or (type(out) is np.ndarray and out.shape == buf.shape
                                     and out.dtype == buf.dtype and out.flags.c_contiguous
                                     and backend.writeable(out)))):
            return self._short_allreduce(self._wire, None, buf, op, out)
        return self._allreduce(buf, op, algorithm, out, wire_dtype, blocking=True)

    def iallreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                   wire_dtype=None) -> Handle:
        """Non-blocking allreduce: progresses in a background thread; ``wait()`` -> result.
        Do not touch ``buf`` (or ``out``) until then."""
        return self._allreduce(buf, op, algorithm, out, wire_dtype, blocking=False)

    def _short_allreduce(self, mpi, call, buf, op, out=None):
        host = self._stage_in(buf)
        ex = self._exchanges[id(mpi)].get(host.nbytes, host.dtype)
        ex.data[...] = host
        self._exchange(mpi, ex, reduce_ufunc(op), call, ("allreduce", host.size, host.dtype, op, -1))
        if op == "avg":
            finish(ex.data, op, self.size)
        return self._result(ex.data, buf, out)

    def _allreduce(self, buf, op, algorithm, out, wire_dtype, blocking):
        check_op(op)
        nbytes = getattr(buf, "nbytes", 0)
        name = choose_allreduce(nbytes, self.size, self._auto["allreduce"]
                                if algorithm == "auto" else algorithm, env=False)
        if wire_dtype is not None:
            wire_dtype = np.dtype(wire_dtype)
            name = "ring"
        call = self._call("allreduce", buf, blocking=blocking, op=op, out=out)
        call.algorithm = name
        fused = name == "recursive_doubling" and self._fused(call, buf, nbytes, SHORT_ALLREDUCE)
        name = call.algorithm
        label = name if wire_dtype is None else f"ring({wire_dtype.name} wire)"
        if fused:
            return self._submit(call, lambda mpi: self._short_allreduce(mpi, call, buf, op, out),
                                nbytes, label, fused=True)

        def run(mpi):
            staged = self._staged(buf)
            if staged:
                work = self._stage_in(buf)     # a host copy: reduce there, copy back
            else:
                target = buf if out is None else out
                if out is None:
                    target = buf.copy()        # out of place: leave buf as it was
                elif out is not buf:
                    out[...] = buf             # reduce in the caller's out, one copy
                work = target.reshape(-1)
            if self.size > 1 and work.size:
                if wire_dtype is not None:
                    ring.allreduce_inplace(mpi, work, op, wire_dtype)
                else:
                    ALLREDUCE_ALGORITHMS[name](mpi, work, op)
            if not staged:
                return target
            return self._result(work, buf, out)
        return self._submit(call, run, nbytes, label)

    # reduce-scatter
    def reduce_scatter(self, buf, op: str = "sum", counts=None):
        """This rank's shard of the reduction of ``buf``: the shard layout (layout.py), or
        ``counts[r]`` elements for rank r, in rank order (e.g. whole sequence rows)."""
        if (counts is None and op in OPS and self._lean(buf)
                and buf.nbytes <= SHORT_REDUCE_SCATTER):
            return self._short_reduce_scatter(self._wire, None, buf, op, None)
        return self._reduce_scatter(buf, op, counts, blocking=True)

    def ireduce_scatter(self, buf, op: str = "sum", counts=None) -> Handle:
        return self._reduce_scatter(buf, op, counts, blocking=False)

    @staticmethod
    def _bounds(counts):
        out, off = [], 0
        for c in counts:
            out.append((off, off + int(c)))
            off += int(c)
        return out

    def _my_bounds(self, length: int, counts) -> tuple[int, int]:
        if counts is not None:
            return self._bounds(counts)[self.rank]
        return shard_bounds(length, self.size, self.rank)

    def _short_reduce_scatter(self, mpi, call, buf, op, counts):
        """The whole buffer reduced by the agreement's exchange; this rank keeps its shard."""
        host = self._stage_in(buf)
        ex = self._exchanges[id(mpi)].get(host.nbytes, host.dtype)
        ex.data[...] = host
        self._exchange(mpi, ex, reduce_ufunc(op), call,
                       ("reduce_scatter", host.size, host.dtype, op, -1))
        lo, hi = self._my_bounds(host.size, counts)
        mine = ex.data[lo:hi]
        if op == "avg":
            finish(mine, op, self.size)
        return self._stage_out(mine.copy(), buf)

    def _reduce_scatter(self, buf, op, counts, blocking):
        check_op(op)
        call = self._call("reduce_scatter", buf, blocking=blocking, op=op,
                          problem=check.counts_problem(counts, getattr(buf, "size", 0), self.size))
        nbytes = getattr(buf, "nbytes", 0)
        if self._fused(call, buf, nbytes, SHORT_REDUCE_SCATTER):
            return self._submit(
                call, lambda mpi: self._short_reduce_scatter(mpi, call, buf, op, counts),
                nbytes, FUSED, fused=True)

        def run(mpi):
            work = self._stage_in(buf).copy()
            bounds = self._bounds(counts) if counts is not None else None
            lo, hi = self._my_bounds(work.size, counts)
            if self.size > 1 and work.size:
                ring.reduce_scatter_inplace(mpi, work, op, bounds=bounds)
            return self._stage_out(work[lo:hi].copy(), buf)
        return self._submit(call, run, nbytes, "ring")

    # allgather
    def allgather(self, shard, total: int | None = None, counts=None, out=None):
        """Concatenation of every rank's 1-D ``shard``.

        With ``total``, shards follow the shard layout of a length-``total`` array (the last
        ones may be shorter or empty); with ``counts``, rank r's shard has ``counts[r]``
        elements; with neither, every shard must have the same length. ``out``: a 1-D array
        of the gathered length to gather into (``shard`` may be a view of its own part).
        """
        if counts is None and out is None and self._lean(shard):
            n = shard.size
            gathered = n * self.size if total is None else total     # as _allgather decides
            lo, hi = (0, n) if total is None else shard_bounds(total, self.size, self.rank)
            if gathered * shard.itemsize <= SHORT_ALLGATHER and hi - lo == n:
                return self._short_allgather(self._wire, None, shard, total, None)
        return self._allgather(shard, total, blocking=True, counts=counts, out=out)

    def iallgather(self, shard, total: int | None = None, counts=None, out=None) -> Handle:
        return self._allgather(shard, total, blocking=False, counts=counts, out=out)

    def _short_allgather(self, mpi, call, shard, total, counts, out=None):
        """Zeros with this rank's piece in place, OR-folded by the agreement's exchange:
        OR of zeros with one rank's bytes is exactly those bytes, for any dtype."""
        host = self._stage_in(shard)
        P, item = self.size, host.itemsize
        if counts is not None:
            lo = sum(counts[:self.rank])
            length = sum(counts)
        elif total is not None:
            lo, length = shard_bounds(total, P, self.rank)[0], total
        else:
            lo, length = self.rank * host.size, host.size * P
        ex = self._exchanges[id(mpi)].get(length * item, np.uint8)
        ex.data[...] = 0
        ex.data[lo * item:lo * item + host.nbytes] = host.view(np.uint8)
        self._exchange(mpi, ex, np.bitwise_or, call,
                       ("allgather", length if total is not None or counts is not None
                        else host.size, host.dtype, None, -1))
        if out is not None:
            return self._stage_out(ex.data.view(host.dtype), shard, out)
        return self._stage_out(ex.data.view(host.dtype).copy(), shard)

    def _allgather(self, shard, total, blocking, counts=None, out=None):
        P, n = self.size, getattr(shard, "size", 0)
        problem = None
        if counts is not None:
            total = sum(int(c) for c in counts)
            problem = check.counts_problem(counts, total, P)
            counts = [int(c) for c in counts]
        else:
            counts = shard_counts(total, P) if total is not None else [n] * P
        if problem is None and total is not None and counts[self.rank] != n:
            problem = (f"shard has {n} elements, but rank {self.rank}'s shard of a "
                       f"length-{total} array over {P} ranks has {counts[self.rank]}")
        length = sum(counts)
        if problem is None and out is not None:
            problem = check.out_problem(out, _Shape((length,), shard.dtype))
        call = self._call("allgather", shard, "shard", blocking=blocking,
                          length=total if total is not None else n, problem=problem)
        nbytes = length * getattr(shard, "itemsize", 0)
        if self._fused(call, shard, nbytes, SHORT_ALLGATHER):
            return self._submit(
                call, lambda mpi: self._short_allgather(mpi, call, shard, total, counts, out),
                nbytes, FUSED, fused=True)
        return self._submit(call, lambda mpi: self._gather_pieces(mpi, shard, counts, out),
                            nbytes, "ring")

    def _gather_pieces(self, mpi, piece, counts, out=None):
        """Ring allgather of pieces of the given per-rank sizes into one array (``out``)."""
        bounds = self._bounds(counts)
        off = bounds[-1][1]
        work = self._stage_in(piece)
        in_place = out is not None and not self._staged(out)
        full = out.reshape(-1) if in_place else \
            backend.array_module(work).empty(off, dtype=work.dtype)
        full[bounds[self.rank][0]:bounds[self.rank][1]] = work
        if self.size > 1 and off:
            ring.allgather_inplace(mpi, full, bounds)
        if in_place:
            return out
        return self._stage_out(full, piece, out)

    def allgatherv(self, buf):
        """Concatenation of every rank's 1-D ``buf``, lengths free to differ."""
        call = self._call("allgatherv", buf, length=0)

        def run(mpi, record):
            counts = np.zeros(self.size, dtype=np.int64)
            counts[self.rank] = buf.size
            ring.allgather_inplace(mpi, counts, [(i, i + 1) for i in range(self.size)])
            if record is not None:
                record["bytes"] = int(counts.sum()) * buf.itemsize
            return self._gather_pieces(mpi, buf, counts)
        return self._submit(call, run, 0, "ring", info=True)

    # broadcast
    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        """Overwrite ``buf`` on every rank with root's ``buf`` (in place); returns ``buf``."""
        if (algorithm == "auto" and self._auto["bcast"] == "auto" and self._lean(buf)
                and buf.nbytes <= SHORT_BCAST and backend.writeable(buf)
                and type(root) is int and 0 <= root < self.size):
            return self._short_bcast(self._wire, None, buf, root)
        name = choose_bcast(getattr(buf, "nbytes", 0), self.size, self._auto["bcast"]
                            if algorithm == "auto" else algorithm, env=False)
        call = self._call("bcast", buf, root=root)
        if call.problem is None and getattr(buf, "flags", None) is not None \
                and not backend.writeable(buf):
            call.problem = "buf is read-only (bcast writes into it)"
        call.algorithm = name
        nbytes = getattr(buf, "nbytes", 0)
        if algorithm == "auto" and self._auto["bcast"] == "auto" \
                and self._fused(call, buf, nbytes, SHORT_BCAST):
            return self._submit(call, lambda mpi: self._short_bcast(mpi, call, buf, root),
                                nbytes, FUSED, fused=True)

        def run(mpi):
            work = self._stage_in(buf)
            if self.size > 1 and work.size:
                BCAST_ALGORITHMS[name](mpi, work, root)
            if self._staged(buf):
                buf[...] = self._stage_out(work, buf).reshape(buf.shape)
            return buf
        return self._submit(call, run, nbytes, name)

    def _short_bcast(self, mpi, call, buf, root):
        """Root's bytes and everyone else's zeros, OR-folded by the agreement's exchange."""
        host = self._stage_in(buf)
        ex = self._exchanges[id(mpi)].get(host.nbytes, np.uint8)
        if self.rank == root:
            ex.data[...] = host.view(np.uint8)
        else:
            ex.data[...] = 0
        self._exchange(mpi, ex, np.bitwise_or, call, ("bcast", host.size, host.dtype, None, root))
        if self.rank != root:
            buf.reshape(-1)[...] = self._stage_out(ex.data.view(host.dtype), buf)
        return buf

    def reduce(self, buf, op: str = "sum", root: int = 0):
        """Binomial-tree reduction to ``root``: the result there, None on other ranks."""
        check_op(op)
        call = self._call("reduce", buf, op=op, root=root)

        def run(mpi):
            work = self._stage_in(buf).copy()
            if self.size > 1 and work.size:
                tree.reduce_binomial(mpi, work, root, op)
            return self._stage_out(work, buf).reshape(buf.shape) if self.rank == root else None
        return self._submit(call, run, getattr(buf, "nbytes", 0), "binomial")

    def barrier(self) -> None:
        """Wait until every rank has called it. The agreement round is itself the barrier
        (no rank leaves an allreduce before every rank entered it), so a rank that calls
        another collective instead is named rather than matched."""
        if self.size > 1 and not self.debug and timeline.active() is None:
            self._exchange(self._wire, self._exchanges[id(self._wire)].get(0, np.uint8), None,
                           None, ("barrier", 0, None, None, -1))
            return
        call = self._call("barrier")
        call.algorithm = FUSED               # the same key as the lean barrier's
        self._submit(call, lambda mpi: None, 0, "agreement")

    # ---- point to point -----------------------------------------------------------------
    def _check_peer(self, peer: int, name: str, tag: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{name} must be in [0, {self.size}), got {peer}")
        if not 0 <= tag < p2p.MAX_TAG:
            raise ValueError(f"tag must be in [0, {p2p.MAX_TAG}), got {tag}")

    def _outgoing(self, arr, dest: int, tag: int):
        """Checked, staged array and its payload tag for a send to ``dest``."""
        self._check_peer(dest, "dest", tag)
        problem = self._problem(arr, "arr")
        if problem:
            raise ValueError(problem)
        seq = self._send_seq.get(dest, 0)
        self._send_seq[dest] = seq + 1
        return self._stage_in(arr).reshape(arr.shape), p2p.payload_tag(seq)

    def _recv_on_host(self) -> bool:
        return backend.device() == "gpu" and not self.cuda_aware

    def send(self, arr, dest: int, tag: int = 0) -> None:
        """Send an array; its shape and dtype travel with it."""
        work, ptag = self._outgoing(arr, dest, tag)
        with timeline.collective("send", "p2p", work.nbytes, self.size), \
                watchdog.waiting(self.label, 0, f"send to rank {dest} (tag {tag})", work.nbytes,
                                 f"rank {dest}"):
            p2p.send(self._p2p_wire, work, dest, tag, ptag)

    def recv(self, source: int, tag: int = 0):
        """Receive an array sent with ``send``/``isend``, on the active device."""
        self._check_peer(source, "source", tag)
        host = self._recv_on_host()
        with timeline.collective("recv", "p2p", 0, self.size) as info, \
                watchdog.waiting(self.label, 0, f"receive from rank {source} (tag {tag})", 0,
                                 f"rank {source}"):
            out = p2p.recv(self._p2p_wire, source, tag, np if host else backend.xp())
            if info is not None:
                info["bytes"] = out.nbytes
        return backend.to_device(out) if host else out

    def isend(self, arr, dest: int, tag: int = 0) -> p2p.SendHandle:
        """Non-blocking send; ``wait()`` before reusing ``arr``."""
        work, ptag = self._outgoing(arr, dest, tag)
        return p2p.isend(self._p2p_wire, work, dest, tag, ptag)

    def irecv(self, source: int, tag: int = 0) -> p2p.RecvHandle:
        """Non-blocking receive; ``wait()`` returns the array."""
        self._check_peer(source, "source", tag)
        host = self._recv_on_host()
        return p2p.RecvHandle(self._p2p_wire, source, tag, np if host else backend.xp(),
                              finish=backend.to_device if host else None)

    def sendrecv(self, arr, dest: int, source: int, sendtag: int = 0, recvtag: int | None = None):
        """Send ``arr`` to ``dest`` while receiving from ``source`` (no deadlock in a ring)."""
        h = self.isend(arr, dest, sendtag)
        out = self.recv(source, sendtag if recvtag is None else recvtag)
        h.wait()
        return out

    # ---- sparse --------------------------------------------------------------------------
    def sparse_allreduce(self, grad, density: float | None = None, k: int | None = None,
                         op: str = "sum"):
        """Top-k exchange: every rank's k largest-|.| entries, summed into a dense array.

        Falls back to the dense ring allreduce when that sends fewer bytes (k/n above about
        1/P); ``self.sparse_stats`` records the sizes and which path ran.
        """
        n = getattr(grad, "size", 0)
        kk = sparse.choose_k(n, density, k)
        sparse_b, dense_b = sparse.wire_bytes(n, kk, getattr(grad, "itemsize", 4), self.size)
        if sparse_b >= dense_b:
            if op not in ("sum", "avg"):
                raise ValueError(f"sparse_allreduce supports op sum or avg, got {op!r}")
            out = self.allreduce(grad, op=op, algorithm="ring")
            self.sparse_stats = sparse.SparseStats(n, kk, sparse_b, dense_b, dense_b, True)
            return out
        idx, vals = sparse.top_k(grad.reshape(-1), kk)
        return self.sparse_exchange(idx, vals, n, op).reshape(grad.shape)

    def sparse_exchange(self, idx, vals, n: int, op: str = "sum"):
        """Sum every rank's (index, value) pairs into a dense length-n array (ring allgatherv
        of the pairs). Each rank passes the same n and the same number of pairs."""
        if op not in ("sum", "avg"):
            raise ValueError(f"sparse_allreduce supports op sum or avg, got {op!r}")
        if n >= 2 ** 31:
            raise ValueError("sparse exchange indexes with int32: arrays must be < 2**31")
        pairs = getattr(idx, "nbytes", 0) + getattr(vals, "nbytes", 0)
        call = self._call("sparse_allreduce", vals, "vals", op=op, length=n, k=idx.size)
        out = self._submit(call, lambda mpi: self._stage_out(sparse.exchange(
            mpi, self._stage_in(idx, 1), self._stage_in(vals, 2), n), vals),
            pairs * self.size, "topk-allgatherv")
        if op == "avg":
            out /= self.size
        sparse_b, dense_b = sparse.wire_bytes(n, idx.size, vals.dtype.itemsize, self.size)
        self.sparse_stats = sparse.SparseStats(n, idx.size, sparse_b, dense_b, sparse_b, False)
        return out

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the progress thread and free the duplicate communicator (collective)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for exchanges in self._exchanges.values():
            exchanges.free()
        for name in ("_bg_mpi", "_p2p_mpi"):
            dup = getattr(self, name)
            if dup is not None and dup != MPI.COMM_NULL:
                dup.Free()
                setattr(self, name, None)
