"""GEMMs from inside numba kernels: a GEMM's rows and attention's (sequence, head) pairs over
the rank's threads, each part one call of NumPy's own BLAS (host/blas.py) on one thread.

Why here and not in Python threads: the rank's threads are numba's OpenMP threads, one set for
GEMMs and fused kernels alike (host/pool.py). Handing a part to a Python thread cost ~100 us
(a wake-up and the GIL, twice), an OpenMP region ~2 us: a 2048 x 128 x 128 GEMM on two threads
took 430 us through Python threads and 320 here (one thread: 490).

``_gemm`` calls the BLAS function at an address the caller passes (``fp``), so the kernels
cache on disk like the others. Arrays come in whole with element offsets; the data pointer is
taken inside the call, so no array is freed while BLAS writes it. Only cpu.py, cpu_attention.py
and host/pool.py import this."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ...host.blas import NO_TRANS, ROW_MAJOR, TRANS
from .cpu_jit import FLAGS, SERIAL, kernel

_softmax, _probs, _softmax_bwd = SERIAL.softmax_causal, SERIAL.probs_from_lse, SERIAL.softmax_bwd


@intrinsic
def _gemm(typingctx, fp, bits, ta, tb, m, n, k, alpha, a, oa, lda, b, ob, ldb, beta, c, oc,
          ldc):
    """cblas_?gemm(RowMajor, ta, tb, m, n, k, alpha, a + oa, lda, b + ob, ldb, beta, c + oc,
    ldc) at address ``fp``; ``bits`` (an integer of the BLAS's width) picks LP64 or ILP64."""
    sig = types.void(fp, bits, ta, tb, m, n, k, alpha, a, oa, lda, b, ob, ldb, beta, c, oc, ldc)

    def codegen(context, builder, signature, args):
        tys = signature.args
        i32, it = ir.IntType(32), ir.IntType(tys[1].bitwidth)
        ft = context.get_value_type(tys[8].dtype)

        def num(i, to):
            v = args[i]
            if v.type.width == to.width:
                return v
            return builder.trunc(v, to) if v.type.width > to.width else builder.sext(v, to)

        def ptr(i, off):
            data = context.make_array(tys[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [num(off, ir.IntType(64))]),
                                   ir.IntType(8).as_pointer())

        def flt(i):
            return context.cast(builder, args[i], tys[i], tys[8].dtype)

        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, it, it, it, ft, i8p, it, i8p, it,
                                               ft, i8p, it])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fn, [ir.Constant(i32, ROW_MAJOR), num(2, i32), num(3, i32), num(4, it),
                          num(5, it), num(6, it), flt(7), ptr(8, 9), num(10, it), ptr(11, 12),
                          num(13, it), flt(14), ptr(15, 16), num(17, it)])
        return context.get_dummy_value()
    return sig, codegen


