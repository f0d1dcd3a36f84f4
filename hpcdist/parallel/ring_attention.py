"""Ring attention: causal attention of this rank's slice of every sequence over the whole
sequence, K/V blocks travelling round the context-parallel group (rank i sends to i + 1)
while the block in hand is scored, merged by their log-sum-exp; the backward sends the
blocks round the other way with their dK/dV accumulating (ring.py: the rings both block
kinds share). Without dropout each block is the
flash kernels' (ring_flash.py); with it, NumPy's here, drawn block by block at the global
(query, key) positions of the one-process draw. The layout: parallel/context.py."""
from __future__ import annotations

import functools

import numpy as np

from ..device import backend
from ..autograd.tensor import Tensor
from .ring import rotate_backward, rotate_forward
from .ring_flash import ring_flash

def _split_qkv(qkv, shape):
    """(B, T, shape.width) -> q (B, nkv, G, T, hs), k and v (B, nkv, 1, T, hs): each kv head
    and the G query heads it serves (multi-head: G = 1), contiguous, in a float type fit to
    sum in."""
    xp = backend.array_module(qkv)
    B, T = qkv.shape[:2]
    nkv, G = shape.n_kv_head, shape.n_head // shape.n_kv_head
    q, k, v = shape.views(qkv)
    out = (q.reshape(B, T, nkv, G, -1).transpose(0, 2, 3, 1, 4),
           k[:, :, :, None].transpose(0, 2, 3, 1, 4), v[:, :, :, None].transpose(0, 2, 3, 1, 4))
    return tuple(xp.ascontiguousarray(a.astype(np.float32) if a.dtype.itemsize < 4 else a)
                 for a in out)


def _tokens(a):
    """(B, nkv, G, T, hs) -> (B, T, nkv G hs): the heads back in their tokens' rows."""
    B, T = a.shape[0], a.shape[3]
    return a.transpose(0, 3, 1, 2, 4).reshape(B, T, -1)


def _heads(a, shape):
    """(B, T, nkv G hs) -> ``shape`` (B, nkv, G, T, hs): ``_tokens`` undone."""
    B, nkv, G, T, hs = shape
    return a.reshape(B, T, nkv, G, hs).transpose(0, 2, 3, 1, 4)


def _scores(qs, ks, scale):
    """q k^T * scale, (B, nkv, G, Tq, Tk): the one block-sized array the forward makes (in
    place from here on: a block's transient memory is one or two score-sized arrays)."""
    s = qs @ backend.array_module(ks).swapaxes(ks, -1, -2)
    s *= scale
    return s


def _mask(edges, dtype, seen: float, unseen: float):
    """(Tq, Tk) of ``dtype``: ``seen`` where a query may look, ``unseen`` where it may not
    (made on the device from the positions, for the block in hand only)."""
    xp = backend.array_module(edges[0])
    return xp.where(edges[0] >= edges[1], seen, unseen).astype(dtype)


def _block_forward(q, k, v, seen, keep, scale, *, out, lse) -> None:
    """Merge the attention of q over one K/V block into (out, lse), in place (``seen``:
    ``ContextParallel.visible`` of the block; ``keep``: its dropout, kept / (1 - p))."""
    rows, cols, edges = seen
    if rows is None:
        return
    xp = backend.array_module(q)
    s = _scores(q[..., rows, :], k[..., cols, :], scale)
    if edges is not None:                # -inf where a query may not look
        s += _mask(edges, s.dtype, 0.0, -np.inf)
    m = s.max(axis=-1)
    s -= m[..., None]
    p = xp.exp(s, out=s)
    total = p.sum(axis=-1)
    if keep is not None:                 # dropout after the softmax: the sum stays
        p *= keep
    ob = p @ v[..., cols, :]
    del s, p
    ob /= total[..., None]
    lb = m + xp.log(total)
    la = lse[..., rows]
    new = xp.maximum(la, lb)
    new += xp.log(xp.exp(la - new) + xp.exp(lb - new))
    out[..., rows, :] = out[..., rows, :] * xp.exp(la - new)[..., None] + \
        ob * xp.exp(lb - new)[..., None]
    lse[..., rows] = new


