"""NCCL backend through ``cupy.cuda.nccl``, with the Communicator's interface.

The unique id is made on rank 0 and broadcast with our own MPI broadcast; after that every
collective runs in NCCL on the current CUDA stream. One rank per GPU: NCCL refuses two ranks
on the same device. Selected with ``backend="nccl"`` (``make_communicator``) or
``--backend nccl``.
"""
from __future__ import annotations

import numpy as np

from ..device import backend
from . import p2p
from .alltoall import offsets, pieces_of, split, unequal_problem
from .arith import check_op, shard_bounds, shard_size

_NCCL_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
                "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8",
                "int8": "NCCL_INT8"}
_NCCL_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}


UID_BYTES = 128      # sizeof(ncclUniqueId)


def pack_unique_id(uid) -> np.ndarray:
    """NCCL's unique id as 129 bytes: the id, then 1 if CuPy gave it as ``bytes`` (CuPy 14)
    or 0 if as a tuple of 128 signed chars (earlier releases); ``unpack_unique_id`` hands
    it back to ``NcclCommunicator`` in the same spelling."""
    out = np.zeros(UID_BYTES + 1, dtype=np.uint8)
    if isinstance(uid, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(bytes(uid), dtype=np.uint8)
        out[UID_BYTES] = 1
    else:
        raw = np.asarray(uid, dtype=np.int64).astype(np.int8).view(np.uint8)
    if raw.size != UID_BYTES:
        raise ValueError(f"NCCL unique id of {raw.size} bytes, expected {UID_BYTES}")
    out[:UID_BYTES] = raw
    return out


def unpack_unique_id(packed: np.ndarray):
    raw = np.asarray(packed[:UID_BYTES], dtype=np.uint8)
    if packed[UID_BYTES]:
        return raw.tobytes()
    return tuple(int(b) for b in raw.view(np.int8))


class _StreamHandle:
    """A collective queued on the CUDA stream: done once the stream reaches it."""

    def __init__(self, result):
        self._result = result

    def test(self) -> bool:
        return True

    def wait(self):
        backend.synchronize(self._result)
        return self._result


# The Communicator's calls: the NCCL backend implements each or refuses it by name
# (``REFUSED``: the call -> why, and what runs it instead).
PROTOCOL = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather",
            "iallgather", "allgatherv", "alltoall", "ialltoall", "bcast", "reduce", "barrier",
            "agree_only", "send", "recv", "isend", "irecv", "sendrecv", "sparse_allreduce",
            "sparse_exchange",
            "split", "close", "uncounted")
REFUSED = {
    "allgatherv": "pieces of sizes only the ranks know need a size exchange first",
    "isend": "NCCL's point-to-point calls complete only inside a group with their peer's",
    "irecv": "NCCL's point-to-point calls complete only inside a group with their peer's",
    "sparse_allreduce": "the Top-K exchange is an allgatherv of (index, value) pairs",
    "sparse_exchange": "the Top-K exchange is an allgatherv of (index, value) pairs",
}


def _refusal(name: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"{name} is not in the NCCL backend ({REFUSED[name]}): "
                                  "run it on the MPI backend (--backend mpi, or a "
                                  "Communicator)")
    refuse.__name__ = name
    return refuse


