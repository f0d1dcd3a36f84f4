"""bf16 in this run: native (bf16 arrays between kernels) where the active module computes in
bf16, else emulated (float32 storage, every GEMM's operands rounded to bf16 and accumulated in
fp32, as tensor cores do). ``backend`` re-exports these; the design: docs/gpu.md,
"Commands" (tensor cores)."""
from __future__ import annotations

import os

import numpy as np

from .errors import DeviceError


def bfloat16():
    """The bfloat16 dtype: ml_dtypes' (NumPy, and CuPy releases that accept it)."""
    try:
        import ml_dtypes
    except ImportError:
        raise DeviceError("bf16 needs ml_dtypes: pip install 'hpcdist[bf16]'") from None
    return np.dtype(ml_dtypes.bfloat16)


BF16_MODES = ("auto", "native", "emulated")        # HPCDIST_BF16
_native_bf16 = None     # does the active module compute in bfloat16? (probed once)
_bf16_operands = False  # round matmul operands to bf16 (bf16 emulated in fp32 storage)
_bf16_why = ""          # why a GPU run emulates bf16 (the probe's failure), for the header
_bf16_scatter = False   # whether CuPy's scatter-add takes bf16 (probed with native_bf16)
_probe = None           # the device's probe (backend.init gives it; None: NumPy)


def native_bf16() -> bool:
    """Whether bf16 runs natively here: bf16 arrays between kernels (activations, gradients,
    the compute copy of the weights). NumPy with ml_dtypes does. On a GPU, CuPy from 14.x
    with ml_dtypes, where a probe of what a step asks of CuPy in bf16 passes: elementwise
    work, sums, conversions, 2-D GEMMs (batched ones go through float32 here: CuPy 14.2 has
    no batched bf16 kernel) and the scatter-add of the embedding's gradient. Otherwise (or
    with HPCDIST_BF16=emulated) bf16 is emulated: float32 storage, bf16 GEMMs."""
    global _native_bf16, _bf16_why, _bf16_scatter
    if _probe is None:                  # NumPy (backend.init on the CPU): ml_dtypes computes
        return True
    if _native_bf16 is None:
        mode = os.environ.get("HPCDIST_BF16", "auto").lower()
        if mode not in BF16_MODES:
            raise ValueError(f"HPCDIST_BF16={mode!r}: choose one of {', '.join(BF16_MODES)}")
        if mode == "emulated":
            _native_bf16, _bf16_why = False, "HPCDIST_BF16=emulated"
        else:
            why, _bf16_scatter = _probe()
            _native_bf16, _bf16_why = why is None, why or ""
            if why and mode == "native":
                raise DeviceError(f"HPCDIST_BF16=native, but this CuPy cannot: {why}")
    return _native_bf16


def bf16_why() -> str:
    """Why bf16 is emulated on this device ("" where it runs natively)."""
    return _bf16_why


def compute_dtype(precision: str) -> np.dtype:
    """The dtype that forward and backward run in for ``precision`` ("fp16", "bf16", ...).

    bf16 on a CuPy without bfloat16 is emulated with bf16's numbers: arrays stay float32 and
    every matmul rounds its operands to bf16 (round to nearest even) and accumulates in fp32,
    which is what tensor cores do with bf16 inputs. ``bf16_emulated()`` says when. "fp8"
    computes in bf16 (only the linear layers' GEMMs take fp8 operands: device/fp8.py)."""
    global _bf16_operands
    if isinstance(precision, str) and precision.lower() == "fp8":
        precision = "bf16"
    if isinstance(precision, str) and precision.lower() in ("bf16", "bfloat16") \
            and not native_bf16():
        _bf16_operands = True
        return np.dtype(np.float32)
    return dtype(precision)


def bf16_emulated() -> bool:
    return _bf16_operands


def reset_precision(emulated: bool = False) -> None:
    """Forget an earlier run's bf16 emulation (each run decides its own precision), or set
    it back (``emulated``: what ``bf16_emulated()`` said before)."""
    global _bf16_operands
    _bf16_operands = bool(emulated)


def forget_probe(probe=None) -> None:
    """A new array module (backend.init): ``probe()`` -> (why bf16 cannot run natively or
    None, whether its scatter-add takes bf16), asked at the next question; None: NumPy."""
    global _native_bf16, _bf16_scatter, _bf16_why, _probe
    _native_bf16, _bf16_scatter, _bf16_why, _probe = None, False, "", probe


def bf16_scatter() -> bool:
    """Whether the device's scatter-add takes bf16 (else backend sums those in float32)."""
    return _bf16_scatter


_DTYPE_NAMES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
    "int32": "int32", "int64": "int64",
}


def dtype(name) -> np.dtype:
    """Resolve a dtype name ("fp32", "float64", "bf16", ...) or dtype to a numpy dtype."""
    if isinstance(name, str):
        if name.lower() in ("bf16", "bfloat16"):
            return bfloat16()
        if name.lower() not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {name!r}: choose one of "
                             f"{', '.join(sorted(_DTYPE_NAMES))}, bf16")
        return np.dtype(_DTYPE_NAMES[name.lower()])
    return np.dtype(name)
