"""The wire: the one place where hpcdist's buffers reach mpi4py.

Every algorithm in ``comm/`` (ring, trees, recursive doubling, p2p, the sparse exchange)
gets a ``Wire`` where it would get an MPI communicator, and moves data only through its
upper-case buffer methods. The wire refuses a device array that MPI cannot read (staged or
not), synchronizes the producing stream before MPI touches device memory, and counts every
byte it hands to MPI to send (in total, and to other nodes).

The rest of this design: docs/communication.md, "hpcdist/comm/wire.py"."""
from __future__ import annotations

import contextlib

import numpy as np
from mpi4py import MPI

from ..device import backend, staging
from . import ulfm
from .short import Exchanges


class WireError(TypeError):
    """A device array reached MPI without staging, on an MPI that cannot read device memory."""


class Wire:
    """An MPI communicator seen through the wire's checks and byte count."""

    __slots__ = ("mpi", "device_ok", "sent", "exchanges", "node_of", "node", "sent_inter",
                 "_levels")

    def __init__(self, mpi, device_ok: bool, agreement: bool = True, node_of=None):
        self.mpi = mpi                  # the mpi4py communicator underneath
        ulfm.register(mpi)              # revoked when a peer dies (--on-failure shrink)
        self.device_ok = device_ok      # the MPI library reads device memory (CUDA-aware)
        self.sent = 0                   # payload bytes handed to MPI to send
        # the ledger's agreement runs on persistent exchanges made per wire (short.py)
        self.exchanges = Exchanges(self) if agreement else None
        # node_of[rank]: the node of each rank of ``mpi`` (None: one node). Sends to another
        # node are counted again in ``sent_inter``: the bytes that cross the slow link.
        self.node_of = node_of if node_of is not None and len(set(node_of)) > 1 else None
        self.node = self.node_of[mpi.Get_rank()] if self.node_of is not None else None
        self.sent_inter = 0
        self._levels = None

    def total(self) -> tuple[int, int]:
        """(bytes sent, bytes sent to other nodes), the two-level wires' included."""
        sent, inter = self.sent, self.sent_inter
        for level in self._levels or ():
            if isinstance(level, Wire):
                sent, inter = sent + level.sent, inter + level.sent_inter
        return sent, inter

    def levels(self):
        """(node wire, cross wire, table) for two-level algorithms (hierarchical.py): the
        ranks of this wire on this node; the ranks on the other nodes with the same local
        index; table[n * L + l] = the rank that is local rank l on node n. None when the
        ranks are not spread evenly over several nodes. Made once, collectively, by the
        first two-level call on this wire (every rank is in that call)."""
        if self._levels is None:
            if self.node_of is None:
                self._levels = ()
                return None
            counts = {n: self.node_of.count(n) for n in set(self.node_of)}
            if len(set(counts.values())) != 1:
                self._levels = ()
                return None
            rank = self.mpi.Get_rank()
            me = self.node_of[rank]
            node_mpi = self.mpi.Split(me, rank)
            local = node_mpi.Get_rank()
            cross_mpi = self.mpi.Split(local, rank)
            nodes = cross_mpi.Get_size()
            node = Wire(node_mpi, self.device_ok, agreement=False)
            cross = Wire(cross_mpi, self.device_ok, agreement=False,
                         node_of=list(range(nodes)))      # every cross peer is another node
            L = node_mpi.Get_size()
            code = np.array([cross_mpi.Get_rank() * L + local], dtype=np.int64)
            codes = np.empty(self.mpi.Get_size(), dtype=np.int64)
            self.mpi.Allgather(code, codes)     # setup, like Split: not a data path
            table = [0] * len(codes)
            for r, c in enumerate(codes):
                table[int(c)] = r
            self._levels = (node, cross, table)
        return self._levels or None

    # staging
    def staged(self, buf) -> bool:
        """True when ``stage_in(buf)`` is a host copy rather than a view of ``buf``."""
        return not self.device_ok and backend.is_gpu_array(buf)

    def stage_in(self, buf, key: int = 0, fresh: bool = False):
        """A flat buffer MPI may read: a device array's values in a reused pinned host
        buffer (``key`` tells two staged at once apart; valid until the next staging with
        the same key on this thread) unless MPI is CUDA-aware, else a view of ``buf``.
        ``fresh``: a host copy of its own instead (a non-blocking send, which MPI may read
        after the next staging)."""
        if not self.device_ok and backend.is_gpu_array(buf):
            if fresh:
                return backend.to_numpy(buf).reshape(-1)
            return staging.to_host(buf, key)  # synchronizes the producing stream
        return buf.reshape(-1)

    @staticmethod
    def stage_out(host, like, out=None):
        """A staged result back on ``like``'s device (a new array, or into ``out``)."""
        if backend.is_gpu_array(like) and not backend.is_gpu_array(host):
            return staging.from_host(host, like, out)
        if out is not None:
            out.reshape(-1)[...] = host.reshape(-1)
            return out
        return host

    def result(self, flat, buf, out=None):
        """A flat result shaped like ``buf`` on ``buf``'s device, in ``out`` when one is given
        (else a new array: ``flat`` may be a buffer that the next call reuses)."""
        if out is None and type(buf) is np.ndarray:          # the hot case: a host array
            return flat.reshape(buf.shape).copy()
        if out is not None:
            return self.stage_out(flat, out, out)
        if self.staged(buf):
            return self.stage_out(flat, buf).reshape(buf.shape)
        return flat.reshape(buf.shape).copy()

    @contextlib.contextmanager
    def uncounted(self):
        """Sends inside are left out of the counts (a benchmark's probe)."""
        wires = [self] + [w for w in self._levels or () if isinstance(w, Wire)]
        saved = [(w.sent, w.sent_inter) for w in wires]
        try:
            yield
        finally:
            for w, (sent, inter) in zip(wires, saved):
                w.sent, w.sent_inter = sent, inter

    def _buf(self, buf, what: str):
        if backend.is_gpu_array(buf):
            if not self.device_ok:
                raise WireError(
                    f"a device array reached MPI ({what}) without staging, and this MPI is not "
                    "CUDA-aware: device memory must go through the Communicator's staging "
                    "(HPCDIST_CUDA_AWARE=1 only if the library really reads GPU memory)")
            backend.synchronize(buf)
        return buf

    def _out(self, buf, what: str, dest: int):
        self._buf(buf, what)
        self.sent += buf.nbytes
        if self.node_of is not None and self.node_of[dest] != self.node:
            self.sent_inter += buf.nbytes
        return buf

    # blocking
    def Send(self, buf, dest, tag=0):
        self.mpi.Send(self._out(buf, "Send", dest), dest, tag)

    def Recv(self, buf, source, tag=0, status=None):
        self.mpi.Recv(self._buf(buf, "Recv"), source, tag, status)

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, *, status=None):
        self.mpi.Sendrecv(self._out(sendbuf, "Sendrecv", dest), dest, sendtag,
                          self._buf(recvbuf, "Sendrecv"), source, recvtag, status)

    # non-blocking
    def Isend(self, buf, dest, tag=0):
        return self.mpi.Isend(self._out(buf, "Isend", dest), dest, tag)

    def Irecv(self, buf, source, tag=0):
        return self.mpi.Irecv(self._buf(buf, "Irecv"), source, tag)

    # persistent (the agreement's exchanges): counted when started
    def Send_init(self, buf, dest, tag=0):
        return self.mpi.Send_init(self._buf(buf, "Send_init"), dest, tag)

    def Recv_init(self, buf, source, tag=0):
        return self.mpi.Recv_init(self._buf(buf, "Recv_init"), source, tag)

    def Startall(self, requests, nbytes: int = 0, dest=None) -> None:
        """Start persistent requests that send ``nbytes`` of payload in all (to ``dest``,
        counted in ``sent_inter`` too where that rank is on another node)."""
        self.sent += nbytes
        if nbytes and dest is not None and self.node_of is not None and \
                self.node_of[dest] != self.node:
            self.sent_inter += nbytes
        _startall(requests)

    def free_levels(self) -> None:
        for w in self._levels or ():
            if isinstance(w, Wire):
                w.mpi.Free()
        self._levels = None

    def __getattr__(self, name):
        # Collectives and one-sided calls would move buffers past the checks: not here.
        if name in _BUFFER_CALLS:
            raise AttributeError(f"Wire has no {name}: hpcdist's data moves through its own "
                                 "algorithms on Send/Recv/Sendrecv/Isend/Irecv")
        return getattr(self.mpi, name)


_startall = MPI.Prequest.Startall

_BUFFER_CALLS = {"Allreduce", "Reduce", "Bcast", "Allgather", "Allgatherv", "Alltoall",
                 "Alltoallv", "Gather", "Gatherv", "Scatter", "Scatterv", "Reduce_scatter",
                 "Reduce_scatter_block", "Iallreduce", "Ibcast", "Iallgather", "Ireduce",
                 "Ireduce_scatter", "Igather", "Iscatter", "Ialltoall", "Ssend", "Bsend", "Rsend",
                 "Issend", "Ibsend", "Irsend", "Ssend_init", "Bsend_init", "Rsend_init",
                 "Mrecv", "Imrecv", "Sendrecv_replace", "Scan", "Exscan", "Neighbor_allgather",
                 "Neighbor_alltoall"}
