"""The GPU stand-in's NCCL: ``cupy.cuda.nccl`` as hpcdist calls it, over MPI's own collectives.

Where no GPU is, this stands in for NCCL so that the NCCL backend (comm/nccl.py) runs its
whole protocol with the arguments and types a real ``NcclCommunicator`` takes (each call binds
to the typed signature in ``surface.NCCL``). The data moves with MPI's built-in collectives on
the arrays behind the pointers (the GPU stand-in's pointers are host addresses). The ranks meet as
NCCL's do over its id's socket address: each writes its rank under a folder named by the id's
token, and their MPI communicator is made from that group of the world (MPI_COMM_WORLD, or the
survivors after an in-job recovery: ``_use_world``). ``abort`` is ``ncclCommAbort``: the
stand-in revokes its communicator (ULFM), so a call waiting on a dead peer returns with an
error, and every later call fails.
"""
from __future__ import annotations

import ctypes
import os
import tempfile
import time

import numpy as np
from mpi4py import MPI

from .standin_graph import RECORDER, record
from .surface import NCCL, signature, typed_parameters

# NCCL's codes (nccl.h): data types and reduction ops
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32,
           8: np.float64, 9: "bfloat16"}
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
_OPS = {NCCL_SUM: MPI.SUM, NCCL_PROD: MPI.PROD, NCCL_MAX: MPI.MAX, NCCL_MIN: MPI.MIN}
_INTEGER = {"int", "size_t", "intptr_t"}
RENDEZVOUS_S = 60.0

_group: list | None = None          # send/recv queued between groupStart and groupEnd
_world = None                       # the MPI communicator of every live rank (None: COMM_WORLD)


def _use_world(comm) -> None:
    """The stand-in's own: where its rendezvous finds the members (not in CuPy's surface)."""
    global _world
    _world = comm


def _bind(name: str, args: tuple) -> None:
    """Refuse a call CuPy would refuse: the listed signature and its C types."""
    text = NCCL[name][1]
    params = list(signature(text).parameters)
    try:
        signature(text).bind(*args)
    except TypeError as e:
        raise TypeError(f"cupy.cuda.nccl.{name}{text}: {e}") from None
    skip = 1 if params and params[0] == "self" else 0
    for (ctype, pname), value in zip(typed_parameters(text), args[skip:]):
        ok = hasattr(value, "__index__") if ctype in _INTEGER else \
            isinstance(value, bytes) if ctype == "bytes" else True
        if not ok:
            raise TypeError(f"cupy.cuda.nccl.{name}: {pname} must be {ctype}, got "
                            f"{type(value).__name__}")


ID_PREFIX = b"hpcdist-standin"      # then 32 random hex digits: the rendezvous folder's name


def get_unique_id() -> bytes:
    _bind("get_unique_id", ())
    tag = ID_PREFIX + os.urandom(16).hex().encode()
    return tag + bytes(128 - len(tag))


def groupStart() -> None:           # noqa: N802 (NCCL's name)
    global _group
    _bind("groupStart", ())
    _group = []


def groupEnd() -> None:             # noqa: N802
    global _group
    _bind("groupEnd", ())
    queued, _group = _group or [], None
    MPI.Request.Waitall([post() for post in queued])


def _array(ptr: int, count: int, datatype: int) -> np.ndarray:
    dtype = _dtype(datatype)
    if count == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)


def _moved(ptr: int, count: int, datatype: int) -> np.ndarray:
    """The array at ``ptr`` as bytes MPI can move: bf16 as its 16-bit words."""
    a = _array(ptr, count, datatype)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def _dtype(datatype: int) -> np.dtype:
    if _DTYPES[datatype] == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[datatype])


def _reduced(comm, src, out, op) -> None:
    """MPI's allreduce of ``src`` into ``out`` (``src`` None: in place); bf16, which MPI has
    no type for, is summed in float32 and rounded once, as NCCL's bf16 reductions are."""
    if out.dtype.name != "bfloat16":
        comm.Allreduce(MPI.IN_PLACE if src is None else src, out, op=op)
        return
    wide = (out if src is None else src).astype(np.float32)
    comm.Allreduce(MPI.IN_PLACE, wide, op=op)
    out[...] = wide


