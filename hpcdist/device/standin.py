"""A stand-in for CuPy on machines without a GPU: device arrays that MPI cannot read, and only
the CuPy that hpcdist may call.

``backend.init("standin")`` (``--device standin``, ``HPCDIST_DEVICE=standin``) makes this module
the array module. Its arrays are NumPy arrays underneath, so every op computes exactly as on
the CPU, but they behave as CuPy's do towards hpcdist and MPI — the list goes on in
docs/gpu.md, "hpcdist/device/standin.py"."""
from __future__ import annotations

import ctypes
import sys
import types

import numpy as _np

from . import standin_runtime
from .standin_graph import RECORDER, inside, record
from .surface import (CUBLAS, CUDA, CUPYX, FLAGS, LAUNCHES, MODULE, NCCL, READS, NDARRAY,
                      NOT_LAUNCHES, RANDOM, UFUNC_KWARGS, cupy_result_type, one_launch,
                      signature, typed_parameters)

# ---- arrays ---------------------------------------------------------------------------------

class _Flags:
    """CuPy's ``ndarray.flags``: c_contiguous, f_contiguous, owndata (no ``writeable``)."""

    __slots__ = FLAGS

    def __init__(self, flags):
        self.c_contiguous, self.f_contiguous = flags.c_contiguous, flags.f_contiguous
        self.owndata = flags.owndata


class _Pointer:
    """``ndarray.data``: a memory pointer with ``ptr`` (here: the host address)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(_np.ndarray):            # noqa: N801 (CuPy's name)
    """A device array: NumPy math, no host buffer export, only CuPy's attributes."""

    def __dlpack__(self, *args, **kwargs):
        raise TypeError("a device array (hpcdist GPU stand-in) has no host memory to export: "
                        "stage it through the Communicator")

    def __dlpack_device__(self):
        raise TypeError("a device array (hpcdist GPU stand-in) has no host device")

    if sys.version_info >= (3, 12):            # PEP 688: refuse the buffer protocol itself
        def __buffer__(self, flags):
            raise TypeError("a device array (hpcdist GPU stand-in) exports no host buffer")

    @property
    def flags(self):
        return _Flags(_np.ndarray.flags.__get__(self))

    @property
    def data(self):
        return _Pointer(self.__array_interface__["data"][0])

    def __float__(self):                       # implicit device-to-host reads: counted
        READS.add()
        return _np.ndarray.__float__(_np.ndarray.view(self, _np.ndarray))

    def __int__(self):
        READS.add()
        return _np.ndarray.__int__(_np.ndarray.view(self, _np.ndarray))

    def __bool__(self):
        READS.add()
        return _np.ndarray.__bool__(_np.ndarray.view(self, _np.ndarray))

    def __getitem__(self, idx):
        items = idx if isinstance(idx, tuple) else (idx,)
        out = _np.ndarray.__getitem__(self, idx)
        if not isinstance(out, _np.ndarray):       # an element: CuPy's is a 0-d device view
            out = _np.ndarray.__getitem__(self, items + (Ellipsis,))
        if any(isinstance(i, (_np.ndarray, list)) for i in items):
            LAUNCHES.add()                         # a gather by index
            if RECORDER.on:
                record(lambda: _np.ndarray.__getitem__(_host(self), _host(idx)), out)
        return out

    def __setitem__(self, idx, value):
        LAUNCHES.add()                             # a copy (or scatter) kernel
        _np.ndarray.__setitem__(self, idx, _host(value))     # (a 0-d device value: no read)
        if RECORDER.on:
            record(lambda: _np.ndarray.__setitem__(_host(self), _host(idx), _host(value)))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # CuPy refuses host arrays in device math (TypeError); so does the GPU stand-in, so that
        # a forgotten to_device fails here and not first on a GPU machine.
        for x in inputs + tuple(kwargs.get("out", ())):
            if type(x) is _np.ndarray and x.ndim > 0:
                raise TypeError(f"{ufunc.__name__}: a host (NumPy) array mixed with device "
                                "arrays; move it with xp.asarray first")
        if method == "__call__" and not UFUNC_KWARGS.issuperset(kwargs):
            raise TypeError(f"{ufunc.__name__}() got {sorted(set(kwargs) - UFUNC_KWARGS)}: "
                            f"CuPy's ufuncs take only {sorted(UFUNC_KWARGS)} by keyword")
        outs = kwargs.get("out")
        if outs is not None:
            kwargs["out"] = tuple(_host(o) for o in outs)
        LAUNCHES.add()
        run = lambda: getattr(ufunc, method)(*_host(inputs), **kwargs)   # noqa: E731
        result = run()
        if method == "at" or outs is not None:
            if RECORDER.on:
                record(run)                     # it writes in place: running it is its replay
            if method == "at":
                return None
            return outs[0] if len(outs) == 1 else outs  # (CuPy returns ``out``: a += b keeps a)
        result = _device(cupy_result_type(inputs, result))
        if RECORDER.on:
            record(run, result)
        return result


