"""Tiled (flash) attention from the fused projection: forward and backward in O(T) memory at any
context length, on every device. The twin is the definition, a block of queries at a time (no
T x T array of the whole sequence); the GPU runs FlashAttention-2's kernels (flash_source.py),
compiled per head size, in one of three kinds of arithmetic: ``exact`` (FMA in the arrays' own
float or double), ``bf16`` (tensor cores, fp32 accumulation: q, k, v, dy and the
probabilities rounded as they enter a product, as autocast's SDPA does) or ``tf32``. Each kind
is a ``Fused`` op checked against its twin on first use (the tensor-core twins round q, k, v
and dy as the kernels load them; the tolerance is the probabilities' rounding). Grouped-query
attention: qkv is (B, T, (nh + 2 nkv) hs), q heads then k then v; query head h reads kv head
h // (nh // nkv), never a repeated copy."""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..fused import Fused
from .common import SHARED_DEFAULT, address   # past SHARED_DEFAULT a kernel asks (Hopper: 227 KiB)
from .flash_source import FLASH_SOURCE

# Tile shapes per kind: (warps, CT) — a block owns 16 x warps rows and steps over CT columns;
# the exact kinds take half the rows so that fp64 at head size 128 fits shared memory.
SHAPES = {"bf16": (4, 64), "tf32": (4, 64), "exact": (2, 32)}
MMA = {"exact": 0, "bf16": 1, "tf32": 2}
MAX_HEAD = 256