def _rendezvous(ndev: int, comm_id: bytes, rank: int):
    """The MPI communicator of the ``ndev`` ranks holding ``comm_id``, in NCCL rank order."""
    world = _world or MPI.COMM_WORLD
    folder = os.path.join(tempfile.gettempdir(),
                          "hpcdist-nccl-" + comm_id[len(ID_PREFIX):len(ID_PREFIX) + 32]
                          .decode(errors="replace"))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{rank}.tmp"), "w") as f:
        f.write(str(world.Get_rank()))
    os.replace(os.path.join(folder, f"{rank}.tmp"), os.path.join(folder, str(rank)))
    deadline = time.monotonic() + RENDEZVOUS_S
    while len([n for n in os.listdir(folder) if n.isdigit()]) < ndev:
        if time.monotonic() > deadline:
            raise RuntimeError(f"NCCL stand-in: {ndev} ranks expected at the rendezvous, "
                               f"{len(os.listdir(folder))} came within {RENDEZVOUS_S:.0f} s")
        time.sleep(0.001)
    members = [int(open(os.path.join(folder, str(r))).read()) for r in range(ndev)]
    comm = world.Create_group(world.Get_group().Incl(members))
    comm.Barrier()                               # everyone has read the folder
    if rank == 0:
        for r in range(ndev):
            os.remove(os.path.join(folder, str(r)))
        os.rmdir(folder)
    return comm


def _captured(run) -> None:
    """A collective run now and, inside a CUDA graph's capture, recorded: a replay runs it
    again on the same memory, as a captured NCCL kernel does (NCCL 2.9 and later take a
    capturing stream)."""
    run()
    if RECORDER.on:
        record(run)


class NcclCommunicator:
    """NCCL's communicator: its collectives by MPI's built-ins on the pointed-to arrays."""

    def __init__(self, ndev, commId, rank):          # noqa: N803 (CuPy's names)
        _bind("NcclCommunicator", (ndev, commId, rank))
        self._comm = _rendezvous(ndev, commId, rank)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):   # noqa: N802
        _bind("NcclCommunicator.allReduce", (self, sendbuf, recvbuf, count, datatype, op,
                                             stream))
        out = _array(recvbuf, count, datatype)
        src = None if sendbuf == recvbuf else _array(sendbuf, count, datatype)
        _captured(lambda: _reduced(self._comm, src, out, _OPS[op]))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        _bind("NcclCommunicator.reduceScatter", (self, sendbuf, recvbuf, recvcount, datatype,
                                                 op, stream))
        n = self._comm.Get_size()
        src, out = _array(sendbuf, recvcount * n, datatype), _array(recvbuf, recvcount, datatype)
        _captured(lambda: self._reduce_scatter(src, out, recvcount, _OPS[op]))

    def _reduce_scatter(self, src, out, recvcount: int, op) -> None:
        if out.dtype.name == "bfloat16":            # (no MPI type: summed in float32)
            wide = src.astype(np.float32)
            self._comm.Allreduce(MPI.IN_PLACE, wide, op=op)
            r = self._comm.Get_rank()
            out[...] = wide[r * recvcount:(r + 1) * recvcount]
            return
        self._comm.Reduce_scatter_block(src, out, op=op)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):       # noqa: N802
        _bind("NcclCommunicator.allGather", (self, sendbuf, recvbuf, count, datatype, stream))
        mine = _moved(sendbuf, count, datatype)
        every = _moved(recvbuf, count * self._comm.Get_size(), datatype)
        _captured(lambda: self._comm.Allgather(mine, every))

    def bcast(self, buff, count, datatype, root, stream):
        _bind("NcclCommunicator.bcast", (self, buff, count, datatype, root, stream))
        data = _moved(buff, count, datatype)
        _captured(lambda: self._comm.Bcast(data, root=root))

    def send(self, sendbuf, count, datatype, peer, stream):
        _bind("NcclCommunicator.send", (self, sendbuf, count, datatype, peer, stream))
        self._queue(lambda: self._comm.Isend(_moved(sendbuf, count, datatype), peer))

    def recv(self, recvbuf, count, datatype, peer, stream):
        _bind("NcclCommunicator.recv", (self, recvbuf, count, datatype, peer, stream))
        self._queue(lambda: self._comm.Irecv(_moved(recvbuf, count, datatype), peer))

    def _queue(self, post) -> None:
        if _group is None:                       # outside a group: one call, done now
            post().Wait()
        else:
            _group.append(post)

    def destroy(self):
        _bind("NcclCommunicator.destroy", (self,))
        if self._comm is not None and self._comm != MPI.COMM_NULL:
            self._comm.Free()
        self._comm = None

    def abort(self):
        _bind("NcclCommunicator.abort", (self,))
        comm, self._comm = self._comm, None      # later calls fail, as on an aborted comm
        if comm is not None and hasattr(comm, "Revoke"):
            try:
                comm.Revoke()
            except (MPI.Exception, NotImplementedError):
                pass

    def check_async_error(self):
        """NCCL's asynchronous error: none here (the stand-in's errors are raised in the
        call that meets them)."""
        _bind("NcclCommunicator.check_async_error", (self,))
