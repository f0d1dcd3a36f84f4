"""The optimizer's CPU kernels over a flat buffer, compiled by numba: the gradient's sum of
squares (clipping's norm), its scaling by the clipping factor, and AdamW. Each runs over
fixed chunks (65536 elements for the sum, 4096 for the rest) on the rank's threads, so a
sum adds in the same order at any thread count; each chunk's loop is indexed from 0, where
LLVM vectorises it. Only cpu.jit() imports this (numba on first use)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .cpu_jit import FLAGS, kernel, like


@njit(**FLAGS)
def _sumsq_chunk(x):
    """The sum of squares of x's elements in float64, indexed from 0 (as _adamw_chunk: so
    LLVM vectorises the sum; from a block's start it stayed scalar, 4.6x slower, measured)."""
    s = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        s += v * v
    return s


@kernel
def sumsq_partial(x, part):
    """part[k] = the sum of squares of x's elements 65536 k .. 65536 (k + 1), in float64."""
    n = x.size
    for k in prange(part.shape[0]):
        part[k] = _sumsq_chunk(x[k * 65536:min(n, (k + 1) * 65536)])


@njit(**FLAGS)
def _adamw_chunk(p, g, m, v, decay, cut, clip, beta1, beta2, eps, step, keep1, keep2,
                 sqrt_bias2):
    """One chunk, indexed from 0: LLVM vectorises this loop, where indices running from a
    chunk's start kept numba's negative-index check in it (scalar sqrt and division: 2.2x
    slower, measured)."""
    one = like(eps, 1.0)
    for i in range(p.size):
        # p (1 - lr wd) where decay[i] (0 or 1): no branch in the loop
        pi = p[i] * (one - cut * decay[i])
        gi = g[i] * clip
        vi = v[i] * beta2 + gi * gi * keep2
        mi = m[i] * beta1 + gi * keep1
        p[i] = pi - mi / (math.sqrt(vi) / sqrt_bias2 + eps) * step
        m[i] = mi
        v[i] = vi


@kernel
def adamw(p, g, m, v, decay, has_decay, clip, lr, beta1, beta2, eps, wd, bias1, sqrt_bias2):
    """The twin's operations in its order (adamw.adamw_twin), in chunks of 4096; the
    scalars come in as the arrays' type; ``clip``: the gradient's clipping factor (1: none;
    a product by 1 is exact)."""
    n = p.size
    one = like(lr, 1.0)
    cut = lr * wd if has_decay else like(lr, 0.0)
    step, keep1, keep2 = lr / bias1, one - beta1, one - beta2
    for k in prange((n + 4095) // 4096):
        a = k * 4096
        b = min(n, a + 4096)
        _adamw_chunk(p[a:b], g[a:b], m[a:b], v[a:b], decay[a:b], cut, clip, beta1, beta2, eps,
                     step, keep1, keep2, sqrt_bias2)


@njit(**FLAGS)
def _scale_chunk(x, s):
    for i in range(x.size):
        x[i] *= s


@kernel
def scale(x, s):
    """x *= s in place (``s`` in x's type: the product NumPy's ``x *= s`` rounds)."""
    n = x.size
    for k in prange((n + 4095) // 4096):
        _scale_chunk(x[k * 4096:min(n, k * 4096 + 4096)], s)
