"""The array module: NumPy on the CPU, CuPy on the GPU. The only module that imports cupy.

Everything above this layer asks for ``xp()`` and writes array math against it, so the same
code runs on both devices. The device is decided once per process, at the entry point, by
``init(device, local_rank)``; ``HPCDIST_DEVICE=cpu|gpu|auto`` sets the default.

``standin`` is a third device for machines without a GPU: arrays that behave as device arrays
(``is_gpu_array`` is true, math works) but that MPI refuses to read (standin.py). Every
GPU code path runs on it, and any buffer that reaches MPI without staging fails loudly.
"""
from __future__ import annotations

import importlib
import os

import numpy as np

from ..host import malloc, pool
from .errors import DeviceError
from . import precision
from .precision import (BF16_MODES, bf16_emulated, bf16_why, bfloat16,  # noqa: F401
                        compute_dtype, dtype, native_bf16, reset_precision)

DEVICES = ("cpu", "gpu", "auto", "standin")

MALLOC_TUNED = malloc.tune()   # (host/malloc.py: freed temporaries stay in the heap)

_xp = np          # the active array module
_device = "cpu"   # "cpu" or "gpu", after init()
_cupy = None      # the cupy module once imported, else None


def _import_cupy():
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as e:
            raise DeviceError(
                "device 'gpu' needs CuPy: pip install 'hpcdist[gpu-cuda12]' or "
                f"'hpcdist[gpu-cuda13]' (match the driver's CUDA), or run with --device cpu ({e})"
            ) from None
        _cupy = cupy
    return _cupy


def _cupyx():
    """``cupyx`` of the active device module (the GPU stand-in has its own)."""
    if _cupy.__name__ == "hpcdist.device.standin":
        return _cupy.cupyx
    import cupyx
    return cupyx


def gpu_count() -> int:
    """Number of visible CUDA devices (0 when CuPy or a driver is missing)."""
    try:
        import cupy                            # the real one, whatever device is active
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def device_free() -> float | None:
    """Bytes free on this rank's GPU (the GPU stand-in: the host's), None on the CPU."""
    if device_label() == "cpu":
        return None
    return float(xp().cuda.runtime.memGetInfo()[0])


def env_local_rank() -> int:
    """This process's rank on its node, read from the launcher's environment (0 if unknown).

    The communicator knows better (a shared-memory split); entry points pass that in. This
    fallback covers code that runs before MPI is up.
    """
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def init(device: str | None = None, local_rank: int | None = None) -> str:
    """Choose the array module for this process; return the device chosen ("cpu" or "gpu").

    Args:
        device: "cpu", "gpu", "auto" (GPU when one is visible) or "standin" (the GPU code path
            on NumPy); default $HPCDIST_DEVICE or "cpu".
        local_rank: node-local rank; on the GPU the process binds to GPU ``local_rank % count``.
    """
    global _xp, _device, _cupy
    device = (device or os.environ.get("HPCDIST_DEVICE") or "cpu").lower()
    precision.forget_probe(None)              # NumPy computes in bf16 (ml_dtypes)
    if device not in DEVICES:
        renamed = " (the GPU stand-in, once called 'double', is 'standin')" * (device == "double")
        raise ValueError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}{renamed}")
    if device == "auto":
        device = "gpu" if gpu_count() > 0 else "cpu"
    if device == "standin":
        from . import standin
        _cupy = standin
        _xp, _device = standin, "gpu"
        precision.forget_probe(_bf16_probe)   # the device's bf16 asked at first use
        return "standin"
    if device == "gpu":
        if _cupy is not None and _cupy.__name__ == "hpcdist.device.standin":
            _cupy = None
        cupy = _import_cupy()
        n = gpu_count()
        if n == 0:
            raise DeviceError("device 'gpu' asked for, but CuPy sees no CUDA device "
                              "(check CUDA_VISIBLE_DEVICES and the driver), or use --device cpu")
        lr = env_local_rank() if local_rank is None else local_rank
        cupy.cuda.Device(lr % n).use()
        _xp, _device = cupy, "gpu"
        precision.forget_probe(_bf16_probe)
    else:
        if _cupy is not None and _cupy.__name__ == "hpcdist.device.standin":
            _cupy = None                      # the GPU stand-in is not a GPU for later questions
        _xp, _device = np, "cpu"
    return _device


def xp():
    """The active array module (numpy or cupy)."""
    return _xp


def device() -> str:
    return _device


def device_label() -> str:
    """What the run's header calls the device: "cpu", "gpu", or "standin" (standin.py)."""
    return "standin" if _cupy is not None and _xp is _cupy and \
        _cupy.__name__ == "hpcdist.device.standin" else _device


def array_module(arr):
    """The module an array belongs to (numpy for NumPy arrays, cupy for CuPy arrays)."""
    if _cupy is not None and isinstance(arr, _cupy.ndarray):
        return _cupy
    return np


