"""The optimizer's CPU kernels (cpu_flat_jit.py's numba loops over a flat buffer) behind the
calls their users make: the gradient's sum of squares and norm (``GRAD_NORM``'s signature),
its scaling by the clipping factor (optim.clip), and AdamW (``ADAMW``'s)."""
from __future__ import annotations

import math

import numpy as np

from . import adamw as adamw_kernels
from .cpu import jit, wanted


def sumsq(x) -> float:
    """The sum of squares of a 1-D x's elements, added in float64 in blocks of 65536 (the
    same sum at any thread count): one pass, no squared copy."""
    part = np.empty(-(-x.size // 65536), np.float64)
    jit().sumsq_partial(x, part)
    return float(part.sum())


def grad_norm(g):
    """twin: grad_norm.grad_norm_twin — [sum of squares, norm] of a 1-D contiguous g."""
    sq = sumsq(g)
    return np.array([sq, math.sqrt(sq)])


def scale(x, s: float) -> bool:
    """``x *= s`` for a large contiguous 1-D ``x`` on the rank's threads (the clipping
    factor: NumPy's runs on one); False: not taken (the caller multiplies)."""
    if not (wanted(x) and x.ndim == 1 and x.flags.c_contiguous):
        return False
    jit().scale(x, x.dtype.type(s))
    return True


def adamw(p, g, m, v, decay, lr, beta1, beta2, eps, wd, step, norm, max_norm):
    """twin: adamw.adamw_twin, on flat contiguous buffers (the clipping factor from a host
    ``norm``, the gradient scaled as the kernel reads it)."""
    s = p.dtype.type
    clip = adamw_kernels.clip_factor(norm, max_norm)
    jit().adamw(p, g, m, v, decay if decay is not None else np.zeros(p.size, np.uint8),
                bool(wd) and decay is not None, s(1.0 if clip is None else clip), s(lr),
                s(beta1), s(beta2), s(eps), s(wd), s(1.0 - beta1 ** step),
                s(np.sqrt(1.0 - beta2 ** step)))
    return p, m, v
