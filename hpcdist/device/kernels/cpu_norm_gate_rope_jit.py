"""The rotary families' CPU kernels, compiled by numba (RMSNorm, SwiGLU, GeGLU, rotary embeddings): threads
over rows as cpu_jit.py's; RMSNorm's weight gradient as partial sums per fixed block of rows
(the same order at any thread count). Only cpu.jit() imports this (numba on first use)."""
from __future__ import annotations

import math

from numba import prange

from .common import ROW_BLOCK
from .cpu_jit import fexp, ftanh, kernel, like

BLOCK = ROW_BLOCK

@kernel
def rmsnorm_fwd(x, w, y, rstd, eps):
    inv_c, one = like(eps, 1.0 / x.shape[1]), like(eps, 1.0)
    for r in prange(x.shape[0]):
        q = like(eps, 0.0)
        for j in range(x.shape[1]):
            q += x[r, j] * x[r, j]
        rs = one / math.sqrt(q * inv_c + eps)
        for j in range(x.shape[1]):
            y[r, j] = x[r, j] * rs * w[j]
        rstd[r] = rs


@kernel
def rmsnorm_bwd(g, x, w, rstd, add, has_add, gx, gw_part, inv_c):
    """gx per row (plus ``add``'s row where ``has_add``, in the same pass); the weight's
    gradient as partial sums per BLOCK of rows."""
    R, C = x.shape
    for k in prange(gw_part.shape[0]):
        gw_part[k, :] = 0
        for r in range(k * BLOCK, min(R, (k + 1) * BLOCK)):
            rs = rstd[r]
            s = like(inv_c, 0.0)
            for j in range(C):
                xh = x[r, j] * rs
                s += g[r, j] * w[j] * xh
                gw_part[k, j] += g[r, j] * xh
            s *= inv_c
            if has_add:
                for j in range(C):
                    gx[r, j] = rs * (g[r, j] * w[j] - x[r, j] * rs * s) + add[r, j]
            else:
                for j in range(C):
                    gx[r, j] = rs * (g[r, j] * w[j] - x[r, j] * rs * s)


@kernel
def swiglu_fwd(h, y):
    H = y.shape[1]
    for r in prange(y.shape[0]):
        for j in range(H):
            a = h[r, j]
            e = fexp(-abs(a))                              # e^-|a| <= 1: no overflow
            s = like(a, 1.0) / (like(a, 1.0) + e) if a >= 0 else e / (like(a, 1.0) + e)
            y[r, j] = a * s * h[r, H + j]


@kernel
def swiglu_bwd(h, g, dh):
    H = g.shape[1]
    one = like(h[0, 0], 1.0)
    for r in prange(g.shape[0]):
        for j in range(H):
            a, u, gi = h[r, j], h[r, H + j], g[r, j]
            e = fexp(-abs(a))
            s = one / (one + e) if a >= 0 else e / (one + e)
            dh[r, j] = gi * u * s * (one + a * (one - s))
            dh[r, H + j] = gi * a * s


@kernel
def geglu_fwd(h, y, c, c3):
    H = y.shape[1]
    half, one = like(c, 0.5), like(c, 1.0)
    for r in prange(y.shape[0]):
        for j in range(H):
            a = h[r, j]
            t, _ = ftanh(c * (a + c3 * a * a * a))
            y[r, j] = half * a * (one + t) * h[r, H + j]


@kernel
def geglu_bwd(h, g, dh, c, c3):
    H = g.shape[1]
    half, one, c33 = like(c, 0.5), like(c, 1.0), like(c, 3.0) * c3
    for r in prange(g.shape[0]):
        for j in range(H):
            a, u, gi = h[r, j], h[r, H + j], g[r, j]
            t, sech2 = ftanh(c * (a + c3 * a * a * a))
            d = half * (one + t) + half * a * sech2 * c * (one + c33 * a * a)
            dh[r, j] = gi * u * d
            dh[r, H + j] = gi * half * a * (one + t)


@kernel
def rotary(x, out, cs, sn, T, heads, hd, sign):
    """Rows of x (B T, W): the first ``heads`` heads' pairs (i, i + hd/2) rotated, the rest
    copied."""
    half = hd // 2
    for r in prange(x.shape[0]):
        t = r % T
        for j in range(heads * hd, x.shape[1]):
            out[r, j] = x[r, j]
        for h in range(heads):
            a = h * hd
            for p in range(half):
                c, s = cs[t, p], sign * sn[t, p]
                x1, x2 = x[r, a + p], x[r, a + half + p]
                out[r, a + p] = x1 * c - x2 * s
                out[r, a + half + p] = x2 * c + x1 * s