def _get(self, stream=None, order="C", out=None, blocking=True):
    """A host copy (into ``out`` when given), as ``cupy.ndarray.get``."""
    READS.add()
    host = _np.array(_np.ndarray.view(self, _np.ndarray), copy=True)
    if out is None:
        return host
    out[...] = host
    return out


def _set(self, arr, stream=None):
    """Copy host ``arr`` in, as ``cupy.ndarray.set``."""
    if isinstance(arr, ndarray):
        raise TypeError("set() takes a host array")
    _upload("set", arr)
    _np.ndarray.view(self, _np.ndarray)[...] = arr
    if RECORDER.on:                             # a scalar, written by a fill kernel
        record(lambda: _np.copyto(_host(self), arr))


def _item(self):
    READS.add()
    return _np.ndarray.view(self, _np.ndarray).item()


def _bind_method(name: str, text: str, impl=None):
    """ndarray.<name>: binds to CuPy's signature, then runs NumPy's (or ``impl``, whose
    result is returned as it is: host copies stay on the host)."""
    sig = signature(text)
    base = impl or _np.ndarray.__dict__[name]

    def method(self, *args, **kwargs):
        try:
            sig.bind(self, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"cupy.ndarray.{name}{text[5:] if text.startswith('(self') else text}"
                            f": {e}") from None
        if impl is not None:
            return impl(self, *args, **kwargs)
        launches = name not in NOT_LAUNCHES and not (name == "astype" and _np.dtype(
            args[0] if args else kwargs.get("dtype")) == self.dtype and
            not kwargs.get("copy", True))
        # NumPy's method on a host view: its internal ufunc calls are NumPy's business
        run = lambda: base(_host(self), *_host(args),    # noqa: E731
                           **{k: _host(v) for k, v in kwargs.items()})
        out = _device(run())
        launches = launches or _copied(name, out, self)
        if launches:
            LAUNCHES.add()
            if RECORDER.on:
                record(run, out)
        return out
    method.__name__ = name
    return method


VIEWS = ("reshape", "ravel", "transpose", "swapaxes", "view")


def _copied(name: str, out, source) -> bool:
    """A view-making call that had to copy (reshaping a transposed array): on a GPU a copy
    kernel, so a launch, and one a graph records."""
    return name in VIEWS and isinstance(out, _np.ndarray) and isinstance(source, _np.ndarray) \
        and out.size > 0 and not _np.may_share_memory(out, source)


class _NotInCuPy:
    """An attribute NumPy arrays have and the GPU stand-in withholds (CuPy lacks it, or hpcdist
    has not listed it in NDARRAY)."""

    def __init__(self, name):
        self.name = name

    def __get__(self, obj, cls=None):
        raise AttributeError(
            f"'cupy.ndarray' (hpcdist GPU stand-in) has no attribute {self.name!r} in the "
            "surface hpcdist may use: list it in device_surface.NDARRAY (make test-cupy "
            "checks it against CuPy) or use another call")


_IMPLS = {"get": _get, "set": _set, "item": _item}
for _name, (_kind, _text) in NDARRAY.items():
    if _kind == "method":
        setattr(ndarray, _name, _bind_method(_name, _text, _IMPLS.get(_name)))
