"""Short collectives: the agreement carries the data.

Every collective starts with the ledger's agreement (ledger.py): a recursive-doubling exchange
of a 16-byte header [max key, -min key]. For a short buffer the data rides in the same
messages — header first, payload after — so a short allreduce, broadcast, allgather or
reduce-scatter costs one recursive doubling in all, checked, instead of a check and then the
collective. At each step a rank folds its peer's payload into its own only while every key it
has seen is its own (so the payload it folds always has its length and dtype); the result is
used only when the exchange agreed, and a disagreement raises as any other mismatch does.

The rest of this design: docs/communication.md, "hpcdist/comm/short.py"."""
from __future__ import annotations

import atexit
import struct
import weakref

import numpy as np
from mpi4py import MPI

from . import watchdog
from .arith import fold_rank, unfold_rank
from .algorithm import Algorithm, fold_time, rounds

HEADER = 16                     # bytes: int64 [max key, -min key]
MAX_PAYLOAD = 64 << 10          # the longest payload an exchange carries (select.py's limits)
TAG = 190
CACHED = 64                     # exchanges kept per communicator (the oldest go)


class Exchange:
    """Recursive doubling of [max key, -min key] + ``nbytes`` of ``dtype`` payload on ``wire``.

    Non-powers of two fold as MPICH does: the first 2*rem ranks pair up, each even one hands
    its part to its odd neighbour before the doubling and gets the result back after it.
    """

    def __init__(self, wire, rbuf: np.ndarray, nbytes: int, dtype):
        self.wire = wire
        P, r = wire.Get_size(), wire.Get_rank()
        itemsize = np.dtype(dtype).itemsize
        # A one-element payload travels with a zero beside it: NumPy 2's ufuncs take 1.2 us
        # on one element and 0.45 us on two (the fold runs log2(P) times a call).
        padded = itemsize * 2 if nbytes == itemsize else nbytes
        self.work = np.zeros(HEADER + padded, dtype=np.uint8)
        self.hdr = self.work[:HEADER].view(np.int64)
        self.data = self.work[HEADER:HEADER + nbytes].view(dtype)   # payload, then result
        self.mine = self.work[HEADER:].view(dtype)                   # what folds
        self.peer = rbuf[HEADER:HEADER + padded].view(dtype)
        self.rbuf = rbuf
        self.rhdr = rbuf[:HEADER].view(np.int64)
        self.hview, self.rview = memoryview(self.work)[:HEADER], memoryview(rbuf)[:HEADER]
        pof2, new_rank = fold_rank(r, P)
        self.fold = 0                              # 1: hands its part in, -1: takes it in
        if r < 2 * (P - pof2):
            self.fold = 1 if r % 2 == 0 else -1
        self.neighbour = r + 1 if self.fold == 1 else r - 1      # (the fold's partner)
        if self.fold == 1:                         # phase 1: the evens send theirs in ...
            self.fold_in = [wire.Send_init(self.work, r + 1, TAG)]
            self.fold_out = [wire.Recv_init(rbuf, r + 1, TAG + 1)]   # ... and get the result
        elif self.fold == -1:
            self.fold_in = [wire.Recv_init(rbuf, r - 1, TAG)]
            self.fold_out = [wire.Send_init(self.work, r - 1, TAG + 1)]
        self.rounds = []                           # phase 2: recursive doubling
        mask = 1
        while new_rank >= 0 and mask < pof2:
            peer = unfold_rank(new_rank ^ mask, P)               # distance doubles every round
            self.rounds.append(([wire.Recv_init(rbuf, peer, TAG),
                                 wire.Send_init(self.work, peer, TAG)], peer))
            mask <<= 1
        self.nbytes = nbytes                       # payload bytes per send

    def run(self, key: int, fold=None, wait=None) -> bool:
        """Exchange; True when every rank's key equals ``key``. ``fold(mine, peer, out=mine)``
        (a ufunc) combines payloads; ``self.data`` then holds the result on every rank.
        ``wait`` (a watchdog.Wait) is registered while a step has to wait."""
        mine, peer, wire, n = self.mine, self.peer, self.wire, self.nbytes
        _pack(self.work, 0, key, -key)
        agreed = True                              # every header seen so far was [key, -key]
        if self.fold == 1:
            _complete(wire, self.fold_in, wait, n, self.neighbour)
        elif self.fold == -1:
            _complete(wire, self.fold_in, wait, 0)
            agreed = self._merge(key, agreed)
            if agreed and fold is not None:
                fold(mine, peer, out=mine)
        for requests, dest in self.rounds:
            _complete(wire, requests, wait, n, dest)
            agreed = self._merge(key, agreed)
            if agreed and fold is not None:
                fold(mine, peer, out=mine)
        if self.fold == -1:
            _complete(wire, self.fold_out, wait, n, self.neighbour)
        elif self.fold == 1:
            _complete(wire, self.fold_out, wait, 0)
            self.hdr[...] = self.rhdr              # the odd neighbour's header is everyone's
            agreed = self.rview == _header(key)
            if agreed:
                mine[...] = peer
        return agreed

    def _merge(self, key: int, agreed: bool) -> bool:
        """Fold the peer's header into ours; True when both saw only ``key`` so far."""
        if agreed and self.rview == self.hview:  # the same [key, -key] (compares the bytes)
            return True
        hdr, rhdr = self.hdr, self.rhdr
        if rhdr[0] > hdr[0]:
            hdr[0] = rhdr[0]
        if rhdr[1] > hdr[1]:
            hdr[1] = rhdr[1]
        return False

    def free(self) -> None:
        for requests in [r for r, _ in self.rounds] + \
                ([self.fold_in, self.fold_out] if self.fold else []):
            for q in requests:
                q.Free()
        self.rounds, self.fold = [], 0

    def __del__(self):                     # mpi4py never frees a request it drops
        try:
            if self.rounds or self.fold:
                if not MPI.Is_finalized():
                    self.free()
        except Exception:
            pass


