"""The wire: the one place where hpcdist's buffers reach mpi4py.

Every algorithm in ``comm/`` (ring, trees, recursive doubling, p2p, the sparse exchange)
gets a ``Wire`` where it would get an MPI communicator, and moves data only through its
upper-case buffer methods. The wire

- refuses a device array unless the MPI library is CUDA-aware: staging (``Communicator``'s
  ``_stage_in``/``_stage_out``, through reused pinned host buffers) must come first. A real
  CuPy array that slipped through would be read as a host pointer and crash the process;
  here it is a ``WireError`` naming the call;
- synchronizes the producing CUDA stream before MPI reads a device array it does accept;
- counts every payload byte sent (``sent``): ``Communicator.bytes_sent`` is the sum over its
  wires, so no caller adds bytes by hand.

Everything else (``Get_rank``, ``Get_size``, ``Iprobe`` ...) is the MPI communicator's own.
"""
from __future__ import annotations

from .. import backend


class WireError(TypeError):
    """A device array reached MPI without staging, on an MPI that cannot read device memory."""


class Wire:
    """An MPI communicator seen through the wire's checks and byte count."""

    __slots__ = ("mpi", "device_ok", "sent")

    def __init__(self, mpi, device_ok: bool):
        self.mpi = mpi                  # the mpi4py communicator underneath
        self.device_ok = device_ok      # the MPI library reads device memory (CUDA-aware)
        self.sent = 0                   # payload bytes handed to MPI to send

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

    # persistent (the agreement's exchanges: host buffers, counted by their owner per run)
    def Send_init(self, buf, dest, tag=0):
        return self.mpi.Send_init(self._buf(buf, "Send_init"), dest, tag)

    def Recv_init(self, buf, source, tag=0):
        return self.mpi.Recv_init(self._buf(buf, "Recv_init"), source, tag)

    def __getattr__(self, name):
        # Collectives and one-sided calls would move buffers past the checks: not here.
        if name in _BUFFER_CALLS:
            raise AttributeError(f"Wire has no {name}: hpcdist's data moves through its own "
                                 "algorithms on Send/Recv/Sendrecv/Isend/Irecv")
        return getattr(self.mpi, name)


_BUFFER_CALLS = {"Allreduce", "Reduce", "Bcast", "Allgather", "Allgatherv", "Alltoall",
                 "Alltoallv", "Gather", "Gatherv", "Scatter", "Scatterv", "Reduce_scatter",
                 "Reduce_scatter_block", "Iallreduce", "Ibcast", "Iallgather", "Ireduce",
                 "Ireduce_scatter", "Igather", "Iscatter", "Ialltoall", "Ssend", "Bsend", "Rsend",
                 "Issend", "Ibsend", "Irsend", "Ssend_init", "Bsend_init", "Rsend_init",
                 "Mrecv", "Imrecv", "Sendrecv_replace", "Scan", "Exscan", "Neighbor_allgather",
                 "Neighbor_alltoall"}
