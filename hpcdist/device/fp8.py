"""FP8 for the linear layers' GEMMs (``--precision fp8``): e4m3 for the forward's operands
(activations and weights), e5m2 for the gradients, each tensor scaled into its format's range
by the largest power of two its current absolute maximum allows (per-tensor dynamic scaling,
torchao's tensorwise recipe; a tensor-parallel shard by its whole tensor's: ``Split``). A value
rounded to fp8 and multiplied back is then exact in bf16, so a bf16 GEMM with fp32
accumulation over those values computes what an FP8 tensor-core GEMM computes from the codes
(``encode``) and their scales: the CPU runs that (``FP8_QUANTIZE``), a Hopper GPU cuBLASLt's
FP8 matmul (kernels/fp8_gemm.py). Rounding: nearest, ties to even, saturating, NaN kept,
through float32 frexp / rint / ldexp on any array module, equal to ml_dtypes' float8 types
bit for bit (tests/test_fp8.py). The design: docs/gpu.md, "hpcdist/device/fp8.py"."""
from __future__ import annotations

import contextlib
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


def encode(q, fmt: Format):
    """The codes (uint8: sign, biased exponent, mantissa bits) of ``q``, values of ``fmt``
    (``round_to_fp8``'s output) or NaN, which is 0x7f in both formats, its sign dropped (a
    GPU's NaNs have none to keep); ml_dtypes' float8_e4m3fn and float8_e5m2 bits elsewhere
    (tests/test_fp8.py)."""
    xp = backend.array_module(q)
    q = q.astype(np.float32, copy=False)
    a = xp.where(xp.isnan(q), np.float32(0), xp.abs(q))
    _, e = xp.frexp(a)
    e = e - 1                                              # a in [2^e, 2^(e+1))
    normal = e >= fmt.min_exp
    sub = xp.rint(xp.ldexp(a, fmt.mantissa - fmt.min_exp))           # (multiples of a step)
    frac = xp.rint((xp.ldexp(a, -e) - 1) * (1 << fmt.mantissa))
    code = xp.where(normal, ((e - fmt.min_exp + 1) << fmt.mantissa) + frac, sub)
    code = xp.where(a == 0, 0, code).astype(np.uint8)
    code = code | xp.where(xp.signbit(q), np.uint8(0x80), np.uint8(0)).astype(np.uint8)
    return xp.where(xp.isnan(q), np.uint8(0x7f), code).astype(np.uint8)


def decode(codes, fmt: Format):
    """The float32 values of fp8 ``codes`` (``encode``'s inverse; e4m3fn's 0x7f and 0xff, and
    e5m2's all-ones exponents but for its infinities, are NaN)."""
    xp = backend.array_module(codes)
    c = codes.astype(np.int32)
    bits = 7 - fmt.mantissa
    e, m = (c >> fmt.mantissa) & ((1 << bits) - 1), c & ((1 << fmt.mantissa) - 1)
    one = xp.ones(c.shape, dtype=np.float32)
    value = xp.where(e > 0, xp.ldexp(one + xp.ldexp(m.astype(np.float32), -fmt.mantissa),
                                     e + fmt.min_exp - 1),
                     xp.ldexp(m.astype(np.float32), fmt.min_exp - fmt.mantissa))
    top = e == (1 << bits) - 1
    if fmt.max == E4M3.max:
        value = xp.where(top & (m == (1 << fmt.mantissa) - 1), np.float32(np.nan), value)
    else:
        value = xp.where(top, xp.where(m == 0, np.float32(np.inf), np.float32(np.nan)), value)
    return xp.where(c & 0x80, -value, value).astype(np.float32)


def amax_of(x):
    """``x``'s largest finite-or-infinite magnitude, NaNs left out (a 0-d float32 array where x
    lives: no read to the host)."""
    xp = backend.array_module(x)
    a = xp.abs(x.astype(np.float32, copy=False))
    return xp.where(xp.isnan(a), 0, a).max().astype(np.float32)


def scale_for(amax, fmt: Format):
    """The largest power of two that brings ``amax`` to at most ``fmt.max`` (an amax of 0: as
    if it were 1). frexp, not log2: exact at every power of two, as the CUDA kernels compute
    it (kernels/fp8_quant.py)."""
    xp = backend.array_module(amax)
    amax = xp.asarray(amax, dtype=np.float32).reshape(())
    safe = xp.where(amax > 0, amax, np.float32(1.0)).astype(np.float32)
    _, e = xp.frexp(np.float32(fmt.max) / safe)          # max / amax in [2^(e-1), 2^e)
    return xp.ldexp(xp.ones_like(safe), e - 1)


def scale_of(x, fmt: Format):
    """``scale_for(amax_of(x), fmt)``: x's own per-tensor scale."""
    return scale_for(amax_of(x), fmt)


def quantized(x, fmt: Format, amax=None):
    """``x`` as an fp8 GEMM sees it: round(x * s) / s, s = ``scale_for(amax)`` (x's own amax
    where none is given; a larger one where x is a shard of a tensor: ``Split``), in x's
    dtype (exact in bf16 and float32). The twin of kernels.FP8_QUANTIZE (two launches on a
    GPU) and of FP8_ROUND (one, given the amax)."""
    x32 = x.astype(np.float32)
    s = scale_for(amax_of(x32) if amax is None else amax, fmt)
    x32 *= s
    q = round_to_fp8(x32, fmt)
    q /= s
    return q if q.dtype == x.dtype else q.astype(x.dtype)


@dataclass(frozen=True)
class Split:
    """Which fp8 operands of one linear layer are split over ``comm``'s ranks (a tensor-
    parallel shard: a column-parallel layer's weight and output gradient, a row-parallel
    layer's input and weight): each is scaled by the group's amax (one max-allreduce of a
    scalar), as one rank holding the whole tensor would scale it, so a tensor-parallel fp8
    run quantizes to the one-rank run's codes."""
    comm: object
    operands: frozenset          # of "input", "weight", "gradient"

    def over(self, operand: str):
        """The communicator ``operand``'s amax is reduced over (None: its own is the
        tensor's)."""
        return self.comm if operand in self.operands and self.comm.size > 1 else None


def split_over(split: Split | None, operand: str):
    return None if split is None else split.over(operand)


_ON = [False]
_OUT = [0]            # kept_out() contexts open now


def set_linears(on: bool) -> None:
    """Whether the linear layers' GEMMs run in fp8 in this run (mixed precision sets it)."""
    _ON[0] = bool(on)


def linears() -> bool:
    """Whether a linear layer whose forward runs now computes in fp8."""
    return _ON[0] and not _OUT[0]


@contextlib.contextmanager
def kept_out():
    """The linear layers whose forward runs inside compute as in bf16, forward and backward,
    under --precision fp8 too: the LM head (its logits decide the loss; torchao's recipe
    leaves it out too) and a mixture of experts' router (its scores decide the routing)."""
    _OUT[0] += 1
    try:
        yield
    finally:
        _OUT[0] -= 1


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
