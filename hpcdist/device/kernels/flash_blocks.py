"""Flash attention of one block of queries over one block of keys, each at its global positions
(a context-parallel rank's chunk against another's): the kernels of flash_source.py on q, k, v
held apart, the mask by position (a key at or before its query: all of a block, part of it,
or none), returning the log-sum-exp a ring step merges by; the backward takes the merged
log-sum-exp and D = rowsum(dy * y) of the whole row (no flash_dot). Twins in xp; one Fused op
a direction and kind of arithmetic, like flash.py's."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused
from .flash import (ROUNDING, SHAPES, TOLERANCE, _compute_dtype, _get, _ints, _mm,
                    _pack, _rows_per_block, _storage)
from .common import address
from .flash_source import FLASH_SOURCE


def _heads(a, H: int):
    """(B, T, H hd) -> (B, H, T, hd)."""
    B, T, W = a.shape
    return a.reshape(B, T, H, W // H).transpose(0, 2, 1, 3)


def block_twin(q, k, v, nh, nkv, scale, q_pos, k_pos, rounding=None, cap=0.0):
    """(y (B, Tq, nh hd), lse (B, nh, Tq)): q's rows (positions q_pos + i) over k, v's
    (k_pos + j), a key seen at or before its query; a row that sees none: y 0, lse -inf.
    Rows a chunk at a time, so the scores stay under flash.py's 64 MiB (a ring's blocks at
    long context). ``cap``: the scaled scores soft-capped (forward only: the KV cache's)."""
    xp = backend.array_module(q)
    parts = [_block(q[:, i0:i1], k, v, nh, nkv, scale, q_pos + i0, k_pos, rounding, cap)
             for i0, i1 in _chunks(q.shape[0], nh, q.shape[1], k.shape[1])]
    if len(parts) == 1:
        return parts[0]
    return (xp.concatenate([y for y, _ in parts], axis=1),
            xp.concatenate([lse for _, lse in parts], axis=2))


def _chunks(B, nh, Tq, Tk):
    step = _rows_per_block(B, nh, Tk)
    return [(i0, min(Tq, i0 + step)) for i0 in range(0, Tq, step)] or [(0, 0)]


def _block(q, k, v, nh, nkv, scale, q_pos, k_pos, rounding, cap=0.0):
    xp = backend.array_module(q)
    ct = _compute_dtype(q.dtype)
    q, k, v = (a.astype(ct) for a in (q, k, v))
    if rounding is not None:
        q, k, v = rounding(q), rounding(k), rounding(v)
    B, Tq = q.shape[:2]
    G = nh // nkv
    qh = _heads(q, nh).reshape(B, nkv, G, Tq, -1)
    kh, vh = _heads(k, nkv)[:, :, None], _heads(v, nkv)[:, :, None]
    s = _mm(qh, xp.swapaxes(kh, -1, -2)) * ct(scale)                   # (B, nkv, G, Tq, Tk)
    if cap:
        s = xp.tanh(s / ct(cap)) * ct(cap)
    seen = (k_pos + xp.arange(k.shape[1]))[None, :] <= (q_pos + xp.arange(Tq))[:, None]
    s = xp.where(seen, s, ct(-np.inf))
    m = s.max(axis=-1)
    base = xp.where(m == -np.inf, ct(0), m)
    p = xp.exp(s - base[..., None])
    total = p.sum(axis=-1)
    y = _mm(p, vh) / xp.where(total > 0, total, ct(1))[..., None]
    lse = xp.where(total > 0, base + xp.log(xp.where(total > 0, total, ct(1))), ct(-np.inf))
    y = y.reshape(B, nh, Tq, -1).transpose(0, 2, 1, 3).reshape(B, Tq, -1)
    return y.astype(q.dtype), lse.reshape(B, nh, Tq)


def block_bwd_twin(q, k, v, dy, lse, dvec, nh, nkv, scale, q_pos, k_pos, rounding=None):
    """(dq, dk, dv) of this block's part of the gradient, ``lse`` and ``dvec`` (B, nh, Tq) the
    whole row's (merged over every block it saw); rows a chunk at a time, as the forward."""
    xp = backend.array_module(q)
    dq, dk, dv = [], 0, 0
    for i0, i1 in _chunks(q.shape[0], nh, q.shape[1], k.shape[1]):
        gq, gk, gv = _block_bwd(q[:, i0:i1], k, v, dy[:, i0:i1], lse[:, :, i0:i1],
                                dvec[:, :, i0:i1], nh, nkv, scale, q_pos + i0, k_pos, rounding)
        dq.append(gq)
        dk, dv = dk + gk, dv + gv
    return (dq[0] if len(dq) == 1 else xp.concatenate(dq, axis=1)), dk, dv


def _block_bwd(q, k, v, dy, lse, dvec, nh, nkv, scale, q_pos, k_pos, rounding):
    xp = backend.array_module(q)
    ct = _compute_dtype(q.dtype)
    q, k, v, g = (a.astype(ct) for a in (q, k, v, dy))
    if rounding is not None:
        q, k, v, g = rounding(q), rounding(k), rounding(v), rounding(g)
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    G = nh // nkv
    qh = _heads(q, nh).reshape(B, nkv, G, Tq, -1)
    gh = _heads(g, nh).reshape(B, nkv, G, Tq, -1)
    kh, vh = _heads(k, nkv)[:, :, None], _heads(v, nkv)[:, :, None]
    lg = lse.astype(ct).reshape(B, nkv, G, Tq)[..., None]
    seen = (k_pos + xp.arange(Tk))[None, :] <= (q_pos + xp.arange(Tq))[:, None]
    s = _mm(qh, xp.swapaxes(kh, -1, -2)) * ct(scale)
    p = xp.where(seen, xp.exp(xp.where(seen, s - lg, ct(0))), ct(0))
    ds = p * (_mm(gh, xp.swapaxes(vh, -1, -2)) - dvec.astype(ct).reshape(B, nkv, G, Tq)[..., None])
    dq = _mm(ds, kh) * ct(scale)
    dk = _mm(xp.swapaxes(ds, -1, -2), qh).sum(axis=2) * ct(scale)
    dv = _mm(xp.swapaxes(p, -1, -2), gh).sum(axis=2)
    tok = lambda a, T: a.reshape(B, -1, T, a.shape[-1]).transpose(0, 2, 1, 3).reshape(B, T, -1)  # noqa: E731
    return tok(dq, Tq), tok(dk, Tk), tok(dv, Tk)


def _common(kind, q, k, v, nh, nkv, scale, q_pos, k_pos):
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    hs = q.shape[-1] // nh
    vec = 16 // _storage(kind, q.dtype).itemsize
    aligned = hs % vec == 0 and all(address(a) % 16 == 0 for a in (q, k, v))
    acc = _compute_dtype(q.dtype)
    return (*_ints(Tq, Tk, nh, nkv, hs), np.int64(nh * hs), np.int64(nkv * hs),
            np.int64(nkv * hs), *_ints(0, 0, 0, q_pos, k_pos, 1), np.int32(aligned),
            acc(scale)), B, Tq, Tk, hs, acc


def _fwd_launch(kind):
    def launch(k_, q, k, v, nh, nkv, scale, q_pos, k_pos):
        xp = backend.xp()
        q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
        hs = q.shape[-1] // nh
        q, k, v = (_pack(k_, kind, hs, a) for a in (q, k, v))
        args, B, Tq, Tk, hs, acc = _common(kind, q, k, v, nh, nkv, scale, q_pos, k_pos)
        dtype = acc if kind != "exact" else q.dtype
        y = xp.zeros((B, Tq, nh * hs), dtype=dtype)
        lse = xp.full((B, nh, Tq), -np.inf, dtype=acc)
        if B and Tq and Tk:
            fn, shm = _get(k_, "flash_fwd", kind, hs, np.dtype(acc).itemsize)
            warps = SHAPES[kind][0]
            fn((-(-Tq // (16 * warps)), nh, B), (32 * warps,), (q, k, v, y, lse, *args),
               shared_mem=shm)
        return y, lse
    return launch


def _bwd_launch(kind):
    def launch(k_, q, k, v, dy, lse, dvec, nh, nkv, scale, q_pos, k_pos):
        xp = backend.xp()
        acc = _compute_dtype(q.dtype)
        q, k, v, dy = (xp.ascontiguousarray(a) for a in (q, k, v, dy))
        hs = q.shape[-1] // nh
        dtype = q.dtype
        q, k, v, dy = (_pack(k_, kind, hs, a) for a in (q, k, v, dy))
        args, B, Tq, Tk, hs, _ = _common(kind, q, k, v, nh, nkv, scale, q_pos, k_pos)
        dq = xp.zeros((B, Tq, nh * hs), dtype=dtype)
        dk, dv = (xp.zeros((B, Tk, nkv * hs), dtype=dtype) for _ in range(2))
        if B and Tq and Tk:
            lse, dvec = (xp.ascontiguousarray(a, dtype=acc) for a in (lse, dvec))
            warps = SHAPES[kind][0]
            item = np.dtype(acc).itemsize
            fn, shm = _get(k_, "flash_bwd_kv", kind, hs, item)
            fn((-(-Tk // (16 * warps)), nkv, B), (32 * warps,),
               (q, k, v, dy, lse, dvec, dk, dv, *args), shared_mem=shm)
            fn, shm = _get(k_, "flash_bwd_q", kind, hs, item)
            fn((-(-Tq // (16 * warps)), nh, B), (32 * warps,),
               (q, k, v, dy, lse, dvec, dq, *args), shared_mem=shm)
        return dq, dk, dv
    return launch


# (B, Tq, Tk, nh, nkv, hs, q_pos, k_pos): keys wholly before the queries, the diagonal, a
# block partly seen, one seen by nothing, GQA and MQA
CASES = ((1, 5, 7, 2, 2, 8, 10, 0), (2, 16, 16, 4, 2, 16, 32, 32), (1, 33, 40, 3, 1, 64, 20, 0),
         (2, 9, 12, 2, 1, 24, 0, 30), (1, 70, 70, 2, 2, 128, 5, 0))


def _cases(xp, rng, dt, backward=False, rounding=None):
    for B, Tq, Tk, nh, nkv, hs, qp, kp in CASES:
        q = xp.asarray(rng.standard_normal((B, Tq, nh * hs)).astype(dt))
        k, v = (xp.asarray(rng.standard_normal((B, Tk, nkv * hs)).astype(dt)) for _ in range(2))
        scale = 1.0 / math.sqrt(hs)
        if not backward:
            yield q, k, v, nh, nkv, scale, qp, kp
            continue
        y, lse = block_twin(q, k, v, nh, nkv, scale, qp, kp, rounding)
        dy = xp.asarray(rng.standard_normal(y.shape).astype(dt))
        dvec = (dy.reshape(B, Tq, nh, hs) * y.reshape(B, Tq, nh, hs)).sum(axis=-1)
        yield q, k, v, dy, lse, dvec.transpose(0, 2, 1), nh, nkv, scale, qp, kp


FLASH_BLOCK_FWD, FLASH_BLOCK_BWD = {}, {}
for _kind in ("exact", "bf16", "tf32"):
    _r = ROUNDING[_kind]
    _suffix = "" if _kind == "exact" else "_" + _kind
    _dtypes = ("float32", "float64") if _kind == "exact" else ("float32",)
    _packs = _kind == "bf16"
    _ctypes = (lambda dtype, defines, kind=_kind: {"S": _storage(kind, dtype)})
    FLASH_BLOCK_FWD[_kind] = Fused(
        "flash_block_fwd" + _suffix, FLASH_SOURCE, ["flash_pack", "flash_fwd"][not _packs:],
        _fwd_launch(_kind), lambda *a, r=_r: block_twin(*a, rounding=r),
        lambda xp, rng, dt: _cases(xp, rng, dt), launches=1 + 3 * _packs,
        tolerance=TOLERANCE[_kind][0], dtypes=_dtypes, ctypes=_ctypes)
    FLASH_BLOCK_BWD[_kind] = Fused(
        "flash_block_bwd" + _suffix, FLASH_SOURCE,
        ["flash_pack", "flash_bwd_kv", "flash_bwd_q"][not _packs:], _bwd_launch(_kind),
        lambda *a, r=_r: block_bwd_twin(*a, rounding=r),
        lambda xp, rng, dt, r=_r: _cases(xp, rng, dt, True, r), launches=2 + 4 * _packs,
        tolerance=TOLERANCE[_kind][1], dtypes=_dtypes, ctypes=_ctypes)
