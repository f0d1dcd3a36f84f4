"""The fused ops' CPU kernels, compiled by numba: one pass over memory, threads over rows.

Each loop body is written once for float32 and float64 (numba compiles one per dtype, cached
on disk); constants are made in the array's type (``like``) or come in as arguments of it, so
a float32 call stays float32 and a float64 one float64. ``exp`` of float32 is ours
(``_exp32``: Cody-Waite range reduction, a degree-6 polynomial and the exponent written into
the bits, 2 ulp) because LLVM vectorises it, where libm's ``expf`` runs one element at a time
(GELU 5x slower, measured); float64 keeps libm's. Row blocks are fixed (``BLOCK``), not one
per thread, so the partial sums of a column reduction add in the same order at any thread
count.

Only hpcdist/device/kernels/cpu.py imports this (importing numba costs ~0.3 s)."""
from __future__ import annotations

import math
import types as pytypes

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .common import ROW_BLOCK

# error_model numpy: x / 0 is inf, as in NumPy (Python's model checks for zero before every
# division, and the branch stopped LLVM vectorising the serial kernels: 15x slower, measured)
FLAGS = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")
BLOCK = ROW_BLOCK                # rows per partial sum of a column reduction
_F = np.float32


@intrinsic
def _bits_to_f32(typingctx, k):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def _minmax(name):
    @intrinsic
    def op(typingctx, a, b):
        def codegen(context, builder, signature, args):
            ty = args[0].type
            fn = builder.module.declare_intrinsic(name, [ty], ir.FunctionType(ty, [ty, ty]))
            return builder.call(fn, args, fastmath=("fast",))
        return a(a, b), codegen
    return op


# LLVM's maxnum/minnum: vectorised, where numba's max()/min() compare and branch one element
# at a time (a row maximum 10x slower, measured)
fmax, fmin = _minmax("llvm.maxnum"), _minmax("llvm.minnum")


@njit(inline="always", fastmath=True, error_model="numpy")
def _exp32(x):
    x = fmin(fmax(x, _F(-87.3)), _F(88.0))           # 2^k stays finite (k <= 127)
    k = np.floor(x * _F(1.442695040888963) + _F(0.5))      # (math.floor: an int64)
    r = x - k * _F(0.693145751953125) - k * _F(1.428606765330187e-06)
    p = _F(1.0) + r * (_F(1.0) + r * (_F(0.5) + r * (_F(0.16666667) + r * (
        _F(0.041666668) + r * (_F(0.008333334) + r * _F(0.0013888889))))))
    return p * _bits_to_f32((np.int32(k) + np.int32(127)) << np.int32(23))


def fexp(x):
    """exp of a float32 or float64 scalar inside a kernel."""
    raise NotImplementedError


def like(x, value):
    """``value`` as a scalar of x's type inside a kernel: numba follows NumPy, where float32
    times a Python number is float64 (measured: every op of a float32 kernel was float64)."""
    raise NotImplementedError


@overload(fexp, inline="always", fastmath=True)
def _fexp(x):
    if x == types.float32:
        return lambda x: _exp32(x)
    return lambda x: math.exp(x)


@overload(like, inline="always")
def _like(x, value):
    if x == types.float32:
        return lambda x, value: np.float32(value)
    return lambda x, value: np.float64(value)


@njit(inline="always", fastmath=True, error_model="numpy")
def _tanh32(u):
    """(tanh u, 1 - tanh^2 u) through e = exp(2u): 1 - 2 / (e + 1) and 4 / (e + 2 + 1/e) (the
    second without the cancellation of 1 - t t, and finite however fastmath reorders the
    products around it), |u| clipped at 40: GELU's derivative multiplies it by ~x^3."""
    e = _exp32(fmin(fmax(u + u, _F(-80.0)), _F(80.0)))
    return _F(1.0) - _F(2.0) / (e + _F(1.0)), _F(4.0) / (e + _F(2.0) + _F(1.0) / e)


def ftanh(x):
    """(tanh x, 1 - tanh^2 x) of a float32 (ours, vectorised) or float64 (libm's) scalar
    inside a kernel."""
    raise NotImplementedError


def _tanh64(x):
    t = math.tanh(x)
    return t, 1.0 - t * t


@overload(ftanh, inline="always", fastmath=True)
def _ftanh(x):
    if x == types.float32:
        return lambda x: _tanh32(x)
    return _tanh64


PARALLEL = pytypes.SimpleNamespace()      # each kernel threaded over its rows (prange)
SERIAL = pytypes.SimpleNamespace()        # the same on the calling thread alone


