"""Device arrays staged through host memory for MPI: reused pinned buffers, one per (thread,
purpose), so that a device array's values cross MPI without a fresh allocation per call."""
from __future__ import annotations

import threading

import numpy as np

from . import backend

_pinned: dict = {}   # (thread id, purpose) -> reused page-locked host buffer


def host_buffer(nbytes: int, key=0) -> np.ndarray:
    """A reused uint8 host buffer of at least ``nbytes`` for staging device arrays: pinned
    (page-locked) memory on a real GPU, so copies run at full PCIe/NVLink-C2C speed and need
    no pageable bounce; plain memory otherwise. One per (calling thread, ``key``): the caller
    owns it until its next call with the same key on the same thread."""
    slot = (threading.get_ident(), key)
    buf = _pinned.get(slot)
    if buf is None or buf.nbytes < nbytes:
        size = max(nbytes, 2 * (buf.nbytes if buf is not None else 0), 4096)
        if backend.device() == "gpu":
            mem = backend._cupy.cuda.alloc_pinned_memory(size)
            buf = np.frombuffer(mem, dtype=np.uint8, count=size)
        else:
            buf = np.empty(size, dtype=np.uint8)
        _pinned[slot] = buf
    return buf[:nbytes]


def to_host(arr, key=0) -> np.ndarray:
    """A flat host array with ``arr``'s values: ``arr`` itself on the host; for a device
    array, a view of a reused pinned buffer (valid until the next ``to_host`` with ``key`` on
    this thread). The producing stream is synchronised first."""
    if not backend.is_gpu_array(arr):
        return arr.reshape(-1)
    host = host_buffer(arr.nbytes, key).view(arr.dtype)
    if not arr.flags.c_contiguous:
        arr = backend._cupy.ascontiguousarray(arr)
    arr.get(out=host.reshape(arr.shape))      # blocking: ordered after arr's producers
    return host


def from_host(host, like, out=None):
    """``host``'s values on ``like``'s device: into ``out`` when given, else a new array."""
    if not backend.is_gpu_array(like):
        if out is None:
            return host
        out.reshape(-1)[...] = host.reshape(-1)
        return out
    if out is None:
        return backend._cupy.asarray(host)
    out.set(host.reshape(out.shape))
    return out
