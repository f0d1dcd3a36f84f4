"""NCCL backend through ``cupy.cuda.nccl``, with the Communicator's interface.

One NCCL communicator per mesh group, beside its MPI Communicator. The unique id is made on
rank 0 and broadcast with our own MPI broadcast; after that every call on GPU arrays runs in
NCCL on the current CUDA stream (calls on host arrays go to MPI). One rank per GPU: NCCL
refuses two ranks on the same device. Selected with ``backend="nccl"``
(``make_communicator``, ``ProcessMesh``) or ``--backend nccl``.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from ..device import backend
from . import nccl_watch, ulfm
from .nccl_work import Batch, StreamHandle, watched
from .alltoall import offsets, pieces_of, split, unequal_problem
from .arith import check_op, shard_counts

_NCCL_DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
                "bfloat16": "NCCL_BFLOAT16",
                "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8",
                "int8": "NCCL_INT8"}
_NCCL_OPS = {"sum": "NCCL_SUM", "avg": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}


UID_BYTES = 128      # sizeof(ncclUniqueId)
_LIVE: list = []     # every NCCL communicator of this process (counts())


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


# The Communicator's calls: the NCCL backend implements each or refuses it by name
# (``REFUSED``: the call -> why, and what runs it instead).
PROTOCOL = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather",
            "iallgather", "allgatherv", "alltoall", "ialltoall", "bcast", "reduce", "barrier",
            "agree_only", "send", "recv", "isend", "irecv", "sendrecv", "sparse_allreduce",
            "sparse_exchange",
            "split", "close", "uncounted")
REFUSED = {
    "sparse_allreduce": "the Top-K exchange is an allgatherv of (index, value) pairs",
    "sparse_exchange": "the Top-K exchange is an allgatherv of (index, value) pairs",
}
# Calls on host (NumPy) arrays — losses, norms, flags, checkpoint bytes — run on the MPI
# Communicator beside NCCL: NCCL moves device memory only.
ON_HOST = ("allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allgather",
           "iallgather", "allgatherv", "alltoall", "ialltoall", "bcast", "reduce", "send",
           "sendrecv")


def _refusal(name: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"{name} is not in the NCCL backend ({REFUSED[name]}): "
                                  "run it on the MPI backend (--backend mpi, or a "
                                  "Communicator)")
    refuse.__name__ = name
    return refuse


class NcclCommunicator:
    """The Communicator's calls over NCCL, on GPU arrays: every collective (pieces of other
    sizes padded to the largest), and point-to-point (``isend``/``irecv`` batched into NCCL
    groups: nccl_work.py); barrier, agreement and split through the MPI Communicator beside
    it (``host``), which also carries every call on host arrays; the Top-K exchange refused
    by name (``REFUSED``). ``label`` names the group in the counts (``counts()``)."""

    def __init__(self, mpi_comm=None, host=None, label: str = "world"):
        from .communicator import Communicator
        self.host = host if host is not None else Communicator(mpi_comm)
        self.rank, self.size = self.host.rank, self.host.size
        self.local_rank, self.label = self.host.local_rank, label
        self.nccl = backend.nccl_module()              # a clear error without CuPy/NCCL
        uid = np.zeros(UID_BYTES + 1, dtype=np.uint8)  # the id, then how CuPy spells it
        if self.rank == 0:
            uid[:] = pack_unique_id(self.nccl.get_unique_id())
        self.host.bcast(uid, root=0)
        if ulfm.world() is not None and hasattr(self.nccl, "_use_world"):
            self.nccl._use_world(ulfm.world())   # the NCCL stand-in: after a
            # recovery its MPI rendezvous must look among the survivors (NCCL's needs no MPI)
        self.comm = self.nccl.NcclCommunicator(self.size, unpack_unique_id(uid), self.rank)
        self.bytes_sent = 0                            # ring-equivalent payload bytes
        self.calls: dict = {}                          # kind -> [calls, bytes sent]
        self.p2p = Batch(self)
        self.aborted = False
        _LIVE.append(self)
        if ulfm.enabled():                             # --on-failure shrink: a death aborts
            ulfm.on_revoke(self.abort)
            nccl_watch.start(_LIVE)

    def abort(self) -> None:
        """End this communicator's NCCL work now (``ncclCommAbort``: a kernel waiting for a
        dead peer returns); every later call on it fails. Once; from any thread."""
        if not self.aborted:
            self.aborted = True
            self.comm.abort()
            if self in _LIVE:
                _LIVE.remove(self)

    def count(self, kind: str, nbytes: int) -> None:
        c = self.calls.setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += int(nbytes)
        self.bytes_sent += int(nbytes)

    @property
    def mpi(self):
        return self.host.mpi

    def iallreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None,
                   wire_dtype=None):
        """NCCL queues the allreduce on the current stream; ``wait()`` syncs the stream."""
        if wire_dtype is not None:
            raise ValueError("the NCCL backend has no wire dtype; use --compress none")
        return StreamHandle(self, "allreduce", self.allreduce(buf, op=op, out=out))

    def ireduce_scatter(self, buf, op: str = "sum", counts=None, algorithm: str = "auto"):
        return StreamHandle(self, "reduce_scatter",
                            self.reduce_scatter(buf, op=op, counts=counts))

    def iallgather(self, shard, total: int | None = None, counts=None, out=None,
                   algorithm: str = "auto"):
        return StreamHandle(self, "allgather",
                            self.allgather(shard, total=total, counts=counts, out=out))

    def ialltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto"):
        return StreamHandle(self, "alltoall", self.alltoall(buf, counts, recv_counts))

    def split(self, color: int, key: int | None = None):
        """An NCCL communicator over the ranks that pass the same ``color`` (collective)."""
        return NcclCommunicator(host=self.host.split(color, key), label=self.label)

    @contextlib.contextmanager
    def uncounted(self):
        """Calls inside are left out of ``bytes_sent`` and ``calls`` (a benchmark's probe)."""
        saved = self.bytes_sent, {k: list(v) for k, v in self.calls.items()}
        try:
            with self.host.uncounted():
                yield
        finally:
            self.bytes_sent, self.calls = saved

    def agree_only(self, kind: str, buf, op=None, root=None, length=None) -> int:
        """The ledger's number, check and agreement, over MPI: returns the call's number."""
        return self.host.agree_only(kind, buf, op=op, root=root, length=length)

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

    # ---- collectives -----------------------------------------------------------------------
    def allreduce(self, buf, op: str = "sum", algorithm: str = "auto", out=None):
        check_op(op)
        seq = self.agree_only("allreduce", buf, op)
        dt = self._args(buf)
        out = backend.xp().empty_like(buf) if out is None else out
        sent = 2 * (self.size - 1) * -(-buf.size // self.size) * buf.dtype.itemsize
        self.count("allreduce", sent)
        with watched(self, "allreduce", sent, seq):
            self.comm.allReduce(buf.data.ptr, out.data.ptr, buf.size, dt,
                                getattr(self.nccl, _NCCL_OPS[op]), self._stream())
        if op == "avg":
            out /= self.size
        return out

    def reduce_scatter(self, buf, op: str = "sum", counts=None, algorithm: str = "auto"):
        """This rank's piece of the reduction: the shard rule, or ``counts`` (pieces of
        other sizes): NCCL takes equal chunks, so each piece is padded to the largest."""
        check_op(op)
        seq = self.agree_only("reduce_scatter", buf, op)
        xp, dt, P = backend.xp(), self._args(buf), self.size
        counts = _counts(buf.size if counts is None else None, counts, P)
        S = max(counts)
        padded = xp.zeros(S * P, dtype=buf.dtype)
        flat, at = buf.reshape(-1), np.concatenate([[0], np.cumsum(counts)]).astype(int)
        for r in range(P):
            padded[r * S:r * S + counts[r]] = flat[at[r]:at[r + 1]]
        out = xp.empty(S, dtype=buf.dtype)
        self.count("reduce_scatter", (P - 1) * S * buf.dtype.itemsize)
        with watched(self, "reduce_scatter", (P - 1) * S * buf.dtype.itemsize, seq):
            self.comm.reduceScatter(padded.data.ptr, out.data.ptr, S, dt,
                                    getattr(self.nccl, _NCCL_OPS[op]), self._stream())
        if op == "avg":
            out /= P
        return out[:counts[self.rank]]

    def allgather(self, shard, total: int | None = None, counts=None, out=None,
                  algorithm: str = "auto"):
        """Every rank's piece, in rank order: equal pieces, the shard rule of ``total``, or
        ``counts`` (padded to the largest for NCCL, then put end to end)."""
        xp, dt, P = backend.xp(), self._args(shard), self.size
        if counts is None and total is None:
            counts = [shard.size] * P
        counts = _counts(total, counts, P)
        S, length = max(counts), sum(counts)
        seq = self.agree_only("allgather", shard, length=length)
        if shard.size != counts[self.rank]:
            raise ValueError(f"allgather: this rank's piece has {shard.size} elements, its "
                             f"count says {counts[self.rank]}")
        send = xp.zeros(S, dtype=shard.dtype)
        send[:shard.size] = shard.reshape(-1)
        full = xp.empty(S * P, dtype=shard.dtype)
        self.count("allgather", (P - 1) * S * shard.dtype.itemsize)
        with watched(self, "allgather", (P - 1) * S * shard.dtype.itemsize, seq):
            self.comm.allGather(send.data.ptr, full.data.ptr, S, dt, self._stream())
        if any(c != S for c in counts):
            full = xp.concatenate([full[r * S:r * S + counts[r]] for r in range(P)])
        else:
            full = full[:length]
        if out is not None:
            out.reshape(-1)[...] = full
            return out
        return full

    def allgatherv(self, buf):
        """Pieces of any sizes: the sizes over MPI first, then the padded allgather."""
        sizes = self.host.allgather(np.array([buf.size], dtype=np.int64))
        return self.allgather(buf.reshape(-1), counts=[int(n) for n in sizes])

    def alltoall(self, buf, counts=None, recv_counts=None, algorithm: str = "auto") -> list:
        """As ``Communicator.alltoall``: one NCCL group of a send and a receive per peer (the
        sizes, where the caller does not give them, over MPI first)."""
        buf, counts = pieces_of(buf, counts, self.size)
        xp, dt, P = backend.xp(), self._args(buf), self.size
        problem = unequal_problem(buf.size, counts, P)
        if problem:
            raise ValueError(problem)
        seq = self.agree_only("alltoall", buf, length=buf.size if counts is None else -1)
        counts = [buf.size // P] * P if counts is None else [int(c) for c in counts]
        if recv_counts is None:
            recv_counts = [int(p[0]) for p in self.host.alltoall(np.array(counts, np.int64))]
        send, out = buf.reshape(-1), xp.empty(sum(recv_counts), dtype=buf.dtype)
        so, ro = offsets(counts), offsets(recv_counts)
        item = buf.dtype.itemsize
        sent = (int(so[-1]) - counts[self.rank]) * item
        self.count("alltoall", sent)
        out[ro[self.rank]:ro[self.rank + 1]] = send[so[self.rank]:so[self.rank + 1]]
        with watched(self, "alltoall", sent, seq):
            self.nccl.groupStart()
            for peer in range(P):
                if peer != self.rank and counts[peer]:
                    self.comm.send(send.data.ptr + int(so[peer]) * item, counts[peer], dt,
                                   peer, self._stream())
                if peer != self.rank and recv_counts[peer]:
                    self.comm.recv(out.data.ptr + int(ro[peer]) * item,
                                   int(recv_counts[peer]), dt, peer, self._stream())
            self.nccl.groupEnd()
        return split(out, recv_counts)

    def reduce(self, buf, op: str = "sum", root: int = 0):
        """The reduced array on ``root`` (None elsewhere): NCCL's allreduce, kept on the root
        (the same result; NCCL's own reduce is not in the CuPy surface hpcdist checks)."""
        out = self.allreduce(buf, op=op)
        return out if self.rank == root else None

    def bcast(self, buf, root: int = 0, algorithm: str = "auto"):
        seq = self.agree_only("bcast", buf, root=root)
        dt = self._args(buf)
        self.count("bcast", buf.nbytes if self.rank == root else 0)
        with watched(self, "bcast", buf.nbytes, seq):
            self.comm.bcast(buf.data.ptr, buf.size, dt, root, self._stream())
        return buf

    def send(self, arr, dest: int, tag: int = 0) -> None:
        """Shape and dtype go over MPI (the p2p header); the payload over NCCL: an ``isend``
        waited at once (numbered with the queued ones: NCCL pairs in posting order)."""
        self.p2p.isend(arr, dest, tag).wait()

    def recv(self, source: int, tag: int = 0):
        """The header over MPI first (the shape), then the payload over NCCL."""
        return self.p2p.take(source, tag, self.host.recv(source, tag)).wait()

    def isend(self, arr, dest: int, tag: int = 0):
        """Queued; sent with the next group (nccl_work.py). ``wait()`` before reusing arr."""
        return self.p2p.isend(arr, dest, tag)

    def irecv(self, source: int, tag: int = 0, shape=None, dtype=None):
        """Queued into a buffer of ``shape`` and ``dtype`` (NCCL needs them up front)."""
        return self.p2p.irecv(source, tag, shape, dtype)

    def sendrecv(self, arr, dest: int, source: int, sendtag: int = 0, recvtag: int | None = None):
        """Send ``arr`` to ``dest`` while receiving from ``source``: both headers over MPI
        (this rank's posted before it waits for the peer's), both payloads in one NCCL
        group (so a ring of sendrecvs cannot deadlock)."""
        tag = sendtag if recvtag is None else recvtag
        sent = self.p2p.isend(arr, dest, sendtag)
        out = self.p2p.take(source, tag, self.host.recv(source, tag)).wait()
        sent.wait()
        return out

    def barrier(self) -> None:
        backend.synchronize()
        self.host.barrier()

    def close(self) -> None:
        if not self.aborted:                     # (an aborted communicator is freed)
            self.comm.destroy()
        self.host.close()
        if self in _LIVE:
            _LIVE.remove(self)


def _counts(total, counts, P: int) -> list:
    """Each rank's piece: ``counts`` as given, or the shard rule of ``total`` elements."""
    if counts is not None:
        if len(counts) != P:
            raise ValueError(f"counts has {len(counts)} entries for {P} ranks")
        return [int(c) for c in counts]
    return shard_counts(total, P)


def counts() -> dict:
    """{group label: {kind: [calls, bytes sent]}} over this process's NCCL communicators."""
    out: dict = {}
    for nc in _LIVE:
        mine = out.setdefault(nc.label, {})
        for kind, (n, b) in nc.calls.items():
            have = mine.setdefault(kind, [0, 0])
            have[0] += n
            have[1] += b
    return out


def _routed(method):
    """A call on host arrays goes to the MPI Communicator beside NCCL; any other first
    issues the queued point-to-point group (so the stream keeps the program's order)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        data = args[0] if args else next(iter(kwargs.values()), None)
        first = data[0] if isinstance(data, (list, tuple)) and data else data
        if name in ON_HOST and first is not None and not backend.is_gpu_array(first):
            return getattr(self.host, name)(*args, **kwargs)
        self.p2p.flush()
        return method(self, *args, **kwargs)
    return call


for _name in REFUSED:
    setattr(NcclCommunicator, _name, _refusal(_name))
for _name in ON_HOST + ("recv", "barrier", "close"):
    setattr(NcclCommunicator, _name, _routed(getattr(NcclCommunicator, _name)))


def make_communicator(backend_name: str = "mpi", mpi_comm=None, host=None,
                      label: str = "world"):
    """``"mpi"``: our collectives over MPI (host staging for GPU arrays where needed);
    ``"nccl"``: NCCL through CuPy, beside ``host`` (a Communicator) or one over mpi_comm."""
    if backend_name == "mpi":
        from .communicator import Communicator
        return host if host is not None else Communicator(mpi_comm)
    if backend_name == "nccl":
        return NcclCommunicator(mpi_comm, host=host, label=label)
    raise ValueError(f"unknown communication backend {backend_name!r}: choose mpi or nccl")
