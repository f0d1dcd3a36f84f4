"""Causal self-attention straight from the fused q|k|v projection: one kernel each way, or on a
GPU where the scores fit, batched GEMMs around the fused causal softmax (GEMM_BYTES)."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _COMMON, _scalar
from .gemm import matmul as gemm_matmul
from .rows import (SOFTMAX_CAUSAL_BWD, SOFTMAX_CAUSAL_FWD, softmax_causal_bwd_twin,
                   softmax_causal_twin)

# ---- causal attention from the fused q|k|v projection ---------------------------------------

_ATTENTION = _COMMON + r"""
// qkv (B, T, 3C): q, k, v side by side, C = nh * hs; one block per (batch, head, query i).
// y (B, T, C) = softmax(scale q_i k_j, j <= i) v_j; lse (B, nh, T) = the softmax's log-sum-exp.
// Dynamic shared memory: T values of A (the row's scores, then probabilities).
extern "C" __global__ void attention_fwd(const T* qkv, T* y, A* lse, int B, int Tn, int nh,
                                         int hs, A scale) {
    extern __shared__ unsigned char smem[];
    A* p = (A*)smem;
    __shared__ A shared[32];
    long long row = blockIdx.x;                     // ((b * nh) + h) * T + i
    if (row >= (long long)B * nh * Tn) return;
    int i = (int)(row % Tn), h = (int)((row / Tn) % nh);
    long long b = row / ((long long)Tn * nh);
    long long C = (long long)nh * hs, C3 = 3 * C;
    const T* q = qkv + (b * Tn + i) * C3 + (long long)h * hs;
    A mx = NEG_INF;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const T* k = qkv + (b * Tn + j) * C3 + C + (long long)h * hs;
        A s = 0;
        for (int d = 0; d < hs; d++) s += (A)q[d] * (A)k[d];
        s *= scale;
        p[j] = s;
        mx = max(mx, s);
    }
    mx = block_max(mx, shared);
    A sum = 0;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) { A e = exp(p[j] - mx); p[j] = e; sum += e; }
    sum = block_sum(sum, shared);                   // (its barrier also publishes p)
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        A acc = 0;
        for (int j = 0; j <= i; j++) acc += p[j] * (A)qkv[(b * Tn + j) * C3 + 2 * C + (long long)h * hs + d];
        y[(b * Tn + i) * C + (long long)h * hs + d] = (T)(acc / sum);
    }
    if (threadIdx.x == 0) lse[row] = mx + log(sum);
}
// The gradient dqkv (zeroed by the caller): per query i, D = dy_i . y_i;
// p_j = exp(scale q_i k_j - lse_i), ds_j = p_j (dy_i . v_j - D);
// dq_i = scale sum_j ds_j k_j; dk_j += scale ds_j q_i; dv_j += p_j dy_i (atomic over i).
extern "C" __global__ void attention_bwd(const T* qkv, const T* y, const T* dy, const A* lse,
                                         T* dqkv, int B, int Tn, int nh, int hs, A scale) {
    extern __shared__ unsigned char smem[];
    A* ds = (A*)smem;
    __shared__ A shared[32];
    long long row = blockIdx.x;
    if (row >= (long long)B * nh * Tn) return;
    int i = (int)(row % Tn), h = (int)((row / Tn) % nh);
    long long b = row / ((long long)Tn * nh);
    long long C = (long long)nh * hs, C3 = 3 * C;
    long long qo = (b * Tn + i) * C3 + (long long)h * hs, yo = (b * Tn + i) * C + (long long)h * hs;
    A D = 0;
    for (int d = threadIdx.x; d < hs; d += blockDim.x) D += (A)dy[yo + d] * (A)y[yo + d];
    D = block_sum(D, shared);
    A l = lse[row];
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        long long ko = (b * Tn + j) * C3 + C + (long long)h * hs, vo = ko + C;
        A s = 0, dp = 0;
        for (int d = 0; d < hs; d++) { s += (A)qkv[qo + d] * (A)qkv[ko + d]; dp += (A)dy[yo + d] * (A)qkv[vo + d]; }
        A pj = exp(s * scale - l);
        A dsj = pj * (dp - D);
        ds[j] = dsj;
        for (int d = 0; d < hs; d++) {
            atomicAdd(dqkv + ko + d, (T)(scale * dsj * (A)qkv[qo + d]));
            atomicAdd(dqkv + vo + d, (T)(pj * (A)dy[yo + d]));
        }
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        A acc = 0;
        for (int j = 0; j <= i; j++) acc += ds[j] * (A)qkv[(b * Tn + j) * C3 + C + (long long)h * hs + d];
        dqkv[qo + d] = (T)(scale * acc);
    }
}
"""


def _qkv_heads(qkv, n_head):
    """q (B, nh, T, hs), k (B, nh, hs, T), v (B, nh, T, hs): views of qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    r = qkv.reshape(B, T, 3, n_head, hs)
    return (r[:, :, 0].transpose(0, 2, 1, 3), r[:, :, 1].transpose(0, 2, 3, 1),
            r[:, :, 2].transpose(0, 2, 1, 3))