def is_gpu_array(arr) -> bool:
    return _cupy is not None and isinstance(arr, _cupy.ndarray)


def writeable(arr) -> bool:
    """Whether ``arr`` may be written. CuPy's flags have no ``writeable`` (its arrays always
    are, broadcast views included); NumPy's do."""
    return getattr(getattr(arr, "flags", None), "writeable", True)


def to_numpy(arr) -> np.ndarray:
    """A host copy (or the array itself when it already lives on the host)."""
    if is_gpu_array(arr):
        return _cupy.asnumpy(arr)
    return np.asarray(arr)


def host_values(values) -> np.ndarray:
    """A float64 host vector of scalars that may live on a device: device ones stacked and
    read in one transfer (one wait for the device, not one per value)."""
    on_device = [i for i, v in enumerate(values) if is_gpu_array(v)]
    out = np.array([0.0 if is_gpu_array(v) else float(v) for v in values], dtype=np.float64)
    if on_device:
        xp = array_module(values[on_device[0]])
        out[on_device] = to_numpy(xp.stack([values[i].astype(xp.float64).reshape(())
                                            for i in on_device]))
    return out


def to_device(arr, dtype=None):
    """An array of the active module holding ``arr``'s values."""
    return _xp.asarray(arr, dtype=dtype)


def synchronize(arr=None) -> None:
    """Wait until the GPU work producing ``arr`` (or any work on the device) is done.

    Required before MPI reads a GPU buffer: MPI knows nothing about CUDA streams.
    """
    if _cupy is not None and (arr is None or is_gpu_array(arr)):
        _cupy.cuda.get_current_stream().synchronize()


# ---- dtypes ---------------------------------------------------------------------------------

_default_float = np.dtype(np.float32)


def default_float() -> np.dtype:
    return _default_float


def set_default_float(dt) -> None:
    """dtype of new floating tensors and parameters (float32 unless tests ask for float64)."""
    global _default_float
    _default_float = dtype(dt)


def _bf16_probe() -> tuple:
    """(None where the active module computes what a step asks of it in bf16, else why not in
    a few words; whether its scatter-add takes bf16). Values are small integers: exact in
    bf16, so any difference is a bug (precision.native_bf16 asks this once per device)."""
    xp = _xp
    try:
        bf = bfloat16()
        a = xp.ones((2, 3, 4), dtype=bf)
        w = xp.ones((4, 5), dtype=bf)
        steps = [
            ("elementwise", lambda: float((xp.exp(a * 0) + a - 1).astype(np.float32).sum()),
             24.0),
            ("2-D GEMM", lambda: float((a[0] @ w).astype(np.float32).sum()), 60.0),
            ("batched GEMM", lambda: float(matmul(a, xp.swapaxes(a, -1, -2))
                                           .astype(np.float32).sum()), 72.0),
            ("folded GEMM", lambda: float(matmul(a, w).astype(np.float32).sum()), 120.0),
            ("sum", lambda: float(a.sum(axis=-1).astype(np.float32).sum()), 24.0),
        ]
        for name, run, want in steps:
            got = run()
            if got != want:
                return f"bf16 {name} gave {got}, not {want}", False
    except Exception as e:          # CuPy 14.2 on an H200: "data type 'E' not understood"
        return f"{type(e).__name__}: {str(e)[:120]}", False
    try:                            # not needed: without it the sums go through float32
        target = xp.zeros((3, 4), dtype=bf)
        _cupyx().scatter_add(target, xp.asarray(np.array([0, 2, 0])), xp.ones((3, 4), bf))
        scatter = float(target.astype(np.float32).sum()) == 12.0 and \
            float(target[0, 0].astype(np.float32)) == 2.0
    except Exception:
        scatter = False
    return None, scatter



def round_to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 value (ties to even), still float32.
    NaN and inf pass through (the rounding adds at most 0x7FFF + 1 to a NaN's payload, and
    an inf's low half is zero)."""
    mod = array_module(x)
    bits = mod.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)
    out = bits.view(np.float32)
    return mod.where(mod.isnan(x), x, out) if out.size else out


# ---- matmul ---------------------------------------------------------------------------------

def matmul(a, b, rounding: bool = True):
    """``a @ b`` (``rounding``: bf16 emulation rounds the operands; False: they are rounded
    already). On NumPy, 2-byte floats (fp16, bf16) multiply in fp32 and round back: NumPy
    has no BLAS for them (fp16 measured 190x slower than fp32 here) — and fp32 accumulation is
    what tensor cores do. On CuPy fp16 runs natively.

    (..., n, k) @ (k, m) with a contiguous left side is one (N, k) @ (k, m) GEMM: NumPy would
    call BLAS once per leading index (64 GEMMs of 11 x 64 x 192 for the default GPT's
    attention input: 248 us against 135 us folded)."""
    if a.dtype.itemsize == 2 and a.dtype.kind in "fV" and not is_gpu_array(a):
        return matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
    if a.dtype.name == "bfloat16" and is_gpu_array(a) and not (
            b.ndim == 2 and (a.ndim == 2 or a.flags.c_contiguous)):
        # a batched bf16 GEMM: CuPy 14.2 has no kernel for it; float32 in, fp32 accumulation
        # as tensor cores do it, rounded back (attention's GEMM path; the flash kernels and
        # every linear layer are 2-D)
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)
    if precision.bf16_emulated() and rounding and a.dtype == np.float32:
        a, b = round_to_bf16(a), round_to_bf16(b)
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous and a.shape[-1]:
        return _gemm(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + b.shape[-1:])
    return _gemm(a, b)