class NcclCommunicator:
    """The Communicator's calls over NCCL, on GPU arrays: allreduce, reduce_scatter,
    allgather, bcast, reduce, send/recv and sendrecv (and the non-blocking allreduce,
    reduce-scatter and allgather: NCCL queues them on the stream); barrier, agreement and
    split through the MPI communicator beside it; the rest refused by name (``REFUSED``)."""

    def __init__(self, mpi_comm=None):
        from .communicator import Communicator
        self.host = Communicator(mpi_comm)            # MPI: bootstrap, agreement, barrier
        self.rank, self.size = self.host.rank, self.host.size
        self.local_rank = self.host.local_rank
        self.nccl = backend.nccl_module()              # a clear error without CuPy/NCCL
        uid = np.zeros(UID_BYTES + 1, dtype=np.uint8)  # the id, then how CuPy spells it
        if self.rank == 0:
            uid[:] = pack_unique_id(self.nccl.get_unique_id())
        self.host.bcast(uid, root=0)
        self.comm = self.nccl.NcclCommunicator(self.size, unpack_unique_id(uid), self.rank)
        self.bytes_sent = 0                            # ring-equivalent payload bytes

    def iallreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                   wire_dtype=None):
        """NCCL queues the allreduce on the current stream; ``wait()`` syncs the stream."""
        if wire_dtype is not None:
            raise ValueError("the NCCL backend has no wire dtype; use --compress none")
        return _StreamHandle(self.allreduce(buf, op=op, out=out))

    def ireduce_scatter(self, buf, op: str = "sum", counts=None, algorithm: str = "auto"):
        return _StreamHandle(self.reduce_scatter(buf, op=op, counts=counts))

    def iallgather(self, shard, total: int | None = None, counts=None, out=None,
                   algorithm: str = "auto"):
        return _StreamHandle(self.allgather(shard, total=total, counts=counts, out=out))

    def ialltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto"):
        return _StreamHandle(self.alltoall(buf, counts, recv_counts))

    def split(self, color: int, key: int | None = None):
        """An NCCL communicator over the ranks that pass the same ``color`` (collective)."""
        return NcclCommunicator(self.host.mpi.Split(color, self.rank if key is None else key))

    def uncounted(self):
        return self.host.uncounted()

    def agree_only(self, kind: str, buf, op=None, root=None, length=None) -> None:
        self.host.agree_only(kind, buf, op=op, root=root, length=length)

    @property
    def nodes(self) -> int:
        return self.host.nodes

    # ---- helpers ---------------------------------------------------------------------------
    def _args(self, buf):
        if not backend.is_gpu_array(buf):
            raise ValueError("the NCCL backend works on GPU (CuPy) arrays; use --device gpu")
        if not buf.flags.c_contiguous:
            raise ValueError("buf must be C-contiguous")
        name = buf.dtype.name
        if name not in _NCCL_DTYPES:
            raise TypeError(f"NCCL has no {name}; supported: {', '.join(_NCCL_DTYPES)}")
        return getattr(self.nccl, _NCCL_DTYPES[name])

    @staticmethod
    def _stream():
        return backend.xp().cuda.get_current_stream().ptr

    def _agree(self, kind, buf, op=None, root=None, length=None):
        self.host.agree_only(kind, buf, op=op, root=root, length=length)

    # ---- collectives -----------------------------------------------------------------------
    def allreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None):
        check_op(op)
        self._agree("allreduce", buf, op)
        dt = self._args(buf)
        out = backend.xp().empty_like(buf) if out is None else out
        self.bytes_sent += 2 * (self.size - 1) * -(-buf.size // self.size) * buf.dtype.itemsize
        self.comm.allReduce(buf.data.ptr, out.data.ptr, buf.size, dt,
                            getattr(self.nccl, _NCCL_OPS[op]), self._stream())
        if op == "avg":
            out /= self.size
        return out

    def reduce_scatter(self, buf, op: str = "sum", counts=None, algorithm: str = "auto"):
        """The shard rule as everywhere: NCCL needs equal chunks, so pad to P*ceil(L/P)."""
        _no_counts("reduce_scatter", counts)
        check_op(op)
        self._agree("reduce_scatter", buf, op)
        xp, dt = backend.xp(), self._args(buf)
        L, P = buf.size, self.size
        S = shard_size(L, P)
        padded = xp.zeros(S * P, dtype=buf.dtype)
        padded[:L] = buf.reshape(-1)
        out = xp.empty(S, dtype=buf.dtype)
        self.comm.reduceScatter(padded.data.ptr, out.data.ptr, S, dt,
                                getattr(self.nccl, _NCCL_OPS[op]), self._stream())
        if op == "avg":
            out /= P
        lo, hi = shard_bounds(L, P, self.rank)
        return out[:hi - lo]

    def allgather(self, shard, total: int | None = None, counts=None, out=None,
                  algorithm: str = "auto"):
        _no_counts("allgather", counts)
        xp, dt = backend.xp(), self._args(shard)
        P = self.size
        S = shard_size(total, P) if total is not None else shard.size
        self._agree("allgather", shard, length=total if total is not None else S * P)
        send = xp.zeros(S, dtype=shard.dtype)
        send[:shard.size] = shard
        full = xp.empty(S * P, dtype=shard.dtype)
        self.comm.allGather(send.data.ptr, full.data.ptr, S, dt, self._stream())
        full = full[:total] if total is not None else full
        if out is not None:
            out.reshape(-1)[...] = full
            return out
        return full

    def alltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto") -> list:
        """As ``Communicator.alltoall``: one NCCL group of a send and a receive per peer (the
        sizes, where the caller does not give them, over MPI first)."""
        buf, counts = pieces_of(buf, counts, self.size)
        xp, dt, P = backend.xp(), self._args(buf), self.size
        problem = unequal_problem(buf.size, counts, P)
        if problem:
            raise ValueError(problem)
        self._agree("alltoall", buf, length=buf.size if counts is None else -1)
        counts = [buf.size // P] * P if counts is None else [int(c) for c in counts]
        if recv_counts is None:
            recv_counts = [int(p[0]) for p in self.host.alltoall(np.array(counts, np.int64))]
        send, out = buf.reshape(-1), xp.empty(sum(recv_counts), dtype=buf.dtype)
        so, ro = offsets(counts), offsets(recv_counts)
        item = buf.dtype.itemsize
        self.bytes_sent += (int(so[-1]) - counts[self.rank]) * item
        out[ro[self.rank]:ro[self.rank + 1]] = send[so[self.rank]:so[self.rank + 1]]
        self.nccl.groupStart()
        for peer in range(P):
            if peer != self.rank and counts[peer]:
                self.comm.send(send.data.ptr + int(so[peer]) * item, counts[peer], dt, peer,
                               self._stream())
            if peer != self.rank and recv_counts[peer]:
                self.comm.recv(out.data.ptr + int(ro[peer]) * item, int(recv_counts[peer]),
                               dt, peer, self._stream())
        self.nccl.groupEnd()
        return split(out, recv_counts)

    def reduce(self, buf, op: str = "sum", root: int = 0):
        """The reduced array on ``root`` (None elsewhere): NCCL's allreduce, kept on the root
        (the same result; NCCL's own reduce is not in the CuPy surface hpcdist checks)."""
        out = self.allreduce(buf, op=op)
        return out if self.rank == root else None

    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        self._agree("bcast", buf, root=root)
        dt = self._args(buf)
        self.comm.bcast(buf.data.ptr, buf.size, dt, root, self._stream())
        return buf

    def send(self, arr, dest: int, tag: int = 0) -> None:
        """Shape and dtype go over MPI (the p2p header); the payload over NCCL."""
        dt = self._args(arr)
        self.host.send(p2p.make_header(arr, 0), dest, tag)
        self.nccl.groupStart()
        self.comm.send(arr.data.ptr, arr.size, dt, dest, self._stream())
        self.nccl.groupEnd()

    def recv(self, source: int, tag: int = 0):
        out, _ = p2p.alloc_from_header(self.host.recv(source, tag), backend.xp())
        self.nccl.groupStart()
        self.comm.recv(out.data.ptr, out.size, self._args(out), source, self._stream())
        self.nccl.groupEnd()
        return out

    def sendrecv(self, arr, dest: int, source: int, sendtag: int = 0, recvtag: int | None = None):
        """Send ``arr`` to ``dest`` while receiving from ``source``: the headers over MPI,
        both payloads in one NCCL group (so a ring of sendrecvs cannot deadlock)."""
        dt = self._args(arr)
        head = self.host.isend(p2p.make_header(arr, 0), dest, sendtag)
        out, _ = p2p.alloc_from_header(
            self.host.recv(source, sendtag if recvtag is None else recvtag), backend.xp())
        head.wait()
        self.nccl.groupStart()
        self.comm.send(arr.data.ptr, arr.size, dt, dest, self._stream())
        self.comm.recv(out.data.ptr, out.size, self._args(out), source, self._stream())
        self.nccl.groupEnd()
        return out

    def barrier(self) -> None:
        backend.synchronize()
        self.host.barrier()

    def close(self) -> None:
        self.comm.destroy()
        self.host.close()


def _no_counts(name: str, counts) -> None:
    if counts is not None:
        raise NotImplementedError(f"{name} with counts is not in the NCCL backend (NCCL takes "
                                  "equal pieces): run it on the MPI backend")


for _name in REFUSED:
    setattr(NcclCommunicator, _name, _refusal(_name))


def make_communicator(backend_name: str = "mpi", mpi_comm=None):
    """``"mpi"``: our collectives over MPI (host staging for GPU arrays where needed);
    ``"nccl"``: NCCL through CuPy."""
    if backend_name == "mpi":
        from .communicator import Communicator
        return Communicator(mpi_comm)
    if backend_name == "nccl":
        return NcclCommunicator(mpi_comm)
    raise ValueError(f"unknown communication backend {backend_name!r}: choose mpi or nccl")
