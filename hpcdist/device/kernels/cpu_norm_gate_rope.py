"""The rotary families' ops on the CPU: the numba kernels of cpu_norm_gate_rope_jit.py behind the twins'
calls (rmsnorm.py, swiglu.py, rotary.py), on this rank's threads."""
from __future__ import annotations

import numpy as np

from . import cpu
from .common import GELU_C, ROW_BLOCK as BLOCK


def rmsnorm(x, w, eps):
    """twin: rmsnorm.rmsnorm_twin (no x-hat kept: the backward recomputes it)."""
    x2 = cpu._mat(x)
    y = np.empty(x2.shape, x.dtype)
    rstd = np.empty(x2.shape[0], x.dtype)
    cpu.jit().rmsnorm_fwd(x2, np.ascontiguousarray(w, dtype=x.dtype), y, rstd, cpu._c(x, eps))
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1]), None


def residual_rmsnorm(x, bias, residual, w, eps):
    """twin: rmsnorm.residual_rmsnorm_twin, the two CPU kernels one after the other."""
    cpu.bias_residual(x, bias, residual)
    return (x,) + rmsnorm(x, w, eps)


def rmsnorm_bwd(g, x, w, rstd, xhat=None, gw_into=None, add=None):
    x2 = cpu._mat(x)
    R, C = x2.shape
    gx = np.empty(x2.shape, x.dtype)
    part = np.empty((-(-R // BLOCK), C), x.dtype)
    cpu.jit().rmsnorm_bwd(cpu._mat(g.astype(x.dtype, copy=False)), x2,
                          np.ascontiguousarray(w, dtype=x.dtype),
                          np.ascontiguousarray(rstd, dtype=x.dtype).reshape(-1),
                          *cpu.residual(add, gx), gx, part, cpu._c(x, 1.0 / C))
    gw = part.sum(axis=0)
    if gw_into is not None:
        gw_into += gw
        gw = gw_into
    return gx.reshape(x.shape), gw


def swiglu(h):
    h2 = cpu._mat(h)
    y = np.empty((h2.shape[0], h2.shape[1] // 2), h.dtype)
    cpu.jit().swiglu_fwd(h2, y)
    return y.reshape(h.shape[:-1] + (y.shape[1],))


def swiglu_bwd(h, g):
    h2 = cpu._mat(h)
    dh = np.empty(h2.shape, h.dtype)
    cpu.jit().swiglu_bwd(h2, cpu._mat(g.astype(h.dtype, copy=False)), dh)
    return dh.reshape(h.shape)


def geglu(h):
    h2 = cpu._mat(h)
    y = np.empty((h2.shape[0], h2.shape[1] // 2), h.dtype)
    cpu.jit().geglu_fwd(h2, y, cpu._c(h, GELU_C), cpu._c(h, 0.044715))
    return y.reshape(h.shape[:-1] + (y.shape[1],))


def geglu_bwd(h, g):
    h2 = cpu._mat(h)
    dh = np.empty(h2.shape, h.dtype)
    cpu.jit().geglu_bwd(h2, cpu._mat(g.astype(h.dtype, copy=False)), dh, cpu._c(h, GELU_C),
                        cpu._c(h, 0.044715))
    return dh.reshape(h.shape)


def rotary(x, cos, sin, nq, nk, hd, sign=1.0):
    x2 = cpu._mat(x)
    out = np.empty(x2.shape, x.dtype)
    cpu.jit().rotary(x2, out, np.ascontiguousarray(cos, dtype=x.dtype),
                     np.ascontiguousarray(sin, dtype=x.dtype), x.shape[1], nq + nk, hd,
                     cpu._c(x, sign))
    return out.reshape(x.shape)
