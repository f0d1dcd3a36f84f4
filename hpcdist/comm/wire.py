"""The wire: the one place where hpcdist's buffers reach mpi4py.

Every algorithm in ``comm/`` (ring, trees, recursive doubling, p2p, the sparse exchange)
gets a ``Wire`` where it would get an MPI communicator, and moves data only through its
upper-case buffer methods. The wire

- stages: ``stage_in`` gives MPI a flat host buffer (a device array's values in a reused
  pinned buffer, unless MPI is CUDA-aware), ``stage_out`` puts a result back on the device;
- refuses a device array that skipped staging, unless the MPI library is CUDA-aware. A real
  CuPy array that slipped through would be read as a host pointer and crash the process;
  here it is a ``WireError`` naming the call;
- synchronizes the producing CUDA stream before MPI reads a device array it does accept;
- counts every payload byte sent (``sent``), the short exchanges' persistent sends included
  (``Startall``): ``Communicator.bytes_sent`` is the sum over its wires, and nothing else
  counts bytes.

Everything else (``Get_rank``, ``Get_size``, ``Iprobe`` ...) is the MPI communicator's own.
"""
from __future__ import annotations

import contextlib

from mpi4py import MPI

from .. import backend
from .short import Exchanges


class WireError(TypeError):
    """A device array reached MPI without staging, on an MPI that cannot read device memory."""


class Wire:
    """An MPI communicator seen through the wire's checks and byte count."""

    __slots__ = ("mpi", "device_ok", "sent", "exchanges")

    def __init__(self, mpi, device_ok: bool, agreement: bool = True):
        self.mpi = mpi                  # the mpi4py communicator underneath
        self.device_ok = device_ok      # the MPI library reads device memory (CUDA-aware)
        self.sent = 0                   # payload bytes handed to MPI to send
        # the ledger's agreement runs on persistent exchanges made per wire (short.py)
        self.exchanges = Exchanges(self) if agreement else None

    # staging
    def staged(self, buf) -> bool:
        """True when ``stage_in(buf)`` is a host copy rather than a view of ``buf``."""
        return not self.device_ok and backend.is_gpu_array(buf)

    def stage_in(self, buf, key: int = 0):
        """A flat buffer MPI may read: a device array's values in a reused pinned host
        buffer (``key`` tells two staged at once apart; valid until the next staging with
        the same key on this thread) unless MPI is CUDA-aware, else a view of ``buf``."""
        if not self.device_ok and backend.is_gpu_array(buf):
            return backend.to_host(buf, key)  # synchronizes the producing stream
        return buf.reshape(-1)

    @staticmethod
    def stage_out(host, like, out=None):
        """A staged result back on ``like``'s device (a new array, or into ``out``)."""
        if backend.is_gpu_array(like) and not backend.is_gpu_array(host):
            return backend.from_host(host, like, out)
        if out is not None:
            out.reshape(-1)[...] = host.reshape(-1)
            return out
        return host

    def result(self, flat, buf, out=None):
        """A flat result shaped like ``buf`` on ``buf``'s device, in ``out`` when one is given
        (else a new array: ``flat`` may be a buffer that the next call reuses)."""
        if out is not None:
            return self.stage_out(flat, out, out)
        if self.staged(buf):
            return self.stage_out(flat, buf).reshape(buf.shape)
        return flat.reshape(buf.shape).copy()

    @contextlib.contextmanager
    def uncounted(self):
        """Sends inside are left out of ``sent`` (a benchmark's probe)."""
        sent = self.sent
        try:
            yield
        finally:
            self.sent = sent

    def _buf(self, buf, what: str):
        if backend.is_gpu_array(buf):
            if not self.device_ok:
                raise WireError(
                    f"a device array reached MPI ({what}) without staging, and this MPI is not "
                    "CUDA-aware: device memory must go through the Communicator's staging "
                    "(HPCDIST_CUDA_AWARE=1 only if the library really reads GPU memory)")
            backend.synchronize(buf)
        return buf

    def _out(self, buf, what: str):
        self._buf(buf, what)
        self.sent += buf.nbytes
        return buf

    # blocking
    def Send(self, buf, dest, tag=0):
        self.mpi.Send(self._out(buf, "Send"), dest, tag)

    def Recv(self, buf, source, tag=0, status=None):
        self.mpi.Recv(self._buf(buf, "Recv"), source, tag, status)

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status=None):
        self.mpi.Sendrecv(self._out(sendbuf, "Sendrecv"), dest, sendtag,
                          self._buf(recvbuf, "Sendrecv"), source, recvtag, status)

    # non-blocking
    def Isend(self, buf, dest, tag=0):
        return self.mpi.Isend(self._out(buf, "Isend"), dest, tag)

    def Irecv(self, buf, source, tag=0):
        return self.mpi.Irecv(self._buf(buf, "Irecv"), source, tag)

    # persistent (the agreement's exchanges): counted when started
    def Send_init(self, buf, dest, tag=0):
        return self.mpi.Send_init(self._buf(buf, "Send_init"), dest, tag)

    def Recv_init(self, buf, source, tag=0):
        return self.mpi.Recv_init(self._buf(buf, "Recv_init"), source, tag)

    def Startall(self, requests, nbytes: int = 0) -> None:
        """Start persistent requests that send ``nbytes`` of payload in all."""
        self.sent += nbytes
        _startall(requests)

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