for _name in dir(_np.ndarray):
    if not _name.startswith("_") and _name not in NDARRAY:
        setattr(ndarray, _name, _NotInCuPy(_name))


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
        return _np.ndarray.view(x, _np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    return x


def _refuse_host_arrays(name, args):
    """CuPy's functions take no NumPy arrays (TypeError); nor do the GPU stand-in's."""
    for x in args:
        if type(x) is _np.ndarray and x.ndim > 0:
            raise TypeError(f"{name}: a host (NumPy) array passed to a device function; "
                            "move it with xp.asarray first")
        if isinstance(x, (list, tuple)):
            _refuse_host_arrays(name, x)


SORTS = ("sort", "argsort", "partition", "argpartition", "lexsort")


def _refuse_bf16_sorts(name, args):
    """CuPy 14 sorts no bfloat16 (thrust; its reductions of bf16 do run): a bf16 sort fails
    here as it would on a GPU (an H200 session found the MoE router's)."""
    first = args[0] if args else None
    if name in SORTS and getattr(getattr(first, "dtype", None), "name", "") == "bfloat16":
        raise NotImplementedError("Sorting arrays with dtype 'bfloat16' is not supported")


def _function(name: str, text: str, impl=None, where: str = "cupy"):
    """cupy.<name>: binds to CuPy's signature, refuses host arrays, runs NumPy's (or
    ``impl``) and returns device arrays."""
    sig = signature(text)
    fn = impl or vars(_np)[name]

    def call(*args, **kwargs):
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{where}.{name}{text}: {e}") from None
        _refuse_bf16_sorts(name, args)
        launches = name not in NOT_LAUNCHES and not where.startswith("cupy.cuda")  # (runtime)
        if launches:
            LAUNCHES.add()
        recorded = launches and RECORDER.on
        if impl is not None:
            if not recorded:
                return impl(*args, **kwargs)
            with inside():                        # (its own operations are this launch)
                out = impl(*args, **kwargs)
            record(lambda: impl(*args, **kwargs), out)
            return out
        _refuse_host_arrays(name, args + tuple(kwargs.values()))
        run = lambda: fn(*_host(args), **{k: _host(v) for k, v in kwargs.items()})  # noqa
        out = _device(run())
        if not launches and args and _copied(name, out, args[0]):
            LAUNCHES.add()
            recorded = RECORDER.on
        if recorded:
            record(run, out)
        return out
    call.__name__ = name
    return call


def _upload(what: str, values) -> None:
    """A host-to-device copy of ``values``: CuPy refuses one while a stream captures a CUDA
    graph (a scalar it writes by a fill kernel instead, which a capture takes)."""
    if READS.capturing and _np.ndim(values):
        raise RuntimeError(f"{what}: a host-to-device copy while a stream captures a CUDA "
                           "graph (CuPy: \"the current stream is capturing, so H2D transfers "
                           "are disallowed\"); make the values on the device")


def _asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _upload("asarray", a)
    return _np.array(a, dtype=dtype, copy=True).view(ndarray)


def _array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if not isinstance(obj, ndarray):
        _upload("array", obj)
    out = _np.array(_host(obj), dtype=dtype, copy=True).view(ndarray)
    if RECORDER.on and isinstance(obj, ndarray):   # a device copy: a launch
        record(lambda: _host(obj), out)
    return out


def _asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(out=out)
    return _np.asarray(a)


def _get_array_module(*args):
    return sys.modules[__name__]


class _MemoryPool:
    """CuPy's memory pool as memtrace reads it: bytes of device arrays alive (here NumPy's
    allocations as tracemalloc sees them, which memtrace starts)."""

    def used_bytes(self):
        import tracemalloc
        return tracemalloc.get_traced_memory()[0]


_POOL = _MemoryPool()


_SPECIAL = {"asarray": _asarray, "array": _array, "asnumpy": _asnumpy,
            "get_array_module": _get_array_module, "get_default_memory_pool": lambda: _POOL}
linalg = types.SimpleNamespace()
for _name, (_kind, _text) in MODULE.items():
    if "." in _name:                                   # a submodule's function
        _sub, _fn = _name.split(".")
        setattr(globals()[_sub], _fn, _function(
            _fn, _text, lambda *a, _f=vars(_np)[_sub].__dict__[_fn], **k: _device(
                _f(*_host(a), **{kk: _host(v) for kk, v in k.items()})), f"cupy.{_sub}"))
    elif _kind == "function":
        globals()[_name] = _function(_name, _text, _SPECIAL.get(_name))
    elif _kind == "ufunc":
        globals()[_name] = vars(_np)["absolute" if _name == "abs" else _name]
    elif _kind in ("dtype", "constant"):
        globals()[_name] = vars(_np)[_name]


def __getattr__(name):
    raise AttributeError(
        f"module 'cupy' (hpcdist GPU stand-in) has no attribute {name!r} in the surface "
        "hpcdist may use: list it in device_surface.MODULE (make test-cupy checks it against "
        "CuPy) or use another call")


cupyx, cuda, random = standin_runtime.namespaces(_function, _device, _host)