# The CPU kernels this module hands work to, installed by device/kernels/__init__.py (this
# module imports none of them: the engine is handed what it calls)
_cpu_kernels: dict = {"gemm": None, "scatter_rows": None, "device_gemm": None}


def install_cpu_kernels(gemm, scatter_rows, device_gemm=None) -> None:
    """The CPU's GEMM over the rank's threads (``gemm(a, b)``) and its row scatter-add
    (``scatter_rows(target, idx, values) -> bool``: False where it does not take the call);
    a device's GEMM of two matrices (``device_gemm(a, b)``: None where it does not)."""
    _cpu_kernels.update(gemm=gemm, scatter_rows=scatter_rows, device_gemm=device_gemm)


def _gemm(a, b):
    if _device == "cpu":
        gemm = _cpu_kernels["gemm"]
        if gemm is not None and pool.wanted(a, b):       # over the rank's threads
            return gemm(a, b)
        return a @ b
    gemm = _cpu_kernels["device_gemm"]
    out = gemm(a, b) if gemm is not None else None
    return a @ b if out is None else out


# ---- scatter-add and random numbers --------------------------------------------------------

def scatter_add(target, idx, values) -> None:
    """``target[idx] += values`` with repeated indices accumulating (embedding backward).

    On NumPy, rows are summed per index after a sort (``add.reduceat``): ``np.add.at`` took
    290-680 us for the default GPT's 704 x 64 token gradients, this ~60 us."""
    if is_gpu_array(target):
        if target.dtype.name == "bfloat16" and not precision.bf16_scatter():
            # a CuPy without a bf16 scatter-add: the sums through float32
            wide = target.astype(np.float32)
            _cupyx().scatter_add(wide, idx, values.astype(np.float32))
            target[...] = wide.astype(target.dtype)
            return
        _cupyx().scatter_add(target, idx, values)
        return
    if isinstance(idx, tuple) or not hasattr(idx, "dtype") or idx.dtype.kind not in "iu" \
            or np.ndim(values) != idx.ndim + target.ndim - 1:
        np.add.at(target, idx, values)         # slices, several index arrays, broadcasting
        return
    idx = idx.reshape(-1)
    if idx.size == 0:
        return
    n = target.shape[0]
    if idx.min() < 0:                          # -1 and n-1 are one row: make them one index
        idx = np.where(idx < 0, idx + n, idx)
    if idx.min() < 0 or idx.max() >= n:
        raise IndexError(f"an index is out of bounds for {n} rows")
    values = values.reshape((idx.size,) + target.shape[1:])
    rows = _cpu_kernels["scatter_rows"]        # rows: one CPU kernel where it runs
    if rows is not None and rows(target, idx, values):
        return
    order = np.argsort(idx, kind="stable")
    sidx = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], sidx[1:] != sidx[:-1])))
    target[sidx[starts]] += np.add.reduceat(values[order], starts, axis=0)


from .rng import DropoutRNG, rng, rng_state, seed, set_rng_state  # noqa: E402,F401 (dropout)



def cupy_library(module: str):
    """A module of CuPy's own (cuBLAS's bindings, CuPy's GEMM compute types) by its dotted
    name: only this module imports CuPy (kernels/gemm.py asks here)."""
    if not module.startswith(("cupy.", "cupy_backends.")):
        raise ValueError(f"{module} is not a CuPy module")
    _import_cupy()
    return importlib.import_module(module)


def device_counts():
    """(kernel launches, device-to-host reads) so far, as the GPU stand-in counts them; None
    on other devices (a GPU does not count them for us)."""
    if device_label() != "standin":
        return None
    from .surface import LAUNCHES, READS
    return LAUNCHES.count, READS.count


def nccl_module():
    """``cupy.cuda.nccl``, or a DeviceError that says what is missing (on the GPU stand-in:
    its stand-in, standin_nccl)."""
    if _cupy is not None and _cupy.__name__ == "hpcdist.device.standin":
        from . import standin_nccl
        return standin_nccl
    cupy = _import_cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise DeviceError(f"the NCCL backend needs CuPy built with NCCL support ({e}); "
                          "use --backend mpi") from None
    if not getattr(nccl, "available", True):
        raise DeviceError("CuPy was built without NCCL; use --backend mpi")
    del cupy
    return nccl
