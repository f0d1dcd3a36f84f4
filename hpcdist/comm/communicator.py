"""Communicator: hpcdist's collectives over an mpi4py communicator.

Every collective here is one of our algorithms built on MPI point-to-point calls; MPI's own
collectives are only the oracle in tests and the baseline in benchmarks. Arrays cross MPI as
raw bytes (any dtype, fp16 and bf16 included); reductions run in the array's own module.
"""
from __future__ import annotations

import concurrent.futures
import os

import numpy as np
from mpi4py import MPI

from ..device import backend
from ..host import threads, timeline
from . import abort, ledger, p2p, select, sparse, watchdog
from .alltoall import pieces_of
from .collectives import (ALLGATHER, ALLGATHERV, ALLREDUCE, ALLTOALL, BARRIER, BCAST,
                          REDUCE, REDUCE_SCATTER, SPARSE)
from .dispatch import agree_only, collective
from .handle import Done, Handle
from .wire import Wire


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


class Communicator:
    """Collectives, point-to-point and sparse exchange over ``mpi_comm`` (default COMM_WORLD).

    Construction is collective: every rank of ``mpi_comm`` must construct it, in the same order.
    """

    def __init__(self, mpi_comm=None, abort_on_error: bool | None = None):
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.node_of, self.topology = select.topology_of(self.mpi, node)
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
        self.label = ledger.communicator_label(self.mpi)
        self._peers = "all ranks" if self.label == "world" else self.label
        self._ledger = ledger.Ledger(self.label, self._peers, self.size,
                                     debug=os.environ.get("HPCDIST_DEBUG", "0") == "1")
        # Non-blocking collectives run on their own duplicate, in a progress thread, so their
        # messages can never match a blocking call's.
        self._bg_mpi = self.mpi.Dup()
        # Point-to-point has its own duplicate too: user tags never meet collective traffic.
        self._p2p_mpi = self.mpi.Dup()
        # Every byte reaches MPI through a wire (wire.py): it refuses unstaged device arrays
        # and counts what is sent. One per MPI communicator: the caller's thread uses
        # _wire, the progress thread _bg_wire, point-to-point _p2p_wire.
        self.cuda_aware = cuda_aware()
        self._wire = Wire(self.mpi, self.cuda_aware, node_of=self.node_of)
        self._bg_wire = Wire(self._bg_mpi, self.cuda_aware, node_of=self.node_of)
        self._bg_sent = [0, 0]                    # its waited calls' bytes (bytes_sent)
        self._p2p_wire = Wire(self._p2p_mpi, self.cuda_aware, agreement=False,
                              node_of=self.node_of)
        self._send_seq: dict = {}            # dest -> messages sent (payload tags)
        self._executor = None
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        # Algorithms forced for "auto" (read once here: the environment is slow per call).
        self._auto = {"allreduce": os.environ.get("HPCDIST_ALLREDUCE", "auto"),
                      "bcast": os.environ.get("HPCDIST_BCAST", "auto")}
        self._memos: dict = {}               # cached plans of blocking short calls
        self.sparse_stats = sparse.SparseStats()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has handed to MPI to send, counted at the wires
        (collectives, their short exchanges' data and point-to-point; not the agreement's
        16-byte keys); a non-blocking collective's once its handle is waited
        (dispatch._counted)."""
        return sum(w.total()[0] for w in (self._wire, self._p2p_wire)) + self._bg_sent[0]

    @property
    def bytes_inter_node(self) -> int:
        """Of ``bytes_sent``, what went to ranks on other nodes (over the slow links)."""
        return sum(w.total()[1] for w in (self._wire, self._p2p_wire)) + self._bg_sent[1]

    def _settle(self, sent) -> None:
        """A waited non-blocking call's (bytes, inter-node bytes), into the counts."""
        self._bg_sent[0] += sent[0]
        self._bg_sent[1] += sent[1]

    @property
    def nodes(self) -> int:
        """How many nodes this communicator's ranks are on."""
        return self.topology.nodes

    @property
    def debug(self) -> bool:
        """Call sites and shapes in every call's key (HPCDIST_DEBUG=1; settable)."""
        return self._ledger.debug

    @debug.setter
    def debug(self, on: bool) -> None:
        self._ledger.debug = on
        self._memos.clear()                  # cached plans carry no call site

    def uncounted(self):
        """Blocking calls inside are left out of ``bytes_sent`` (a benchmark's probe)."""
        return self._wire.uncounted()

    def __repr__(self):
        return f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """A Communicator over the ranks that pass the same ``color``, ordered by ``key``."""
        return Communicator(self.mpi.Split(color, self.rank if key is None else key))

    # ---- collectives ----------------------------------------------------------------------
    # Each is one line: its arguments, then the one path (dispatch.collective). The kinds, with
    # their checks, short payloads and long algorithms, are in collectives.py.

    def allreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                  wire_dtype=None):
        """Reduce ``buf`` over all ranks; every rank gets the result (a new array unless
        ``out`` is given — ``out=buf`` reduces in place).

        ``wire_dtype`` (e.g. "float16") sends that dtype while reducing in ``buf``'s dtype;
        it runs the ring algorithm.
        """
        return collective(self, ALLREDUCE, True, buf, op=op, algorithm=algorithm, out=out,
                                wire_dtype=wire_dtype)

    def iallreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                   wire_dtype=None) -> Handle:
        """Non-blocking allreduce: progresses in a background thread; ``wait()`` -> result.
        Do not touch ``buf`` (or ``out``) until then."""
        return collective(self, ALLREDUCE, False, buf, op=op, algorithm=algorithm, out=out,
                                wire_dtype=wire_dtype)

    def reduce_scatter(self, buf, op: str = "sum", counts=None, algorithm: str = "auto"):
        """This rank's shard of the reduction of ``buf``: the shard rule (arith.py), or
        ``counts[r]`` elements for rank r, in rank order (e.g. whole sequence rows).
        ``algorithm``: auto, ring or hierarchical (two levels, across nodes)."""
        return collective(self, REDUCE_SCATTER, True, buf, op=op, algorithm=algorithm,
                                counts=counts)

    def ireduce_scatter(self, buf, op: str = "sum", counts=None,
                        algorithm: str = "auto") -> Handle:
        return collective(self, REDUCE_SCATTER, False, buf, op=op, algorithm=algorithm,
                                counts=counts)

    def allgather(self, shard, total: int | None = None, counts=None, out=None,
                  algorithm: str = "auto"):
        """Concatenation of every rank's 1-D ``shard``.

        With ``total``, shards follow the shard rule of a length-``total`` array (the last
        ones may be shorter or empty); with ``counts``, rank r's shard has ``counts[r]``
        elements; with neither, every shard must have the same length. ``out``: a 1-D array
        of the gathered length to gather into (``shard`` may be a view of its own part).
        ``algorithm``: auto, ring or hierarchical (two levels, across nodes).
        """
        return collective(self, ALLGATHER, True, shard, algorithm=algorithm, out=out,
                                total=total, counts=counts)

    def iallgather(self, shard, total: int | None = None, counts=None, out=None,
                   algorithm: str = "auto") -> Handle:
        return collective(self, ALLGATHER, False, shard, algorithm=algorithm, out=out,
                                total=total, counts=counts)

    def allgatherv(self, buf):
        """Concatenation of every rank's 1-D ``buf``, lengths free to differ."""
        return collective(self, ALLGATHERV, True, buf)

    def alltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto") -> list:
        """Piece j of ``buf`` to rank j; returns [the piece from rank 0, ..., from rank P-1]
        (flat views of one array). ``buf``: an array of P equal pieces, or with ``counts``
        (the v-form: any sizes, zeros too) — or a list of P arrays, one per rank.
        ``recv_counts``: the sizes coming in, where the caller knows them (else they are
        exchanged first). Algorithms: pairwise, bruck (comm/alltoall.py)."""
        buf, counts = pieces_of(buf, counts, self.size)
        return collective(self, ALLTOALL, True, buf, algorithm=algorithm, counts=counts,
                          extra=recv_counts)

    def ialltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto") -> Handle:
        """Non-blocking ``alltoall``: ``wait()`` -> the list of pieces. Leave ``buf`` alone
        until then."""
        buf, counts = pieces_of(buf, counts, self.size)
        return collective(self, ALLTOALL, False, buf, algorithm=algorithm, counts=counts,
                          extra=recv_counts)

    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        """Overwrite ``buf`` on every rank with root's ``buf`` (in place); returns ``buf``."""
        return collective(self, BCAST, True, buf, root=root, algorithm=algorithm)

    def reduce(self, buf, op: str = "sum", root: int = 0):
        """Binomial-tree reduction to ``root``: the result there, None on other ranks."""
        return collective(self, REDUCE, True, buf, op=op, root=root)

    def barrier(self) -> None:
        """Wait until every rank has called it (the agreement round is the barrier)."""
        collective(self, BARRIER, True, None)

    def agree_only(self, kind: str, buf, op=None, root=None, length=None) -> int:
        """The ledger's agreement on a collective whose data moves elsewhere (the NCCL
        backend): numbered, checked and agreed like ours, then nothing is exchanged; returns
        the call's number."""
        return agree_only(self, kind, buf, op, root, length)

    def _progress(self, fn):
        """A future of ``fn(bg_wire)`` in the progress thread (or run now without threads)."""
        if not self.threaded:
            # No MPI_THREAD_MULTIPLE: run now (correct, no overlap), in call order.
            return Done(lambda: fn(self._bg_wire))
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"hpcdist-comm-{self.rank}")
        return self._executor.submit(fn, self._bg_wire)

    # ---- point to point -----------------------------------------------------------------
    def _check_peer(self, peer: int, name: str, tag: int) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{name} must be in [0, {self.size}), got {peer}")
        if not 0 <= tag < p2p.MAX_TAG:
            raise ValueError(f"tag must be in [0, {p2p.MAX_TAG}), got {tag}")

    def _outgoing(self, arr, dest: int, tag: int, fresh: bool = False):
        """Checked, staged array and its payload tag for a send to ``dest`` (``fresh``: a
        non-blocking send's staged copy is its own, not the reused buffer)."""
        self._check_peer(dest, "dest", tag)
        problem = ledger.argument_problem(arr, "arr", None, self.size)
        if problem:
            raise ValueError(problem)
        seq = self._send_seq.get(dest, 0)
        self._send_seq[dest] = seq + 1
        return self._p2p_wire.stage_in(arr, fresh=fresh).reshape(arr.shape), \
            p2p.payload_tag(seq)

    def _link(self, peer: int) -> str:
        return "intra" if self.node_of[peer] == self.node_of[self.rank] else "inter"

    def _recv_on_host(self) -> bool:
        return backend.device() == "gpu" and not self.cuda_aware

    def send(self, arr, dest: int, tag: int = 0) -> None:
        """Send an array; its shape and dtype travel with it."""
        work, ptag = self._outgoing(arr, dest, tag)
        with timeline.collective("send", "p2p", work.nbytes, self.size, self._link(dest)), \
                watchdog.waiting(self.label, 0, f"send to rank {dest} (tag {tag})", work.nbytes,
                                 f"rank {dest}"):
            p2p.send(self._p2p_wire, work, dest, tag, ptag)

    def recv(self, source: int, tag: int = 0):
        """Receive an array sent with ``send``/``isend``, on the active device."""
        self._check_peer(source, "source", tag)
        host = self._recv_on_host()
        with timeline.collective("recv", "p2p", 0, self.size, self._link(source)) as info, \
                watchdog.waiting(self.label, 0, f"receive from rank {source} (tag {tag})", 0,
                                 f"rank {source}"):
            out = p2p.recv(self._p2p_wire, source, tag, np if host else backend.xp())
            if info is not None:
                info["bytes"] = out.nbytes
        return backend.to_device(out) if host else out

    def isend(self, arr, dest: int, tag: int = 0) -> p2p.SendHandle:
        """Non-blocking send; ``wait()`` before reusing ``arr``."""
        work, ptag = self._outgoing(arr, dest, tag, fresh=True)
        return p2p.isend(self._p2p_wire, work, dest, tag, ptag)

    def irecv(self, source: int, tag: int = 0, shape=None, dtype=None) -> p2p.RecvHandle:
        """Non-blocking receive; ``wait()`` returns the array. ``shape``/``dtype``: what it
        must be (checked; the NCCL backend needs them to post its buffer)."""
        self._check_peer(source, "source", tag)
        host = self._recv_on_host()
        return p2p.RecvHandle(self._p2p_wire, source, tag, np if host else backend.xp(),
                              finish=p2p.expecting(shape, dtype, source, tag,
                                                   backend.to_device if host else None))

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
        out = collective(self, SPARSE, True, vals, op=op, extra=(idx, n))
        sparse_b, dense_b = sparse.wire_bytes(n, idx.size, vals.dtype.itemsize, self.size)
        self.sparse_stats = sparse.SparseStats(n, idx.size, sparse_b, dense_b, sparse_b, False)
        return out

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the progress thread and free the duplicate communicator (collective)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for wire in (self._wire, self._bg_wire):
            wire.exchanges.free()
            wire.free_levels()
        for name in ("_bg_mpi", "_p2p_mpi"):
            dup = getattr(self, name)
            if dup is not None and dup != MPI.COMM_NULL:
                dup.Free()
                setattr(self, name, None)