@kernel
def gemm_rows(fp, bits, a, ta, lda, b, tb, ldb, c, beta, parts):
    """c (M, N) = a @ b + beta c, a's rows in ``parts`` blocks of 16-row lines, one BLAS call
    each (the inner dimension whole); ``ta``/``lda``: how a is stored (TRANS: by columns)."""
    M, N = c.shape
    K = a.shape[1]
    step = ((M + parts - 1) // parts + 15) // 16 * 16
    for p in prange(parts):
        r0 = p * step
        r1 = min(M, r0 + step)
        if r1 > r0:
            _gemm(fp, bits, ta, tb, r1 - r0, N, K, 1.0, a, r0 * lda if ta == NO_TRANS else r0,
                  lda, b, 0, ldb, beta, c, r0 * N, N)


@njit(**FLAGS)
def _heads(qkv, n_head, n_kv_head, b, h):
    """Element offsets of query head h's q, its kv head's k and v in qkv (B, T, (nh + 2 nkv)
    hs), and of its y in (B, T, nh hs), for sequence b."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    kh = h // (n_head // n_kv_head)
    base = b * T * W
    return (base + h * hs, base + (n_head + kh) * hs, base + (n_head + n_kv_head + kh) * hs,
            b * T * n_head * hs + h * hs)


@kernel
def attention_fwd(fp, bits, qkv, y, lse, n_head, n_kv_head, scale, qstep):
    """y (B, T, nh hs), lse (B, nh, T) of causal attention (query head h reads kv head
    h // (nh / nkv)); every (sequence, head) pair on one thread, its queries in blocks of
    ``qstep`` that see keys up to their last only."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    C = n_head * hs
    for pair in prange(B * n_head):
        b, h = pair // n_head, pair % n_head
        oq, ok, ov, oy = _heads(qkv, n_head, n_kv_head, b, h)
        buf = np.empty(qstep * T, qkv.dtype)
        for i0 in range(0, T, qstep):
            i1 = min(T, i0 + qstep)
            tq = i1 - i0
            s = buf[:tq * i1].reshape((tq, i1))
            _gemm(fp, bits, NO_TRANS, TRANS, tq, i1, hs, 1.0, qkv, oq + i0 * W, W, qkv, ok,
                  W, 0.0, s, 0, i1)
            _softmax(s, lse[b, h, i0:i1], tq, i0, scale)
            _gemm(fp, bits, NO_TRANS, NO_TRANS, tq, hs, i1, 1.0, s, 0, i1, qkv, ov, W, 0.0,
                  y, oy + i0 * C, C)


@kernel
def attention_bwd(fp, bits, qkv, g, lse, dqkv, n_head, n_kv_head, scale, qstep):
    """dqkv of attention_fwd, the probabilities recomputed from lse a block of queries at a
    time; every (sequence, kv head) on one thread with the query heads it serves in turn, so
    a key's gradient adds over its queries on that thread alone (BLAS's beta = 1)."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    C, G = n_head * hs, n_head // n_kv_head
    for pair in prange(B * n_kv_head):
        b, kh = pair // n_kv_head, pair % n_kv_head
        for t in range(T):
            for j in range(hs):
                dqkv[b, t, (n_head + kh) * hs + j] = 0
                dqkv[b, t, (n_head + n_kv_head + kh) * hs + j] = 0
        pbuf, dbuf = np.empty(qstep * T, qkv.dtype), np.empty(qstep * T, qkv.dtype)
        for h in range(kh * G, (kh + 1) * G):
            oq, ok, ov, og = _heads(qkv, n_head, n_kv_head, b, h)
            for i0 in range(0, T, qstep):
                i1 = min(T, i0 + qstep)
                tq = i1 - i0
                p, ds = pbuf[:tq * i1].reshape((tq, i1)), dbuf[:tq * i1].reshape((tq, i1))
                _gemm(fp, bits, NO_TRANS, TRANS, tq, i1, hs, 1.0, qkv, oq + i0 * W, W, qkv,
                      ok, W, 0.0, p, 0, i1)
                _probs(p, lse[b, h, i0:i1], tq, i0, scale)
                _gemm(fp, bits, TRANS, NO_TRANS, i1, hs, tq, 1.0, p, 0, i1, g, og + i0 * C, C,
                      1.0, dqkv, ov, W)                                     # dv += p^T g
                _gemm(fp, bits, NO_TRANS, TRANS, tq, i1, hs, 1.0, g, og + i0 * C, C, qkv, ov,
                      W, 0.0, ds, 0, i1)                                    # d probabilities
                _softmax_bwd(ds, p, scale)
                _gemm(fp, bits, NO_TRANS, NO_TRANS, tq, hs, i1, 1.0, ds, 0, i1, qkv, ok, W,
                      0.0, dqkv, oq + i0 * W, W)                            # dq
                _gemm(fp, bits, TRANS, NO_TRANS, i1, hs, tq, 1.0, ds, 0, i1, qkv,
                      oq + i0 * W, W, 1.0, dqkv, ok, W)                     # dk += ds^T q
