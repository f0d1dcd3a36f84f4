"""The GPU stand-in's runtime beside its arrays: ``cupyx.scatter_add``, ``cupy.cuda`` (streams
that capture CUDA graphs, devices, pinned memory, memory pools and information) and
``cupy.random`` (NumPy's draws as device arrays), built by ``namespaces`` from standin.py's
binders (this module imports none of standin.py: it is called with them)."""
from __future__ import annotations

import contextlib
import types

import numpy as _np

from . import standin_graph
from .surface import CUDA, CUPYX, READS


class _Stream:
    """A stream: the GPU stand-in's work is done when a call returns. A capture (``begin_capture``
    to ``end_capture``) runs the work as it is issued, records each launch
    (standin_graph.py: its graph's ``launch`` replays them) and refuses what CUDA refuses
    inside one: device-to-host reads (READS), synchronizations, host arrays copied in
    (standin.py)."""
    ptr = 0

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self._capturing = False

    def synchronize(self) -> None:
        if READS.capturing:
            raise RuntimeError("a synchronization while a stream captures a CUDA graph (CUDA "
                               "refuses it: cudaErrorStreamCaptureUnsupported)")

    def begin_capture(self, mode=None) -> None:
        if self._capturing:
            raise RuntimeError("the stream is capturing already")
        standin_graph.begin()
        self._capturing = True
        READS.capturing += 1

    def end_capture(self):
        if not self._capturing:
            raise RuntimeError("the stream is not capturing")
        self._capturing = False
        READS.capturing -= 1
        return standin_graph.end()

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class _PrivatePool:
    """``cupy.cuda.MemoryPool``: the GPU stand-in's arrays are NumPy's; ``malloc`` is what
    ``using_allocator`` is handed (and never called: the GPU stand-in allocates through NumPy)."""

    def __init__(self, allocator=None):
        pass

    def malloc(self, size):
        raise RuntimeError("the GPU stand-in allocates through NumPy")

    def total_bytes(self) -> int:
        return 0

    def used_bytes(self) -> int:
        return 0


@contextlib.contextmanager
def _using_allocator(allocator=None):
    yield


class _Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else device

    def use(self):
        return None


_STREAM = _Stream()


def _alloc_pinned_memory(size):
    """Page-locked host memory in CuPy; a plain host buffer here (np.frombuffer reads both)."""
    return bytearray(size)


def _mem_info():
    """(free, total) bytes of the device: the GPU stand-in's memory is the host's."""
    from ..host.meminfo import host_available
    free = host_available() or float(1 << 40)
    return int(free), int(free)


class _XORWOW:
    """CuPy's default bit generator as hpcdist sees it: ``state`` is a *method* that returns
    the address of the cuRAND states on the device, not NumPy's dict property."""

    def __init__(self, gen):
        self._gen = gen

    def state(self):
        return id(self._gen)               # an opaque pointer: nothing to save or restore


class _Generator:
    """``cupy.random.Generator``: NumPy's draws, as device arrays."""

    def __init__(self, gen, device):
        self._gen, self._device = gen, device
        self.bit_generator = _XORWOW(gen)

    def random(self, size=None, dtype=_np.float64, out=None):
        return self._device(self._gen.random(size, dtype=dtype))

    def standard_normal(self, size=None, dtype=_np.float64, out=None):
        return self._device(self._gen.standard_normal(size, dtype=dtype))


def namespaces(function, device, host) -> tuple:
    """(cupyx, cupy.cuda, cupy.random) of the GPU stand-in: ``function(name, text, impl, where)``
    binds a call to CuPy's signature, ``device``/``host`` wrap and unwrap arrays."""
    def scatter_add(a, slices, value):
        """``cupyx.scatter_add``: a[slices] += value, repeated indices accumulating."""
        _np.add.at(_np.ndarray.view(a, _np.ndarray), host(slices), host(value))

    cupyx = types.SimpleNamespace(
        scatter_add=function("scatter_add", CUPYX["scatter_add"][1], scatter_add, "cupyx"))
    cuda = types.SimpleNamespace(
        get_current_stream=function("get_current_stream", CUDA["get_current_stream"][1],
                                    lambda device_id=-1: _STREAM, "cupy.cuda"),
        Device=_Device, Stream=_Stream, MemoryPool=_PrivatePool,
        graph=types.SimpleNamespace(Graph=standin_graph.Graph),
        using_allocator=function("using_allocator", CUDA["using_allocator"][1],
                                 _using_allocator, "cupy.cuda"),
        alloc_pinned_memory=function("alloc_pinned_memory", CUDA["alloc_pinned_memory"][1],
                                     _alloc_pinned_memory, "cupy.cuda"),
        runtime=types.SimpleNamespace(
            getDeviceCount=lambda: 1,
            getDeviceProperties=function(
                "getDeviceProperties", CUDA["runtime.getDeviceProperties"][1],
                lambda device: {"name": b"hpcdist GPU stand-in"}, "cupy.cuda.runtime"),
            memGetInfo=function("memGetInfo", CUDA["runtime.memGetInfo"][1], _mem_info,
                                "cupy.cuda.runtime")))
    random = types.SimpleNamespace(default_rng=lambda seed=None: _Generator(
        _np.random.default_rng(seed), device))
    return cupyx, cuda, random
