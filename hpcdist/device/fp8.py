"""FP8 for the linear layers' GEMMs (``--precision fp8``): e4m3 for the forward's operands
(activations and weights), e5m2 for the gradients, each tensor scaled into its format's range
by the largest power of two its current absolute maximum allows (per-tensor dynamic scaling,
torchao's tensorwise recipe; delayed scaling from an amax history is not built). A value
rounded to fp8 and multiplied back is then exact in bf16, so a bf16 GEMM with fp32
accumulation over those values is what an FP8 tensor-core GEMM computes from the codes and
their scales: every device runs that (``kernels.linear_operand``, ``FP8_QUANTIZE``), fp8's
numbers at bf16's speed — cuBLASLt's FP8 matmul is not built. Rounding: nearest, ties to even,
saturating, NaN kept, through float32 frexp / rint / ldexp on any array module, equal to
ml_dtypes' float8 types bit for bit (tests/test_fp8.py). The design: docs/gpu.md,
"hpcdist/device/fp8.py"."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import backend


@dataclass(frozen=True)
class Format:
    name: str
    mantissa: int          # explicit mantissa bits
    min_exp: int           # exponent of the smallest normal number
    max: float             # largest finite value

    def __str__(self) -> str:
        return self.name


E4M3 = Format("e4m3", 3, -6, 448.0)        # OCP FP8 e4m3fn: no infinities, one NaN code
E5M2 = Format("e5m2", 2, -14, 57344.0)     # IEEE-like: e5m2's infinities are never made here


def round_to_fp8(x, fmt: Format):
    """``x`` (float32) rounded to the nearest ``fmt`` value (ties to even), saturated at
    +-fmt.max, as float32."""
    xp = backend.array_module(x)
    x = x.astype(np.float32, copy=False)
    _, e = xp.frexp(x)                                   # |x| in [2^(e-1), 2^e)
    e = xp.maximum(e - 1, fmt.min_exp)                   # (subnormals: the smallest step)
    step = xp.ldexp(xp.ones_like(x), e - fmt.mantissa)   # the spacing of fmt's values there
    q = xp.rint(x / step) * step                         # (both exact: powers of two)
    return xp.clip(q, -fmt.max, fmt.max)


def scale_of(x, fmt: Format):
    """The largest power of two that brings ``x``'s largest finite-or-infinite magnitude (NaNs
    left out) to at most ``fmt.max`` (a 0-d float32 array where x lives: no read to the host);
    an all-zero x's as if its amax were 1. frexp, not log2: exact at every power of two, as
    the CUDA kernel computes it (kernels/fp8_quant.py)."""
    xp = backend.array_module(x)
    a = xp.abs(x.astype(np.float32, copy=False))
    amax = xp.where(xp.isnan(a), 0, a).max().astype(np.float32)
    safe = xp.where(amax > 0, amax, np.float32(1.0)).astype(np.float32)
    _, e = xp.frexp(np.float32(fmt.max) / safe)          # max / amax in [2^(e-1), 2^e)
    return xp.ldexp(xp.ones_like(safe), e - 1)


def quantized(x, fmt: Format):
    """``x`` as an fp8 GEMM sees it: round(x * s) / s, s = ``scale_of(x)``, in x's dtype
    (exact in bf16 and float32). The twin of kernels.FP8_QUANTIZE (two launches on a GPU)."""
    x32 = x.astype(np.float32)
    s = scale_of(x32, fmt)
    x32 *= s
    q = round_to_fp8(x32, fmt)
    q /= s
    return q if q.dtype == x.dtype else q.astype(x.dtype)


_ON = [False]


def set_linears(on: bool) -> None:
    """Whether the linear layers' GEMMs run in fp8 in this run (mixed precision sets it)."""
    _ON[0] = bool(on)


def linears() -> bool:
    return _ON[0]


def fp8_cores_problem() -> str | None:
    """Why this device may not run --precision fp8 (None: it may): a GPU must have FP8 tensor
    cores (compute capability 9.0 or later: H100, H200, B200); the CPU and the GPU stand-in
    run the emulation, to check a run before it goes to one."""
    if backend.device_label() != "gpu":
        return None
    try:
        props = backend.xp().cuda.runtime.getDeviceProperties(backend.xp().cuda.Device().id)
        major, minor = int(props["major"]), int(props["minor"])
    except Exception as e:                        # noqa: BLE001 (the device's own words)
        return f"the GPU's compute capability could not be read ({e})"
    if major < 9:
        return (f"FP8 tensor cores need compute capability 9.0 or later (H100, H200, B200); "
                f"this GPU's is {major}.{minor}")
    return None