def attention_twin(qkv, n_head, scale, path=None):
    """(y (B, T, C), lse (B, nh, T), the probabilities (B, nh, T, T) for the backward).
    ``path`` names the launcher's way (the twin has one)."""
    return _attention(qkv, n_head, scale, softmax_causal_twin, backend.matmul)


def _attention(qkv, n_head, scale, softmax, mm, with_lse=True):
    """The twin's formulation with its softmax and GEMMs given: the twin's own, or the fused
    softmax and the run's GEMMs (the GPU's GEMM path, which keeps the probabilities and so
    skips lse: five elementwise passes over the scores, 4.3 ms of an 86 ms H200 step)."""
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    s = mm(q, k)
    att = softmax(s, scale)
    B, nh, T, hs = q.shape
    y = mm(att, v).transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
    if not with_lse:
        return xp.ascontiguousarray(y), None, att
    z = xp.where(att > 0, s * scale, xp.asarray(-np.inf, dtype=s.dtype))
    zmax = z.max(axis=-1)
    lse = zmax + xp.log(xp.exp(z - zmax[..., None]).sum(axis=-1))
    return xp.ascontiguousarray(y), lse, att


def attention_bwd_twin(qkv, y, dy, lse, n_head, scale, att=None):
    """dqkv (B, T, 3C) of y = attention_twin(qkv)[0]."""
    return _attention_bwd(qkv, dy, lse, n_head, scale, att, softmax_causal_bwd_twin,
                          backend.matmul)


def _attention_bwd(qkv, dy, lse, n_head, scale, att, softmax_bwd, mm):
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    B, nh, T, hs = q.shape
    if att is None:
        att = xp.exp(mm(q, k) * scale - lse[..., None])
        att = xp.where(xp.arange(T)[None, :] > xp.arange(T)[:, None], 0, att)
    g = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)            # (B, nh, T, hs)
    dv = mm(xp.swapaxes(att, -1, -2), g)                          # (B, nh, T, hs)
    datt = mm(g, xp.swapaxes(v, -1, -2))                          # (B, nh, T, T)
    ds = softmax_bwd(datt, att, scale)
    dq = mm(ds, xp.swapaxes(k, -1, -2))                           # (B, nh, T, hs)
    dk = mm(xp.swapaxes(ds, -1, -2), q)                           # (B, nh, T, hs)
    out = xp.empty(qkv.shape, dtype=qkv.dtype)
    r = out.reshape(B, T, 3, nh, hs)
    for part, grad in enumerate((dq, dk, dv)):
        r[:, :, part] = grad.transpose(0, 2, 1, 3)
    return out


