"""A stand-in for CuPy on machines without a GPU: device arrays that MPI cannot read.

``backend.init("double")`` (``--device double``, ``HPCDIST_DEVICE=double``) makes this module
the array module. Its arrays are NumPy arrays underneath, so every op computes exactly as on
the CPU, but they behave as device arrays do towards hpcdist and MPI:

- ``backend.is_gpu_array`` is true for them, so every GPU code path (staging, the NCCL
  checks, pinned buffers, bf16 emulation) runs;
- they export no host buffer: no buffer protocol, no DLPack, no CUDA array interface. Handed
  to mpi4py they raise ``TypeError`` at once. A real CuPy array handed to an MPI that is not
  CUDA-aware is read as a host pointer and crashes the process (``process_vm_readv``, or a
  segmentation fault with no traceback); here the same mistake is a traceback that names the
  call site. CI has no GPU: this is what keeps a path that skips staging out of main.

Host copies go through ``asnumpy``/``ndarray.get`` and back through ``asarray``/``ndarray.set``,
as with CuPy. What the double does not model: streams (work is done when a call returns) and
CuPy's refusal of implicit conversion (``np.asarray(device_array)`` works here).
"""
from __future__ import annotations

import ctypes
import sys
import types

import numpy as _np


class ndarray(_np.ndarray):            # noqa: N801 (CuPy's name)
    """A device array: NumPy math, no host buffer export."""

    def __dlpack__(self, *args, **kwargs):
        raise TypeError("a device array (hpcdist device double) has no host memory to export: "
                        "stage it through the Communicator")

    def __dlpack_device__(self):
        raise TypeError("a device array (hpcdist device double) has no host device")

    if sys.version_info >= (3, 12):            # PEP 688: refuse the buffer protocol itself
        def __buffer__(self, flags):
            raise TypeError("a device array (hpcdist device double) exports no host buffer")

    def get(self, stream=None, out=None, blocking=True):
        """A host copy (into ``out`` when given), as ``cupy.ndarray.get``."""
        host = _np.array(self.view(_np.ndarray), copy=True)
        if out is None:
            return host
        out[...] = host
        return out

    def set(self, arr, stream=None):
        """Copy host ``arr`` in, as ``cupy.ndarray.set``."""
        if isinstance(arr, ndarray):
            raise TypeError("set() takes a host array")
        self.view(_np.ndarray)[...] = arr

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # CuPy refuses host arrays in device math (TypeError); so does the double, so that
        # a forgotten to_device fails here and not first on a GPU machine.
        for x in inputs + tuple(kwargs.get("out", ())):
            if type(x) is _np.ndarray and x.ndim > 0:
                raise TypeError(f"{ufunc.__name__}: a host (NumPy) array mixed with device "
                                "arrays; move it with xp.asarray first")
        if "out" in kwargs:
            kwargs["out"] = tuple(_host(o) for o in kwargs["out"])
        result = getattr(ufunc, method)(*_host(inputs), **kwargs)
        if method == "at":
            return None
        return _device(result)


def _close_buffer_protocol(cls) -> bool:
    """Before Python 3.12 a subclass of ndarray cannot refuse the buffer protocol from
    Python; clear the getbuffer slot that the subclass copied from ndarray instead.
    Checked, not assumed: the slot is cleared only where it holds ndarray's own function."""
    if sys.version_info >= (3, 12):
        return True
    try:
        index = 20                                     # PyTypeObject.tp_as_buffer (3.8-3.11)
        ours = ctypes.c_void_p.from_address(id(cls) + 8 * index).value
        theirs = ctypes.c_void_p.from_address(id(_np.ndarray) + 8 * index).value
        if not ours or not theirs or ours == theirs:
            return False
        slot = ctypes.c_void_p.from_address(ours)      # PyBufferProcs.bf_getbuffer
        if slot.value != ctypes.c_void_p.from_address(theirs).value:
            return False
        slot.value = None
        return True
    except (ValueError, OSError):
        return False


BUFFER_CLOSED = _close_buffer_protocol(ndarray)


def _device(x):
    """Wrap NumPy results as device arrays (scalars become 0-d arrays, as in CuPy)."""
    if isinstance(x, _np.ndarray):
        return x if isinstance(x, ndarray) else x.view(ndarray)
    if isinstance(x, _np.generic):
        return _np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_device(v) for v in x)
    if isinstance(x, list):
        return [_device(v) for v in x]
    return x


def _host(x):
    """Arguments for NumPy: device arrays as plain views (NumPy functions then return
    ndarrays, re-wrapped by ``_device``)."""
    if isinstance(x, ndarray):
        return x.view(_np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    return x


def _refuse_host_arrays(name, args):
    """CuPy's functions take no NumPy arrays (TypeError); nor do the double's."""
    for x in args:
        if type(x) is _np.ndarray and x.ndim > 0:
            raise TypeError(f"{name}: a host (NumPy) array passed to a device function; "
                            "move it with xp.asarray first")
        if isinstance(x, (list, tuple)):
            _refuse_host_arrays(name, x)


def _wrap(fn):
    def call(*args, **kwargs):
        _refuse_host_arrays(getattr(fn, "__name__", "function"), args + tuple(kwargs.values()))
        return _device(fn(*_host(args), **{k: _host(v) for k, v in kwargs.items()}))
    call.__name__ = getattr(fn, "__name__", "fn")
    return call


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return _np.array(a, dtype=dtype, copy=True).view(ndarray)


array = asarray


def asnumpy(a, stream=None, out=None):
    if isinstance(a, ndarray):
        return a.get(out=out)
    return _np.asarray(a)


def ascontiguousarray(a, dtype=None):
    return _device(_np.ascontiguousarray(_host(a), dtype=dtype))


def get_array_module(*args):
    return sys.modules[__name__]


def scatter_add(target, idx, values) -> None:
    """``cupyx.scatter_add``: target[idx] += values, repeated indices accumulating."""
    _np.add.at(target.view(_np.ndarray), _host(idx), _host(values))


class _Stream:
    ptr = 0

    def synchronize(self) -> None:       # work is done when a call returns
        pass


class _Device:
    def __init__(self, index=0):
        self.id = index

    def use(self):
        return self


_STREAM = _Stream()
cuda = types.SimpleNamespace(
    get_current_stream=lambda: _STREAM, Device=_Device,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))


class _Random:
    """``cupy.random``: NumPy's generators, returning device arrays."""

    @staticmethod
    def default_rng(seed=None):
        return _Generator(_np.random.default_rng(seed))


class _Generator:
    def __init__(self, gen):
        self._gen = gen
        self.bit_generator = gen.bit_generator

    def __getattr__(self, name):
        return _wrap(getattr(self._gen, name))


random = _Random()


def __getattr__(name):
    """Every other NumPy name: functions return device arrays, the rest is NumPy's."""
    value = getattr(_np, name)
    if callable(value) and not isinstance(value, (type, _np.ufunc)):
        return _wrap(value)
    return value