def kernel(fn):
    """Compile ``fn`` twice: threaded (into PARALLEL) and on the calling thread (SERIAL, for
    a rank of one thread: a work queue's handoff per call cost 1.6x on 8 ranks sharing 2
    cores, measured). The serial copy has a name of its own, so numba caches both."""
    PARALLEL.__dict__[fn.__name__] = njit(parallel=True, **FLAGS)(fn)
    twin = pytypes.FunctionType(fn.__code__.replace(co_name=fn.__name__ + "_serial"),
                                fn.__globals__, fn.__name__ + "_serial")
    twin.__qualname__ = fn.__qualname__ + "_serial"
    SERIAL.__dict__[fn.__name__] = njit(**FLAGS)(twin)
    return fn


# ---- elementwise -------------------------------------------------------------------------

@kernel
def bias_gelu(h, b, y, has_bias, c, c3):
    """h (R, C) += b where has_bias (kept: the backward's input); y = gelu(h)."""
    half, one = like(c, 0.5), like(c, 1.0)
    for r in prange(h.shape[0]):
        if has_bias:                      # (a branch inside the loop stops vectorising)
            for j in range(h.shape[1]):
                h[r, j] += b[j]
        for j in range(h.shape[1]):
            v = h[r, j]
            y[r, j] = half * v * (one + ftanh(c * (v + c3 * v * v * v))[0])


