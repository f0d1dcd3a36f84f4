"""NCCL work the host waits on: a collective queued on the stream, and point-to-point calls
batched into one NCCL group; every wait watched (the watchdog names a stalled NCCL call, the
timeline records it).

NCCL pairs sends and receives in posting order (no tags), needs the receive buffer up front,
and a lone send waits for its peer. So ``isend`` and ``irecv`` (with the receiver's shape and
dtype, as Megatron's p2p takes them) are queued and go to NCCL in one group at the first
``wait``/``test`` or the next call: a ring or a pipeline step cannot deadlock on its order.
Each message's header (shape, dtype, number per peer) goes over MPI and is checked after
the payload: a mismatched pair is an error naming both, not silent garbage.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..device import backend, graphs
from ..host import timeline
from . import p2p, watchdog


@contextlib.contextmanager
def watched(nc, kind: str, nbytes: int = 0, seq: int = 0, peers: str | None = None):
    """The watchdog's wait and the timeline's record around NCCL work of communicator ``nc``
    (``seq``: the ledger's number of a collective; point-to-point has none). On a GPU the
    host waits where it synchronizes with the stream; on the GPU stand-in, in the call."""
    who = peers or ("all ranks" if nc.host.label == "world" else nc.host.label)
    name = "NCCL " + (nc.label if nc.label == nc.host.label else
                      f"{nc.label} ({nc.host.label})")
    wait = watchdog.enter(name, seq, kind, nbytes, who)
    try:
        with timeline.collective(kind, "nccl", nbytes, nc.size):
            yield
    finally:
        watchdog.leave(wait)


class StreamHandle:
    """A collective queued on the CUDA stream: done once the stream reaches it."""

    def __init__(self, nc, kind: str, result):
        self._nc, self._kind, self._result = nc, kind, result

    def test(self) -> bool:
        return True

    def wait(self):
        if graphs.capture_token() is not None:  # a CUDA graph's capture: the stream's order
            return self._result                 # is the wait (a synchronize would end it)
        with watched(self._nc, f"wait for {self._kind}"):
            backend.synchronize(self._result)
        return self._result


class _Op:
    __slots__ = ("kind", "arr", "peer", "tag", "seq", "header", "done")

    def __init__(self, kind, arr, peer, tag, seq, header):
        self.kind, self.arr, self.peer, self.tag = kind, arr, peer, tag
        self.seq, self.header, self.done = seq, header, False


class Handle:
    """A queued send or receive: ``wait()`` issues the queue, syncs the stream, and returns
    the received array (None for a send)."""

    def __init__(self, batch: "Batch", op: _Op):
        self._batch, self._op = batch, op

    def test(self) -> bool:
        self.wait()
        return True

    def wait(self):
        self._batch.flush()
        op = self._op
        if not op.done:
            way = "to" if op.kind == "send" else "from"
            with watched(self._batch.nc, f"wait for {op.kind} {way} rank {op.peer} (tag "
                         f"{op.tag})", op.arr.nbytes, peers=f"rank {op.peer}"):
                backend.synchronize(op.arr)
            if op.kind == "send":
                op.header.wait()
            elif op.header is not None:           # (a receive by ``take``: checked already)
                self._batch.check(op)
            op.done = True
        return op.arr if op.kind == "recv" else None


class Batch:
    """The queue of one NCCL communicator's point-to-point calls."""

    def __init__(self, nc):
        self.nc = nc                      # the NcclCommunicator: .comm, .nccl, .host, _args
        self.queue: list = []
        self.sent: dict = {}              # peer -> messages queued to it
        self.received: dict = {}          # peer -> receives queued from it

    def isend(self, arr, dest: int, tag: int) -> Handle:
        self.nc._args(arr)
        seq = self.sent.get(dest, 0)
        self.sent[dest] = seq + 1
        header = self.nc.host.isend(p2p.make_header(arr, seq), dest, tag)
        op = _Op("send", arr, dest, tag, seq, header)
        self.queue.append(op)
        return Handle(self, op)

    def irecv(self, source: int, tag: int, shape, dtype) -> Handle:
        if shape is None or dtype is None:
            raise NotImplementedError(
                "irecv on the NCCL backend needs the shape and dtype it receives (NCCL "
                "receives into a buffer of known size): irecv(source, tag, shape=..., "
                "dtype=...)")
        arr = backend.xp().empty(tuple(shape), dtype=dtype)
        self.nc._args(arr)
        seq = self.received.get(source, 0)
        self.received[source] = seq + 1
        op = _Op("recv", arr, source, tag, seq, self.nc.host.irecv(source, tag))
        self.queue.append(op)
        return Handle(self, op)

    def flush(self) -> None:
        """Everything queued, in one NCCL group, in posting order."""
        if not self.queue:
            return
        ops, self.queue = self.queue, []
        nc = self.nc
        peers = ", ".join(str(p) for p in sorted({op.peer for op in ops}))
        with watched(nc, f"group of {len(ops)} send/recv", sum(op.arr.nbytes for op in ops),
                     peers=f"rank{'s' if ',' in peers else ''} {peers}"):
            nc.nccl.groupStart()
            for op in ops:
                call = nc.comm.send if op.kind == "send" else nc.comm.recv
                call(op.arr.data.ptr, op.arr.size, nc._args(op.arr), op.peer, nc._stream())
                nc.count(op.kind, op.arr.nbytes if op.kind == "send" else 0)
            nc.nccl.groupEnd()

    def take(self, source: int, tag: int, header) -> Handle:
        """A receive whose header (``header``, received already: a blocking receive learns
        the shape first) is in hand: queued into a buffer of that shape, numbered as
        ``irecv``'s are (NCCL pairs messages in posting order)."""
        arr, seq = p2p.alloc_from_header(header, backend.xp())
        want = self.received.get(source, 0)
        self.received[source] = want + 1
        op = _Op("recv", arr, source, tag, want, None)
        if seq != want:
            raise RuntimeError(self._mismatch(op, seq, arr.dtype, arr.shape))
        self.queue.append(op)
        return Handle(self, op)

    def _mismatch(self, op: _Op, seq: int, dtype, shape) -> str:
        return (f"NCCL point-to-point mismatch on {self.nc.host.label}: rank {self.nc.rank}'s "
                f"receive number {op.seq} from rank {op.peer} (tag {op.tag}) expected "
                f"{op.arr.dtype}{op.arr.shape}, but rank {op.peer}'s message number {seq} "
                f"with that tag is {dtype}{shape} (NCCL pairs messages in posting order: "
                "post sends and receives between two ranks in the same order)")

    def check(self, op: _Op) -> None:
        """The sender's header against what this receive expected."""
        h = op.header.wait()
        like, seq = p2p.alloc_from_header(h, np)
        if seq != op.seq or like.shape != op.arr.shape or like.dtype != op.arr.dtype:
            raise RuntimeError(self._mismatch(op, seq, like.dtype, like.shape))