# On a GPU, attention whose scores fit GEMM_BYTES per call runs as batched GEMMs (cuBLAS)
# around the fused causal softmax, keeping the probabilities for the backward (PyTorch eager's
# way); larger ones run the one-kernel-each-way row kernels above, which keep only lse. The
# row kernels read q and k once per query and add dk, dv with atomics: on an H200 at GPT
# 12x768, T 256, batch 16 the backward took 12 ms a layer, the GEMM path well under one.
GEMM_BYTES = 256 << 20


def _gemm_path(qkv, n_head, path) -> bool:
    if path is not None:
        return path == "gemms"
    B, T = qkv.shape[:2]
    return B * n_head * T * T * qkv.dtype.itemsize <= GEMM_BYTES


def _attention_launch(k, qkv, n_head, scale, path=None):
    xp = backend.xp()
    qkv = xp.ascontiguousarray(qkv)
    if _gemm_path(qkv, n_head, path):
        return _attention(qkv, n_head, scale, SOFTMAX_CAUSAL_FWD, gemm_matmul, with_lse=False)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    acc = np.float64 if qkv.dtype == np.float64 else np.float32
    y = xp.empty((B, T, C3 // 3), dtype=qkv.dtype)
    lse = xp.empty((B, n_head, T), dtype=acc)
    k("attention_fwd")((max(B * n_head * T, 1),), (128,),
                       (qkv, y, lse, np.int32(B), np.int32(T), np.int32(n_head), np.int32(hs),
                        _scalar(acc, scale)), shared_mem=T * np.dtype(acc).itemsize)
    return y, lse.astype(qkv.dtype, copy=False), None


def _attention_bwd_launch(k, qkv, y, dy, lse, n_head, scale, att=None):
    xp = backend.xp()
    qkv = xp.ascontiguousarray(qkv)
    if att is not None:                     # the forward took the GEMM path
        return _attention_bwd(qkv, dy, lse, n_head, scale, att, SOFTMAX_CAUSAL_BWD,
                              gemm_matmul)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    acc = np.float64 if qkv.dtype == np.float64 else np.float32
    dqkv = xp.zeros_like(qkv)
    k("attention_bwd")((max(B * n_head * T, 1),), (128,),
                       (qkv, xp.ascontiguousarray(y), xp.ascontiguousarray(dy),
                        xp.ascontiguousarray(lse, dtype=acc), dqkv, np.int32(B), np.int32(T),
                        np.int32(n_head), np.int32(hs), _scalar(acc, scale)),
                       shared_mem=T * np.dtype(acc).itemsize)
    return dqkv


def _attention_cases(xp, rng, dt, backward=False):
    """Each shape on both paths: the row kernels, and GEMMs around the fused softmax."""
    for B, T, nh, hs in ((1, 1, 1, 1), (2, 5, 3, 4), (1, 17, 2, 64), (2, 64, 4, 16)):
        qkv = xp.asarray(rng.standard_normal((B, T, 3 * nh * hs)).astype(dt))
        scale = 1.0 / math.sqrt(hs)
        if not backward:
            yield qkv, nh, scale, "kernels"
            yield qkv, nh, scale, "gemms"
        else:
            y, lse, att = attention_twin(qkv, nh, scale)
            dy = xp.asarray(rng.standard_normal(y.shape).astype(dt))
            yield qkv, y, dy, lse, nh, scale
            yield qkv, y, dy, lse, nh, scale, att


ATTENTION_FWD = Fused("attention_fwd", _ATTENTION, ["attention_fwd"], _attention_launch,
                      attention_twin, lambda xp, rng, dt: _attention_cases(xp, rng, dt),
                      compare=2, may_skip=lambda args: args[-1] == "gemms")
ATTENTION_BWD = Fused("attention_bwd", _ATTENTION, ["attention_bwd"], _attention_bwd_launch,
                      attention_bwd_twin,
                      lambda xp, rng, dt: _attention_cases(xp, rng, dt, True), tolerance=1e-4)