@kernel
def gelu_bwd(x, g, gx, c, c3):
    half, one, c33 = like(c, 0.5), like(c, 1.0), like(c, 3.0) * c3
    for r in prange(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[r, j]
            t, sech2 = ftanh(c * (v + c3 * v * v * v))
            d = half * (one + t) + half * v * sech2 * c * (one + c33 * v * v)
            gx[r, j] = g[r, j] * d


@kernel
def bias_residual(out, bias, res, has_bias, has_res):
    for r in prange(out.shape[0]):
        if has_bias and has_res:
            for j in range(out.shape[1]):
                out[r, j] = out[r, j] + bias[j] + res[r, j]
        elif has_bias:
            for j in range(out.shape[1]):
                out[r, j] += bias[j]
        elif has_res:
            for j in range(out.shape[1]):
                out[r, j] += res[r, j]


@kernel
def colsum_partial(g, part):
    """part[k] = the sum of rows BLOCK k .. BLOCK (k + 1) of g (R, C)."""
    R = g.shape[0]
    for k in prange(part.shape[0]):
        part[k, :] = 0
        for r in range(k * BLOCK, min(R, (k + 1) * BLOCK)):
            for j in range(g.shape[1]):
                part[k, j] += g[r, j]


# ---- rows ----------------------------------------------------------------------------------

@kernel
def layernorm_fwd(x, w, b, y, mean, rstd, eps):
    inv_c, one = like(eps, 1.0 / x.shape[1]), like(eps, 1.0)
    for r in prange(x.shape[0]):
        s = like(eps, 0.0)
        for j in range(x.shape[1]):
            s += x[r, j]
        mu = s * inv_c
        q = like(eps, 0.0)
        for j in range(x.shape[1]):
            d = x[r, j] - mu
            q += d * d
        rs = one / math.sqrt(q * inv_c + eps)
        for j in range(x.shape[1]):
            y[r, j] = (x[r, j] - mu) * rs * w[j] + b[j]
        mean[r] = mu
        rstd[r] = rs


@kernel
def layernorm_bwd(g, x, w, mean, rstd, add, has_add, gx, gw_part, gb_part, inv_c):
    """gx per row (plus ``add``'s row where ``has_add``: the residual's gradient, in the same
    pass); the weight's and bias's gradients as partial sums per BLOCK of rows."""
    R, C = x.shape
    for k in prange(gw_part.shape[0]):
        gw_part[k, :] = 0
        gb_part[k, :] = 0
        for r in range(k * BLOCK, min(R, (k + 1) * BLOCK)):
            mu, rs = mean[r], rstd[r]
            s1, s2 = like(inv_c, 0.0), like(inv_c, 0.0)
            for j in range(C):
                xh = (x[r, j] - mu) * rs
                gh = g[r, j] * w[j]
                s1 += gh
                s2 += gh * xh
                gw_part[k, j] += g[r, j] * xh
                gb_part[k, j] += g[r, j]
            s1 *= inv_c
            s2 *= inv_c
            if has_add:                       # (outside the loops: a branch in one stops
                for j in range(C):            # its vectorisation)
                    gx[r, j] = rs * (g[r, j] * w[j] - s1 - (x[r, j] - mu) * rs * s2) + add[r, j]
            else:
                for j in range(C):
                    gx[r, j] = rs * (g[r, j] * w[j] - s1 - (x[r, j] - mu) * rs * s2)


@kernel
def softmax_causal(x, lse, tq, past, scale):
    """x := softmax(scale x) of each row r of x (R, S), in place, query r % tq seeing keys
    0..past + r % tq (0 beyond); lse[r] its log-sum-exp. In place by design: with an output
    array that was x, LLVM's overlap check sent every row down its scalar loop (2.3 ns an
    element against 0.34, measured); one array has no overlap to check."""
    S = x.shape[1]
    one = like(scale, 1.0)
    for r in prange(x.shape[0]):
        n = min(S, past + r % tq + 1)
        top = x[r, 0] * scale
        for j in range(1, n):
            top = fmax(top, x[r, j] * scale)
        s = like(scale, 0.0)
        for j in range(n):
            e = fexp(x[r, j] * scale - top)
            x[r, j] = e
            s += e
        inv = one / s
        for j in range(n):
            x[r, j] *= inv
        for j in range(n, S):
            x[r, j] = 0
        lse[r] = top + math.log(s)


@kernel
def probs_from_lse(s, lse, tq, past, scale):
    """s (R, S) := exp(scale s - lse) where query r % tq (after ``past``) sees the key, 0
    beyond, in place: a flash-style backward recomputes the probabilities from the scores
    and the forward's log-sum-exp."""
    S = s.shape[1]
    for r in prange(s.shape[0]):
        n = min(S, past + r % tq + 1)
        for j in range(n):
            s[r, j] = fexp(s[r, j] * scale - lse[r])
        for j in range(n, S):
            s[r, j] = 0


@kernel
def softmax_bwd(g, y, scale):
    """g := scale y (g - sum(g y)) per row, in place (as softmax_causal, for the vector
    loop: 0.40 ns an element into an output that was g, 0.15 in place, measured)."""
    for r in prange(y.shape[0]):
        d = like(scale, 0.0)
        for j in range(y.shape[1]):
            d += g[r, j] * y[r, j]
        for j in range(y.shape[1]):
            g[r, j] = scale * y[r, j] * (g[r, j] - d)


@kernel
def cross_entropy_fwd(z, t, ignore, vocab, nll, lse, zero):
    """Over the first ``vocab`` columns of each row (the rest: padding, never in the loss)."""
    for r in prange(z.shape[0]):
        top = z[r, 0]
        for j in range(1, vocab):
            top = fmax(top, z[r, j])
        s = like(zero, 0.0)
        for j in range(vocab):
            s += fexp(z[r, j] - top)
        lse[r] = top + math.log(s)
        nll[r] = zero if t[r] == ignore else lse[r] - z[r, t[r]]


@kernel
def cross_entropy_bwd(z, t, lse, ignore, vocab, weight, gz):
    V = z.shape[1]
    for r in prange(z.shape[0]):
        if t[r] == ignore:
            gz[r, :] = 0
            continue
        for j in range(vocab):
            gz[r, j] = fexp(z[r, j] - lse[r]) * weight
        for j in range(vocab, V):
            gz[r, j] = 0
        gz[r, t[r]] -= weight


@kernel
def scatter_rows(target, idx, values):
    """target[idx[i]] += values[i] in order of i (repeats accumulate: an embedding's backward);
    the columns in blocks of 64 over the threads, so no two threads write one element."""
    C = values.shape[1]
    for c in prange((C + 63) // 64):
        for i in range(idx.shape[0]):
            r = idx[i]
            for j in range(c * 64, min(C, c * 64 + 64)):
                target[r, j] += values[i, j]


# ---- mixture of experts: rows through the permutation and back (kernels/moe.py) -----------

@kernel
def moe_permute(x, order, k, xs):
    for p in prange(order.shape[0]):
        t = order[p] // k
        for j in range(x.shape[1]):
            xs[p, j] = x[t, j]


@kernel
def moe_combine(ys, w, inv, k, y):
    """y[t] = sum over slots s of w[p] ys[p], p = inv[t k + s], added in slot order."""
    for t in prange(y.shape[0]):
        p = inv[t * k]
        for j in range(y.shape[1]):
            y[t, j] = ys[p, j] * w[p]
        for s in range(1, k):
            p = inv[t * k + s]
            for j in range(y.shape[1]):
                y[t, j] += ys[p, j] * w[p]


@kernel
def moe_combine_bwd(g, ys, w, order, k, gys, gw):
    for p in prange(ys.shape[0]):
        t = order[p] // k
        d = like(w[p], 0.0)
        for j in range(ys.shape[1]):
            gys[p, j] = g[t, j] * w[p]
            d += g[t, j] * ys[p, j]
        gw[p] = d