def _block_backward(q, k, v, seen, keep, scale, *, dout, lse, D, dq):
    """dq += this block's part (in place); returns (dk, dv) of the block. With dropout
    (``keep``), D = rowsum(dout * out) of the dropped output is still the softmax's term."""
    xp = backend.array_module(q)
    dkv = xp.zeros((2,) + tuple(k.shape), dtype=k.dtype)
    rows, cols, edges = seen
    if rows is None:
        return dkv
    qs, ks, vs, dos = q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :]
    p = _scores(qs, ks, scale)
    p -= lse[..., rows][..., None]
    xp.exp(p, out=p)                     # the probabilities, from the saved log-sum-exp
    if edges is not None:
        p *= _mask(edges, p.dtype, 1.0, 0.0)
    # a kv head's gradient: the sum over the G query heads it serves
    dkv[1][..., cols, :] = (xp.swapaxes(p if keep is None else p * keep, -1, -2) @ dos).sum(
        axis=2, keepdims=True)
    ds = dos @ xp.swapaxes(vs, -1, -2)
    if keep is not None:
        ds *= keep
    ds -= D[..., rows][..., None]
    ds *= p
    del p
    ds *= scale
    dq[..., rows, :] += ds @ ks
    dkv[0][..., cols, :] = (xp.swapaxes(ds, -1, -2) @ qs).sum(axis=2, keepdims=True)
    return dkv


def _look(cp, draw, p: float, dtype, xp, groups: int, *, src: int):
    """What this rank's queries see of rank ``src``'s keys (``ContextParallel.visible``), and
    their dropout there, kept / (1 - p), from the one-process draw (``draw``; None without)."""
    seen = cp.visible(src, xp)
    if draw is None or seen[0] is None:
        return seen, None
    rows, cols, _ = seen
    picks = {2: cp.positions()[rows], 3: cp.positions(src)[cols]}
    rng = backend.rng()
    kept = rng.keep_mask_at(draw[1], picks, p, xp, draw[0])          # (B, H, rows, cols)
    B, H = kept.shape[:2]
    kept = kept.reshape((B, groups, H // groups) + kept.shape[2:])   # (B, nkv, G, ...)
    return seen, kept.astype(dtype) * dtype.type(1.0 / (1.0 - p))


def ring_attention(cp, qkv: Tensor, shape, p: float = 0.0) -> Tensor:
    """Causal attention of this rank's tokens over the whole sequence: (B, T_r, shape.width)
    -> (B, T_r, shape.out_width), K/V (only the kv heads) travelling round the group;
    ``p``: dropout on the probabilities (then each block in NumPy here, drawn as one
    process draws; without, the flash kernels of each chunk pair: parallel/ring_flash.py)."""
    if not p:
        return ring_flash(cp, qkv, shape)
    xp = backend.array_module(qkv.data)
    B = qkv.shape[0]
    q, k, v = _split_qkv(qkv.data, shape)
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = xp.zeros_like(q)
    lse = xp.full(q.shape[:4], -np.inf, dtype=q.dtype)
    look = functools.partial(_look, cp, cp.attention_draw(B, shape.n_head, p), p, q.dtype, xp,
                             shape.n_kv_head)
    rotate_forward(cp, xp.stack([k, v]), lambda kb, vb, src: _block_forward(
        q, kb, vb, *look(src=src), scale, out=out, lse=lse))
    y = _tokens(out).astype(qkv.dtype)

    def backward(g):
        dout = xp.ascontiguousarray(_heads(g, q.shape)).astype(q.dtype)
        D = (dout * out).sum(axis=-1)
        dq = xp.zeros_like(q)
        dkv = rotate_backward(cp, xp.stack([k, v]), lambda kb, vb, src: _block_backward(
            q, kb, vb, *look(src=src), scale, dout=dout, lse=lse, D=D, dq=dq))
        d = xp.concatenate([_tokens(dq), _tokens(dkv[0]), _tokens(dkv[1])], axis=-1)
        return (d.astype(qkv.dtype),)
    return Tensor._make(y, (qkv,), backward)
