"""Causal self-attention on the CPU from the fused q|k|v projection, a (sequence, head) pair
at a time: BLAS GEMMs for the scores and the weighted sum (strided views of qkv, no copies),
numba's fused scale + mask + softmax + log-sum-exp between them, and a backward that
recomputes each block's probabilities from that log-sum-exp instead of keeping every head's
(T, T) of them from the forward (twins: attention.attention_twin / _bwd_twin).

Where NumPy's BLAS can be called from numba (host/blas.py) the whole of it is one kernel
(cpu_gemm.py), its pairs over the rank's threads; else blocks of pairs in turn, NumPy's
batched GEMMs between numba's row kernels (BLAS's own threads split each GEMM)."""
from __future__ import annotations

import numpy as np

from . import cpu
from .flash import ROUNDING, flash_bwd_twin, flash_twin
from ...host import blas


def blocks(B: int, n_head: int, T: int, itemsize: int):
    """(b0, b1, h0, h1) blocks of sequences x heads whose scores fit cpu.ATTENTION_BYTES (at
    least one pair)."""
    pairs = max(1, cpu.ATTENTION_BYTES // max(1, T * T * itemsize))
    if pairs >= n_head:                                    # whole sequences
        step = max(1, pairs // n_head)
        for b0 in range(0, B, step):
            yield b0, min(B, b0 + step), 0, n_head
    else:                                                  # heads of one sequence
        step = max(1, min(pairs, n_head))
        for b0 in range(B):
            for h0 in range(0, n_head, step):
                yield b0, b0 + 1, h0, min(n_head, h0 + step)


def _parts(qkv, n_head, b0, b1, h0, h1):
    """q (nb, nh, T, hs), k transposed (nb, nh, hs, T), v (nb, nh, T, hs) of one block
    (multi-head attention only: the BLAS kernel takes grouped queries)."""
    B, T, C3 = qkv.shape
    r = qkv.reshape(B, T, 3, n_head, C3 // 3 // n_head)[b0:b1, :, :, h0:h1]
    return (r[:, :, 0].transpose(0, 2, 1, 3), r[:, :, 1].transpose(0, 2, 3, 1),
            r[:, :, 2].transpose(0, 2, 1, 3))


MAX_QUERY_ROWS = 256


def query_blocks(T: int):
    """(i0, i1) blocks of queries where NumPy's batched GEMMs run attention (no BLAS callable
    from numba): block i0..i1 sees keys 0..i1 only, so the GEMMs skip the masked corner (4
    blocks: 37.5% of the scores' flops; at least 64 rows: at T 256 on one thread four of 64
    took 17.3 ms a 6x384 layer against 22.6 for one of 256, measured); at most
    MAX_QUERY_ROWS, so a block's scores (rows x T) grow linearly with T, not as T^2/4 (T
    8192: 8 MiB a buffer in fp32, not 64)."""
    step = min(MAX_QUERY_ROWS, max(64, -(-T // 4)))
    return [(i0, min(T, i0 + step)) for i0 in range(0, T, step)]


def kernel_query_rows(T: int) -> int:
    """The BLAS kernel's query block (its GEMMs are calls on one pair, not NumPy's batches
    over pairs, so small blocks cost little): 32 rows up to T 1024, 64 beyond. Measured on 2
    threads, forward + backward a layer: T 1024 B 2 (6 heads) 41 ms against 49 in
    query_blocks' 256 rows; GPT 4x128 T 128 B 32, 6x384 T 256 B 4 and T 2048 alike within
    noise at 32 or 64 rows (docs/autograd.md, "Attention")."""
    return 32 if T <= 1024 else 64


def _blas_args(dtype):
    """(the BLAS GEMM's address, an integer of its width) for the kernels, None without one."""
    g = blas.find()
    if g is None or dtype not in cpu.DTYPES:
        return None
    return g.sgemm if dtype == np.float32 else g.dgemm, blas.int_type()(0)


def attention_fwd(qkv, n_head, scale, path=None, n_kv_head=None):
    """(y (B, T, C), lse (B, nh, T), None): nothing of the probabilities is kept.
    ``n_kv_head``: grouped-query attention (the BLAS kernel; elsewhere the twin)."""
    qkv = np.ascontiguousarray(qkv)
    nkv = n_kv_head or n_head
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * nkv)
    jit, sc = cpu.jit(), qkv.dtype.type(scale)
    lse = np.empty((B, n_head, T), qkv.dtype)
    fp = _blas_args(qkv.dtype)
    if fp is not None:
        y = np.empty((B, T, n_head * hs), qkv.dtype)
        jit.attention_fwd(*fp, qkv, y, lse, n_head, nkv, sc, kernel_query_rows(T))
        return y, lse, None
    if nkv != n_head:
        y, lse = flash_twin(qkv, n_head, nkv, scale)
        return y, lse, None
    y = np.empty((B, T, n_head, hs), qkv.dtype)

    def block(blk):
        b0, b1, h0, h1 = blk
        q, kt, v = _parts(qkv, n_head, b0, b1, h0, h1)
        for i0, i1 in query_blocks(T):
            s = np.matmul(q[:, :, i0:i1], kt[..., :i1])               # (nb, nh, tq, i1)
            part = np.empty(s.shape[:-1], qkv.dtype)
            rows = s.reshape(-1, i1)
            jit.softmax_causal(rows, part.reshape(-1), i1 - i0, i0, sc)
            lse[b0:b1, h0:h1, i0:i1] = part
            y[b0:b1, i0:i1, h0:h1] = np.matmul(s, v[:, :, :i1]).transpose(0, 2, 1, 3)
    for blk in blocks(B, n_head, T, qkv.itemsize):
        block(blk)
    return y.reshape(B, T, n_head * hs), lse, None


def attention_bwd(qkv, y, dy, lse, n_head, scale, att=None, n_kv_head=None):
    """dqkv (B, T, 3C) of y = attention_fwd(qkv)[0], block by block as the forward went; a
    key's gradient adds over the query blocks that see it."""
    qkv = np.ascontiguousarray(qkv)
    nkv = n_kv_head or n_head
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * nkv)
    jit, sc = cpu.jit(), qkv.dtype.type(scale)
    g = np.ascontiguousarray(dy, dtype=qkv.dtype).reshape(B, T, n_head, hs)
    dqkv = np.empty_like(qkv)
    fp = _blas_args(qkv.dtype)
    if fp is not None:
        jit.attention_bwd(*fp, qkv, g.reshape(B, T, -1), np.ascontiguousarray(lse), dqkv,
                          n_head, nkv, sc, kernel_query_rows(T))
        return dqkv
    if nkv != n_head:
        return flash_bwd_twin(qkv, y, dy, lse, n_head, nkv, scale)
    dr = dqkv.reshape(B, T, 3, n_head, hs)

    def block(blk):
        b0, b1, h0, h1 = blk
        q, kt, v = _parts(qkv, n_head, b0, b1, h0, h1)
        gb = g[b0:b1, :, h0:h1].transpose(0, 2, 1, 3)                 # (nb, nh, T, hs)
        dk, dv = np.zeros(q.shape, qkv.dtype), np.zeros(q.shape, qkv.dtype)
        for i0, i1 in query_blocks(T):
            p = np.matmul(q[:, :, i0:i1], kt[..., :i1])
            rows = p.reshape(-1, i1)
            jit.probs_from_lse(rows, np.ascontiguousarray(lse[b0:b1, h0:h1, i0:i1])
                               .reshape(-1), i1 - i0, i0, sc)
            gq = gb[:, :, i0:i1]
            dv[:, :, :i1] += np.matmul(p.swapaxes(-1, -2), gq)
            ds = np.matmul(gq, v[:, :, :i1].swapaxes(-1, -2))        # d probabilities
            jit.softmax_bwd(ds.reshape(-1, i1), rows, sc)
            dr[b0:b1, i0:i1, 0, h0:h1] = np.matmul(ds, kt[..., :i1].swapaxes(-1, -2)) \
                .transpose(0, 2, 1, 3)
            dk[:, :, :i1] += np.matmul(ds.swapaxes(-1, -2), q[:, :, i0:i1])
        dr[b0:b1, :, 1, h0:h1] = dk.transpose(0, 2, 1, 3)
        dr[b0:b1, :, 2, h0:h1] = dv.transpose(0, 2, 1, 3)
    for blk in blocks(B, n_head, T, qkv.itemsize):
        block(blk)
    return dqkv


def flash_fwd(kind: str):
    """The flash op's CPU kernel for ``kind`` (the twin's signature: (y, lse)): the kernels
    above on q, k, v rounded as the twin rounds them; grouped-query attention: the twin."""
    rounding = ROUNDING[kind]

    def run(qkv, nh, nkv, scale):
        y, lse, _ = attention_fwd(qkv if rounding is None else rounding(qkv), nh, scale,
                                  n_kv_head=nkv)
        return y, lse
    return run


def flash_bwd(kind: str):
    rounding = ROUNDING[kind]

    def run(qkv, y, dy, lse, nh, nkv, scale):
        if rounding is not None:
            qkv, dy = rounding(qkv), rounding(dy)
        return attention_bwd(qkv, y, dy, lse, nh, scale, n_kv_head=nkv)
    return run