def head_pad(hs: int) -> int:
    """The head size rounded up to the tensor cores' k step (16)."""
    return max(16, -(-hs // 16) * 16)


def _split(qkv, nh: int, nkv: int):
    """Views q (B, T, nh, hs), k and v (B, T, nkv, hs) of qkv (B, T, (nh + 2 nkv) hs)."""
    B, T, W = qkv.shape
    hs = W // (nh + 2 * nkv)
    return (qkv[..., :nh * hs].reshape(B, T, nh, hs),
            qkv[..., nh * hs:(nh + nkv) * hs].reshape(B, T, nkv, hs),
            qkv[..., (nh + nkv) * hs:].reshape(B, T, nkv, hs))


def head_size(qkv_width: int, nh: int, nkv: int) -> int:
    hs, rest = divmod(qkv_width, nh + 2 * nkv)
    if rest or nh % nkv:
        raise ValueError(f"a fused projection of width {qkv_width} does not hold {nh} query "
                         f"heads and 2 x {nkv} kv heads of one size (n_head % n_kv_head == 0)")
    return hs


def _rows_per_block(B, nh, T, itemsize=8) -> int:
    """Queries per block of the twin: its scores (B, nh, rows, T) stay under 64 MiB."""
    return max(1, min(T, (64 << 20) // max(1, B * nh * T * itemsize)))


def _mm(a, b):
    """A product in the arrays' own precision: the twins round their inputs themselves (no
    bf16 emulation on top; backend.matmul would round the probabilities too)."""
    return a @ b


def _compute_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def key_range(i0: int, i1: int, window: int) -> int:
    """The first key a block of queries i0..i1 can see: 0, or under a window (a query sees
    itself and window - 1 keys before it) i0 - window + 1; the tiles before it are skipped."""
    return max(0, i0 - window + 1) if window else 0


def _block_rows(B, nh, T, window) -> int:
    """Queries per block of the twin: the scores under 64 MiB; under a window at most the
    window's width (at least 64), so that a block's keys are the window, not the sequence."""
    step = _rows_per_block(B, nh, T)
    return min(step, max(64, window)) if window else step


def _scores(xp, qb, kb, scale, cap, i0, i1, lo, window, ct):
    """A block's scores (rows i0..i1 over keys lo..i1), scaled, capped (cap tanh(s / cap)
    where ``cap``), masked to -inf outside causality and the window; and tanh's value (for
    the backward through the cap; None without one)."""
    s = _mm(qb, kb) * ct(scale)
    t = None
    if cap:
        t = xp.tanh(s / ct(cap))
        s = t * ct(cap)
    j, i = xp.arange(lo, i1)[None, :], xp.arange(i0, i1)[:, None]
    seen = (j <= i) & (j > i - window) if window else j <= i
    return xp.where(seen, s, ct(-np.inf)), seen, t


def flash_twin(qkv, nh, nkv, scale, rounding=None, cap=0.0, window=0):
    """(y (B, T, nh hs), lse (B, nh, T)): causal softmax(scale q k^T) v, a block of queries at a
    time. ``rounding``: applied to q, k, v first (the tensor-core kinds' inputs). The
    attention kinds (attention_kinds.Scores): ``cap`` soft-caps the scaled scores (Gemma 2's
    cap tanh(s / cap)); ``window`` > 0: a query sees itself and window - 1 keys before it,
    and a block reads only the keys its rows can see."""
    xp = backend.array_module(qkv)
    ct = _compute_dtype(qkv.dtype)
    q, k, v = (a.astype(ct) for a in _split(qkv, nh, nkv))
    if rounding is not None:
        q, k, v = rounding(q), rounding(k), rounding(v)
    B, T, _, hs = q.shape
    G = nh // nkv
    qg = q.reshape(B, T, nkv, G, hs).transpose(0, 2, 3, 1, 4)       # (B, nkv, G, T, hs)
    kt = k.transpose(0, 2, 3, 1)[:, :, None]                          # (B, nkv, 1, hs, T)
    vt = v.transpose(0, 2, 1, 3)[:, :, None]                          # (B, nkv, 1, T, hs)
    y = xp.empty((B, nkv, G, T, hs), ct)
    lse = xp.empty((B, nkv, G, T), ct)
    step = _block_rows(B, nh, T, window)
    for i0 in range(0, T, step):
        i1 = min(T, i0 + step)
        lo = key_range(i0, i1, window)
        s, _, _ = _scores(xp, qg[..., i0:i1, :], kt[..., lo:i1], scale, cap, i0, i1, lo,
                          window, ct)                              # (B, nkv, G, rows, keys)
        m = s.max(axis=-1)
        p = xp.exp(s - m[..., None])
        total = p.sum(axis=-1)
        y[..., i0:i1, :] = _mm(p, vt[..., lo:i1, :]) / total[..., None]
        lse[..., i0:i1] = m + xp.log(total)
    y = y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
    return y.astype(qkv.dtype), lse.reshape(B, nh, T)


def flash_bwd_twin(qkv, y, dy, lse, nh, nkv, scale, rounding=None, cap=0.0, window=0):
    """dqkv (B, T, (nh + 2 nkv) hs) of y = flash_twin(qkv)[0]: per block of queries, p from
    lse, dz = p (dy v^T - rowsum(dy y)), through the cap ds = dz (1 - tanh^2); dq = scale ds
    k, dk += scale ds^T q, dv += p^T dy. ``lse`` may hold more than these scores (a sink's
    term: attention_kinds.with_sinks): p and D are then the whole softmax's, as they must be."""
    xp = backend.array_module(qkv)
    ct = _compute_dtype(qkv.dtype)
    q, k, v = (a.astype(ct) for a in _split(qkv, nh, nkv))
    B, T, _, hs = q.shape
    G = nh // nkv
    g = dy.astype(ct).reshape(B, T, nh, hs)
    D = (g * y.astype(ct).reshape(B, T, nh, hs)).sum(axis=-1)          # (B, T, nh)
    if rounding is not None:
        q, k, v, g = rounding(q), rounding(k), rounding(v), rounding(g)
    qg = q.reshape(B, T, nkv, G, hs).transpose(0, 2, 3, 1, 4)          # (B, nkv, G, T, hs)
    gg = g.reshape(B, T, nkv, G, hs).transpose(0, 2, 3, 1, 4)
    Dg = D.reshape(B, T, nkv, G).transpose(0, 2, 3, 1)                  # (B, nkv, G, T)
    lg = lse.astype(ct).reshape(B, nkv, G, T)
    kk = k.transpose(0, 2, 1, 3)[:, :, None]                            # (B, nkv, 1, T, hs)
    vv = v.transpose(0, 2, 1, 3)[:, :, None]
    dq = xp.empty((B, nkv, G, T, hs), ct)
    dk = xp.zeros((B, nkv, T, hs), ct)
    dv = xp.zeros((B, nkv, T, hs), ct)
    step = _block_rows(B, nh, T, window)
    for i0 in range(0, T, step):
        i1 = min(T, i0 + step)
        lo = key_range(i0, i1, window)
        s, seen, t = _scores(xp, qg[..., i0:i1, :], xp.swapaxes(kk[..., lo:i1, :], -1, -2),
                             scale, cap, i0, i1, lo, window, ct)
        p = xp.where(seen, xp.exp(s - lg[..., i0:i1, None]), ct(0))   # (B, nkv, G, rows, keys)
        dp = _mm(gg[..., i0:i1, :], xp.swapaxes(vv[..., lo:i1, :], -1, -2))
        ds = p * (dp - Dg[..., i0:i1, None])
        if t is not None:
            ds = ds * (ct(1) - t * t)
        dq[..., i0:i1, :] = _mm(ds, kk[..., lo:i1, :]) * ct(scale)
        dk[..., lo:i1, :] += _mm(xp.swapaxes(ds, -1, -2), qg[..., i0:i1, :]).sum(axis=2) \
            * ct(scale)
        dv[..., lo:i1, :] += _mm(xp.swapaxes(p, -1, -2), gg[..., i0:i1, :]).sum(axis=2)
    out = xp.empty(qkv.shape, dtype=qkv.dtype)
    oq, ok, ov = _split(out, nh, nkv)
    oq[...] = dq.reshape(B, nh, T, hs).transpose(0, 2, 1, 3)
    ok[...] = dk.transpose(0, 2, 1, 3)
    ov[...] = dv.transpose(0, 2, 1, 3)
    return out


def _round_tf32(x):
    """fp32 -> TF32 as cvt.rna: to nearest, ties away from zero, 10 bits of mantissa."""
    xp = backend.array_module(x)
    bits = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    bits = xp.where(finite, bits + np.uint32(0x1000), bits) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


ROUNDING = {"exact": None, "bf16": backend.round_to_bf16, "tf32": _round_tf32}


# ---- the launchers ---------------------------------------------------------------------------

PAD = {"bf16": 8, "tf32": 4}


def _defines(kind: str, hs: int) -> dict:
    warps, ct = SHAPES[kind]
    return {"D_PAD": head_pad(hs), "MMA": MMA[kind], "WARPS": warps, "CT": ct}


def _storage(kind: str, dtype) -> np.dtype:
    """What the kernels read q, k, v, dy as (the source's S): bf16 words, or the dtype."""
    return np.dtype(np.uint16) if kind == "bf16" else np.dtype(dtype)


def shared_bytes(kernel: str, kind: str, hs: int, itemsize: int) -> int:
    """Dynamic shared memory of one block of ``kernel`` (the source's layout)."""
    warps, ct = SHAPES[kind]
    rt, s = 16 * warps, _storage(kind, np.float64 if itemsize == 8 else np.float32).itemsize
    pad = PAD.get(kind, 16 // itemsize)
    d, ld = head_pad(hs), head_pad(hs) + pad
    trans = d * (ct + pad) if kind == "bf16" else 0           # one [D_PAD][CT + PAD] tile
    scratch = 0 if kind == "bf16" else warps * 16 * (ct + pad)
    acc = 8 if itemsize == 8 else 4
    if kernel == "flash_fwd":
        return s * ((rt + 2 * ct) * ld + trans + scratch)
    if kernel in ("flash_bwd_kv", "flash_bwd_kvq"):        # (kvq: the larger of its two)
        return 2 * ct * acc + s * ((2 * rt + 2 * ct) * ld + 2 * trans + scratch)
    return s * ((2 * rt + 2 * ct) * ld + trans + scratch)            # flash_bwd_q


def _get(k, kernel, kind, hs, itemsize):
    fn = k(kernel, _defines(kind, hs))
    need = shared_bytes(kernel, kind, hs, itemsize)
    if need > SHARED_DEFAULT and getattr(fn, "max_dynamic_shared_size_bytes", need) < need:
        fn.max_dynamic_shared_size_bytes = need
    return fn, need


def _ints(*values):
    return tuple(np.int32(v) for v in values)


def _vectors(kind, qkv, hs) -> np.int32:
    """1 where every row of q, k, v and dy starts on 16 bytes: the kernels' 16-byte loads."""
    vec = 16 // _storage(kind, qkv.dtype).itemsize
    return np.int32(hs % vec == 0 and qkv.shape[-1] % vec == 0 and address(qkv) % 16 == 0)


def _pack(k, kind, hs, x):
    """x as the kernels read it: bf16 words (one rounding pass from float32; bf16 arrays are
    their words already), else x itself."""
    if kind != "bf16":
        return x
    if x.dtype.name == "bfloat16":
        return x.view(np.uint16)
    words = backend.xp().empty(x.shape, dtype=np.uint16)
    if x.size:
        k("flash_pack", _defines(kind, hs))((-(-x.size // 256),), (256,),
                                            (x, words, np.int64(x.size)))
    return words


def _layout(qkv, nh, nkv):
    """The kernels' view of a fused qkv: (T, hs, row stride, column offsets of q, k, v)."""
    B, T, W = qkv.shape
    hs = W // (nh + 2 * nkv)
    return T, hs, np.int64(W), _ints(0, nh * hs, (nh + nkv) * hs)


def _fwd_launch(kind):
    def launch(k, qkv, nh, nkv, scale):
        xp = backend.xp()
        qkv = xp.ascontiguousarray(qkv)
        B = qkv.shape[0]
        T, hs, W, offsets = _layout(qkv, nh, nkv)
        acc = _compute_dtype(qkv.dtype)
        y = xp.empty((B, T, nh * hs), dtype=qkv.dtype)
        lse = xp.empty((B, nh, T), dtype=acc)
        if B and T:
            src = _pack(k, kind, hs, qkv)
            fn, shm = _get(k, "flash_fwd", kind, hs, qkv.itemsize)
            warps = SHAPES[kind][0]
            fn((-(-T // (16 * warps)), nh, B), (32 * warps,),
               (src, src, src, y, lse, *_ints(T, T, nh, nkv, hs), W, W, W, *offsets,
                *_ints(0, 0, 1), _vectors(kind, src, hs), acc(scale)), shared_mem=shm)
        return y, lse                       # (lse in float: bf16 would lose the merge)
    return launch


def _bwd_launch(kind):
    def launch(k, qkv, y, dy, lse, nh, nkv, scale):
        xp = backend.xp()
        qkv = xp.ascontiguousarray(qkv)
        B = qkv.shape[0]
        T, hs, W, offsets = _layout(qkv, nh, nkv)
        acc = _compute_dtype(qkv.dtype)
        dqkv = xp.empty_like(qkv)
        if not (B and T):
            return dqkv
        y, dy = xp.ascontiguousarray(y), xp.ascontiguousarray(dy, dtype=qkv.dtype)
        lse = xp.ascontiguousarray(lse, dtype=acc)
        dvec = xp.empty((B, nh, T), dtype=acc)
        src = _pack(k, kind, hs, qkv)
        dsrc = xp.empty(dy.shape, dtype=np.uint16) if kind == "bf16" else dy
        rows = B * T * nh
        k("flash_dot", _defines(kind, hs))((-(-rows // 8),), (256,),
                                           (y, dy, dvec, dsrc, *_ints(B, T, nh, hs)))
        warps = SHAPES[kind][0]
        tiles = -(-T // (16 * warps))
        common = (*_ints(T, T, nh, nkv, hs), W, W, W, *offsets, *_ints(0, 0, 1),
                  _vectors(kind, src, hs), acc(scale))
        fn, shm = _get(k, "flash_bwd_kvq", kind, hs, qkv.itemsize)      # dk, dv and dq
        fn((tiles, nkv + nh, B), (32 * warps,),
           (src, src, src, dsrc, lse, dvec, dqkv, dqkv, dqkv, *common), shared_mem=shm)
        return dqkv
    return launch


# ---- the self-check's cases: one row, odd lengths, odd head sizes, GQA and MQA, a tile edge --

CASES = ((1, 1, 1, 1, 1), (2, 5, 3, 3, 4), (1, 17, 2, 2, 64), (2, 70, 4, 2, 16),
         (1, 130, 4, 1, 24), (1, 64, 2, 2, 128))


def _cases(xp, rng, dt, backward=False, rounding=None):
    for B, T, nh, nkv, hs in CASES:
        qkv = xp.asarray(rng.standard_normal((B, T, (nh + 2 * nkv) * hs)).astype(dt))
        scale = 1.0 / math.sqrt(hs)
        if not backward:
            yield qkv, nh, nkv, scale
        else:
            y, lse = flash_twin(qkv, nh, nkv, scale, rounding)
            dy = xp.asarray(rng.standard_normal(y.shape).astype(dt))
            yield qkv, y, dy, lse, nh, nkv, scale


def _twins(kind):
    rounding = ROUNDING[kind]

    def fwd(qkv, nh, nkv, scale):
        return flash_twin(qkv, nh, nkv, scale, rounding)

    def bwd(qkv, y, dy, lse, nh, nkv, scale):
        return flash_bwd_twin(qkv, y, dy, lse, nh, nkv, scale, rounding)
    return fwd, bwd, rounding


# tolerances: the exact kinds sum in another order; the tensor-core kinds also round the
# probabilities (and ds) to bf16 (8 bits) or TF32 (11 bits) inside the products
TOLERANCE = {"exact": (1e-5, 1e-4), "bf16": (2e-2, 3e-2), "tf32": (3e-3, 5e-3)}
FLASH_FWD, FLASH_BWD = {}, {}
for _kind in ("exact", "bf16", "tf32"):
    _fwd, _bwd, _rounding = _twins(_kind)
    _suffix = "" if _kind == "exact" else "_" + _kind
    _dtypes = {"exact": ("float32", "float64"), "bf16": ("float32", "bfloat16"),
               "tf32": ("float32",)}[_kind]
    _packs = _kind == "bf16"                    # (float32 in: q, k, v rounded to bf16 first)
    _ctypes = (lambda dtype, defines, kind=_kind: {"S": _storage(kind, dtype)})
    _cpu = (lambda way: None if _kind == "tf32" else (f"cpu_attention.flash_{way}", _kind))
    FLASH_FWD[_kind] = Fused(
        "flash_fwd" + _suffix, FLASH_SOURCE, ["flash_pack", "flash_fwd"][not _packs:],
        _fwd_launch(_kind), _fwd, lambda xp, rng, dt: _cases(xp, rng, dt),
        launches=lambda qkv, *_, p=_packs: 1 + (p and qkv.dtype == np.float32),
        tolerance=TOLERANCE[_kind][0], dtypes=_dtypes, ctypes=_ctypes, cpu=_cpu("fwd"))
    FLASH_BWD[_kind] = Fused(
        "flash_bwd" + _suffix, FLASH_SOURCE,
        ["flash_pack", "flash_dot", "flash_bwd_kvq"][not _packs:],
        _bwd_launch(_kind), _bwd,
        lambda xp, rng, dt, r=_rounding: _cases(xp, rng, dt, True, r),
        launches=lambda qkv, *_, p=_packs: 2 + (p and qkv.dtype == np.float32),
        tolerance=TOLERANCE[_kind][1], dtypes=_dtypes, ctypes=_ctypes, cpu=_cpu("bwd"))
