"""The mixture of experts' CPU kernels (cpu_jit.py's numba loops) behind the same calls as
their twins (kernels/moe.py): a token's rows to its experts' order and back, and the combine's
backward."""
from __future__ import annotations

import numpy as np

from .cpu import _mat, jit


def moe_permute(x, order, k):
    xs = np.empty((order.size, x.shape[-1]), x.dtype)
    jit().moe_permute(_mat(x), np.ascontiguousarray(order, np.int64), k, xs)
    return xs


def moe_combine(ys, w, inv, k):
    """w None: gates of one (times 1 changes no bit of the twin's unscaled sum)."""
    ys = _mat(ys)
    w = np.ones(ys.shape[0], ys.dtype) if w is None else np.ascontiguousarray(w, ys.dtype)
    y = np.empty((inv.size // k, ys.shape[1]), ys.dtype)
    if k:
        jit().moe_combine(ys, w, np.ascontiguousarray(inv, np.int64), k, y)
    return y


def moe_combine_bwd(g, ys, w, order, k):
    ys = _mat(ys)
    gys, gw = np.empty_like(ys), np.empty(ys.shape[0], ys.dtype)
    jit().moe_combine_bwd(_mat(g), ys, np.ascontiguousarray(w, ys.dtype),
                          np.ascontiguousarray(order, np.int64), k, gys, gw)
    return gys, gw
