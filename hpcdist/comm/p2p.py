"""Point-to-point transfer of arrays whose shape and dtype travel with them, without pickle.

Each message is a fixed 16 x int64 header — dtype code, payload tag, ndim, shape — on the
user's tag, then the payload bytes on the payload tag the header names. Headers alone share
the user's tag, so several receives posted at once match messages in the order they were sent
(MPI's non-overtaking rule); each payload has its own tag (a per-destination sequence number),
so a payload can never be taken for a header. User tags: 0 <= tag < MAX_TAG.
"""
from __future__ import annotations

import numpy as np

from ..device import backend
from . import watchdog
from .arith import as_bytes

HEADER_LEN = 16
MAX_NDIM = HEADER_LEN - 3
MAX_TAG = 4096                 # user tags; payload tags live above, within MPI's 32767
PAYLOAD_TAGS = 32767 - MAX_TAG
DTYPE_NAMES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
               "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "bfloat16")


_CODES: dict = {}   # dtype -> code; np.dtype(...).name is slow enough to show per call
KNOWN = _CODES      # native-order dtypes that can be sent (filled as they are met)


def dtype_code(dtype) -> int:
    code = _CODES.get(dtype)
    if code is None:
        name = np.dtype(dtype).name
        if name not in DTYPE_NAMES:
            raise TypeError(f"dtype {name} cannot be sent: supported are {', '.join(DTYPE_NAMES)}")
        code = DTYPE_NAMES.index(name)
        if np.dtype(dtype).isnative:
            _CODES[dtype] = code
    return code


def dtype_from_code(code: int):
    name = DTYPE_NAMES[int(code)]
    return backend.dtype("bf16") if name == "bfloat16" else np.dtype(name)


def payload_tag(seq: int) -> int:
    return MAX_TAG + seq % PAYLOAD_TAGS


def make_header(arr, ptag: int) -> np.ndarray:
    if arr.ndim > MAX_NDIM:
        raise ValueError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
    h = np.zeros(HEADER_LEN, dtype=np.int64)
    h[0], h[1], h[2] = dtype_code(arr.dtype), ptag, arr.ndim
    h[3:3 + arr.ndim] = arr.shape
    return h


def alloc_from_header(h: np.ndarray, xp):
    shape = tuple(int(n) for n in h[3:3 + int(h[2])])
    return xp.empty(shape, dtype=dtype_from_code(h[0])), int(h[1])


class SendHandle:
    """A pending send; ``wait()`` completes it, ``test()`` says whether it has."""

    def __init__(self, requests, keep):
        self._requests, self._keep = requests, keep   # keep buffers alive until done

    def test(self) -> bool:
        from mpi4py import MPI
        return MPI.Request.Testall(self._requests)

    def wait(self):
        watchdog.wait_requests(self._requests)
        self._keep = None


class RecvHandle:
    """A pending receive: the header first, then the payload it announces."""

    def __init__(self, comm, source, tag, xp, finish=None):
        self._comm, self._source, self._tag, self._xp = comm, source, tag, xp
        self._header = np.empty(HEADER_LEN, dtype=np.int64)
        self._req = comm.Irecv(self._header, source, tag)
        self._payload = None
        self._finish = finish or (lambda a: a)
        self._result = None

    def _ready(self, block: bool) -> bool:
        if block:
            watchdog.wait_requests([self._req])
            return True
        return self._req.Test()

    def _step(self, block: bool) -> bool:
        if self._result is not None:
            return True
        if self._payload is None:                  # stage 1: the header
            if not self._ready(block):
                return False
            self._payload, ptag = alloc_from_header(self._header, self._xp)
            self._req = self._comm.Irecv(as_bytes(self._payload), self._source, ptag)
        if not self._ready(block):                 # stage 2: the payload
            return False
        self._result = self._finish(self._payload)
        return True

    def test(self) -> bool:
        return self._step(block=False)

    def wait(self):
        self._step(block=True)
        return self._result

    def cancel(self) -> None:
        """Withdraw a receive whose message will never come (before its header arrived)."""
        if self._payload is None and not self._req.Test():
            self._req.Cancel()
            self._req.Wait()


def expecting(shape, dtype, source: int, tag: int, then=None):
    """A receive's finish: ``then`` (or nothing), after checking the array is of ``shape``
    and ``dtype`` where they are given."""
    def finish(arr):
        if (shape is not None and tuple(arr.shape) != tuple(shape)) or \
                (dtype is not None and arr.dtype != np.dtype(dtype)):
            raise ValueError(f"the message from rank {source} (tag {tag}) is "
                             f"{arr.dtype}{tuple(arr.shape)}, the receive expected "
                             f"{np.dtype(dtype) if dtype is not None else arr.dtype}"
                             f"{tuple(shape) if shape is not None else tuple(arr.shape)}")
        return then(arr) if then else arr
    return finish


def isend(comm, arr, dest: int, tag: int, ptag: int) -> SendHandle:
    h = make_header(arr, ptag)
    reqs = [comm.Isend(h, dest, tag), comm.Isend(as_bytes(arr), dest, ptag)]
    return SendHandle(reqs, (h, arr))


def send(comm, arr, dest: int, tag: int, ptag: int) -> None:
    isend(comm, arr, dest, tag, ptag).wait()


def recv(comm, source: int, tag: int, xp):
    return RecvHandle(comm, source, tag, xp).wait()