_pack = struct.Struct("=qq").pack_into


def _header(key: int) -> bytes:
    return struct.pack("=qq", key, -key)


def _complete(wire, requests, wait, nbytes, dest=None) -> None:
    """Start persistent requests (``nbytes`` of payload sent to ``dest``, counted by the wire)
    and wait for them (watchdog back-off; ``wait`` registered only when the first test finds
    them unfinished)."""
    wire.Startall(requests, nbytes, dest)
    if not _testall(requests):
        watchdog.wait_requests(requests, wait)


_testall = MPI.Request.Testall


class Exchanges:
    """The exchanges of one wire, by payload size and dtype (the oldest freed beyond
    ``CACHED``). Use from one thread: each wire has its own."""

    def __init__(self, wire):
        self.wire = wire
        self.rbuf = np.empty(HEADER + MAX_PAYLOAD + 16, dtype=np.uint8)   # + a padded element
        self._by_shape: dict = {}
        _LIVE.add(self)

    def get(self, nbytes: int, dtype) -> Exchange:
        ex = self._by_shape.get((nbytes, dtype))
        if ex is None:
            if len(self._by_shape) >= CACHED:
                self._by_shape.pop(next(iter(self._by_shape))).free()
            ex = self._by_shape[(nbytes, dtype)] = Exchange(self.wire, self.rbuf, nbytes, dtype)
        return ex

    def free(self) -> None:
        for ex in self._by_shape.values():
            ex.free()
        self._by_shape.clear()


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _free_all() -> None:
    """Free every persistent request before MPI finalizes (MPICH warns of each one left;
    mpi4py finalizes after Python's exit handlers)."""
    for exchanges in list(_LIVE):
        exchanges.free()


# Short calls carry the agreement's header in their own messages: one recursive doubling,
# checked. Every recursive-doubling allreduce is short enough; the other kinds send their
# whole buffer log2(P) times that way, so only up to a size. Fused / plain (the check, then
# ring or binomial) time, median of 300 blocking calls, float32, on the 2-core machine:
#   bytes    reduce-scatter N=2/4/8   allgather N=2/4/8     bcast N=2/4/8
#   4 KiB    0.30 / 0.31 / 0.22       0.47 / 0.39 / 0.31    0.55 / 0.56 / 0.51
#   8 KiB    0.31 / 0.38 / 0.42       0.59 / 0.64 / 0.70    0.75 / 0.82 / 1.21
#   16 KiB   0.63 / 1.10 / 0.43       0.82 / 1.36 / 0.79    1.12 / 1.00 / 0.97
#   64 KiB   1.56 / 1.31 / 0.44       1.31 / 1.35 / 0.56    2.52 / 1.76 / 1.17
SHORT = "recursive_doubling+check"
SHORT_LIMITS = {"allreduce": 64 << 10, "reduce_scatter": 16 << 10,   # the whole buffer
                "allgather": 8 << 10,                             # the whole gathered array
                "bcast": 8 << 10, "barrier": 0}


def _wire_bytes(kind, n, P, itemsize):
    pof2, steps = rounds(P)
    return (n * itemsize if pof2 != P else 0) + steps * n * itemsize


SHORT_EXCHANGE = Algorithm(
    SHORT, kinds=("barrier",), auto=lambda kind, nbytes, world: True, checked=False,
    wire_bytes=_wire_bytes,
    cost=lambda kind, nbytes, P, a, b: fold_time(nbytes, P, a, b) + rounds(P)[1] * (
        a + nbytes * b))
