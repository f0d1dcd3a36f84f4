"""How a linear layer's GEMMs take their operands (``linear_operands``): as this run's GEMMs
take any operand (gemm.operand: bf16 words, or x), or under ``--precision fp8`` quantized —
fp8's values for a bf16 GEMM (kernels/fp8_quant.py, the emulation) or fp8 codes for
cuBLASLt's FP8 matmul (kernels/fp8_gemm.py) — each scaled by its tensor's amax."""
from __future__ import annotations

import functools

from .. import fp8
from . import fp8_gemm
from .fp8_quant import FP8_AMAX, FP8_QUANTIZE, FP8_ROUND
from .gemm import operand


def linear_operands(split=None, x=None, w=None):
    """How one linear layer's GEMMs take their operands, fixed as its forward runs (its
    backward quantizes as its forward did): ``f(a, role, transposed=False)``, role "input",
    "weight" or "gradient", -> ``operand(a)`` (``.T`` of it where ``transposed``: the
    backward's weight, which its GEMM reads only so; the forward's only as it is). Under
    ``--precision fp8`` (outside ``fp8.kept_out()``), e4m3 (e5m2 for the gradient) scaled by
    a power of two, by the whole tensor's amax where ``split`` (fp8.Split) says ``a`` is a
    shard (one max-allreduce of a scalar over its ranks; a weight's once: its backward reads
    what its forward read): as fp8 codes for cuBLASLt's FP8 matmul where the layer's input
    ``x`` and weight ``w`` allow it (fp8_gemm.takes: a Hopper GPU, the stand-in; a weight's
    in the one layout its GEMM reads), else as their values in a's dtype (device/fp8.py)."""
    if not fp8.linears():
        return lambda a, role, transposed=False: operand(a).T if transposed else operand(a)
    codes = x is not None and w is not None and x.ndim >= 2 and \
        fp8_gemm.takes(x, x.size // w.shape[0], w.shape[0], w.shape[1])
    return functools.partial(_fp8_operand, split, {}, codes)


def _fp8_operand(split, reduced: dict, codes: bool, x, role: str, transposed: bool = False):
    fmt = fp8.E5M2 if role == "gradient" else fp8.E4M3
    over = fp8.split_over(split, role)
    amax = None if over is None else reduced.get(role)
    if over is not None and amax is None:
        amax = over.allreduce(FP8_AMAX(x), op="max")
        if role == "weight":
            reduced[role] = amax
    if codes:                 # (a weight: the layout its one GEMM reads, the others both)
        layouts = fp8_gemm.BOTH if role != "weight" else \
            fp8_gemm.ROWS if transposed else fp8_gemm.COLS
        q = fp8_gemm.codes(x, fmt, amax, layouts)
    elif amax is None:
        q = FP8_QUANTIZE(x, fmt.max, fmt.mantissa, fmt.min_exp)
    else:
        q = FP8_ROUND(x, amax, fmt.max, fmt.mantissa, fmt.min_exp)
    return q.T if transposed else q
