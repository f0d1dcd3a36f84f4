"""Ring attention on the flash kernels: each ring step scores this rank's chunks of queries
against the block in hand's chunks of keys (device/kernels/flash_blocks.py: a pair of
contiguous runs of positions, masked by position, skipped where every key is after every
query) and merges the partial rows by their log-sum-exp; the backward runs the kernels'
backward on each pair with the merged log-sum-exp and D = rowsum(dy * y). Queries, keys and
values stay in token layout, only the kv heads travel. No dropout here (ring_attention.py
draws it, in NumPy)."""
from __future__ import annotations

import numpy as np

from ..device import backend, kernels
from ..autograd.tensor import Tensor
from .ring import rotate_backward, rotate_forward


def _runs(pos) -> list:
    """[(first local row, last + 1, its global position)] of the contiguous runs of ``pos``."""
    pos = np.asarray(pos)
    cuts = [0] + [int(c) + 1 for c in np.flatnonzero(np.diff(pos) != 1)] + [len(pos)]
    return [(a, b, int(pos[a])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _pairs(cp, src):
    """(query run, key run) pairs where some key is at or before some query."""
    for q0, q1, qp in _runs(cp.positions()):
        for k0, k1, kp in _runs(cp.positions(src)):
            if kp <= qp + (q1 - q0) - 1:
                yield (q0, q1, qp), (k0, k1, kp)


def _merge(out, lse, q0: int, q1: int, y, l, *, nh: int) -> None:
    """Rows q0:q1 of (out, lse) and a block's (y, l), merged by log-sum-exp, in place (a row
    that has seen nothing yet keeps y 0 and lse -inf)."""
    xp = backend.array_module(out)
    la = lse[:, :, q0:q1]
    m = xp.maximum(la, l)
    base = xp.where(m == -np.inf, 0.0, m)
    ea, eb = xp.exp(la - base), xp.exp(l - base)
    tot = ea + eb
    safe = xp.where(tot > 0, tot, 1.0)
    wa, wb = (xp.where(tot > 0, e / safe, 0.0).transpose(0, 2, 1)[..., None] for e in (ea, eb))
    B, r, W = y.shape
    merged = out[:, q0:q1].reshape(B, r, nh, W // nh) * wa + y.reshape(B, r, nh, W // nh) * wb
    out[:, q0:q1] = merged.reshape(B, r, W)
    lse[:, :, q0:q1] = xp.where(tot > 0, base + xp.log(safe), -np.inf)


def ring_flash(cp, qkv: Tensor, shape) -> Tensor:
    """(B, T_r, shape.width) of this rank's tokens -> (B, T_r, shape.out_width)."""
    xp = backend.array_module(qkv.data)
    kind = kernels.attention.kind(qkv.dtype)
    fwd, bwd = kernels.FLASH_BLOCK_FWD[kind], kernels.FLASH_BLOCK_BWD[kind]
    nh, nkv, hd = shape.n_head, shape.n_kv_head, shape.head_dim
    ct = np.float64 if qkv.dtype == np.float64 else np.float32
    q, k, v = (xp.ascontiguousarray(a.reshape(a.shape[:2] + (-1,)).astype(ct))
               for a in shape.views(qkv.data))
    scale = 1.0 / np.sqrt(hd)
    B, Tl = q.shape[:2]
    out = xp.zeros((B, Tl, nh * hd), dtype=ct)
    lse = xp.full((B, nh, Tl), -np.inf, dtype=ct)

    def forward(kb, vb, src):
        for (q0, q1, qp), (k0, k1, kp) in _pairs(cp, src):
            y, l = fwd(q[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1], nh, nkv, scale, qp, kp)
            _merge(out, lse, q0, q1, y.astype(ct), l.astype(ct), nh=nh)
    rotate_forward(cp, xp.stack([k, v]), forward)

    def backward(g):
        g = g.astype(ct)
        D = (g.reshape(B, Tl, nh, hd) * out.reshape(B, Tl, nh, hd)).sum(axis=-1)
        D = xp.ascontiguousarray(D.transpose(0, 2, 1))                # (B, nh, T_r)
        dq = xp.zeros_like(q)

        def step(kb, vb, src):
            part = xp.zeros((2,) + tuple(kb.shape), dtype=ct)
            for (q0, q1, qp), (k0, k1, kp) in _pairs(cp, src):
                gq, gk, gv = bwd(q[:, q0:q1], kb[:, k0:k1], vb[:, k0:k1], g[:, q0:q1],
                                 lse[:, :, q0:q1], D[:, :, q0:q1], nh, nkv, scale, qp, kp)
                dq[:, q0:q1] += gq
                part[0][:, k0:k1] += gk
                part[1][:, k0:k1] += gv
            return part
        dkv = rotate_backward(cp, xp.stack([k, v]), step)
        return (xp.concatenate([dq, dkv[0], dkv[1]], axis=-1).astype(qkv.dtype),)
    return Tensor._make(out.astype(qkv.dtype), (qkv,), backward)
