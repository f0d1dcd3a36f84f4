"""Context parallelism by all-to-all (DeepSpeed-Ulysses' idea): around attention, this rank's
tokens of every head become every token of a 1/N share of the heads, and back.

    qkv (B, T_r, nkv, G + 2, hs) --all-to-all--> (B, T, nkv/N, G + 2, hs) --causal attention-->
    y (B, T, nh/N * hs) --all-to-all--> (B, T_r, nh * hs)

The fused projection is regrouped per kv head (its G query heads, its k, its v: a unit that
stays together; multi-head: G = 1), and rank j gets units [j nkv/N, (j+1) nkv/N); the
tokens arrive in the group's order (parallel/context.py) and are put in position order, so
the attention in the middle is the ordinary fused one. Each all-to-all's backward is the
reverse all-to-all, and each is the Communicator's collective (comm/alltoall.py: numbered,
watched, counted). N must divide the kv heads this rank holds (the configuration checks)."""
from __future__ import annotations

import math

import numpy as np

from ..device import backend
from ..autograd import ops
from ..host import timeline
from ..autograd.tensor import Tensor
from ..nn.attention import attention
from ..nn.family import AttentionShape


def exchange(cp, sends: list, shapes: list) -> list:
    """sends[j] to rank j of the group; returns the piece from each rank r, shaped shapes[r].
    Equal pieces on every rank (T a multiple of the order's) go as P equal pieces ("auto"
    may take Bruck's algorithm); else as the v-form, with the sizes coming in known."""
    xp = backend.array_module(sends[0])
    flat = xp.concatenate([s.reshape(-1) for s in sends])
    sizes = [int(s.size) for s in sends]
    incoming = [math.prod(s) for s in shapes]
    even = cp.even()
    with timeline.span("cp all-to-all", cat="cp"):
        got = cp.comm.alltoall(flat, counts=None if even else sizes,
                               recv_counts=None if even else incoming)
    return [g.reshape(s) for g, s in zip(got, shapes)]


def _to_heads(cp, a, groups: int):
    """(B, T_r, 3, H, hs) of this rank's tokens -> (B, T, 3, H/N, hs) of every token."""
    xp = backend.array_module(a)
    B = a.shape[0]
    parts = a.reshape(a.shape[:3] + (groups, -1) + a.shape[4:])
    rest = parts.shape[2:3] + parts.shape[4:]
    got = exchange(cp, [parts[:, :, :, j] for j in range(groups)],
                   [(B, len(cp.positions(r))) + rest for r in range(groups)])
    full = xp.empty((B, cp.T) + rest, dtype=a.dtype)
    for r, part in enumerate(got):
        full[:, cp.index(xp, r)] = part
    return full


def _to_tokens(cp, full, groups: int):
    """(B, T, ...) of this rank's heads -> (B, T_r, N, ...): every group's heads, my tokens."""
    xp = backend.array_module(full)
    mine = (full.shape[0], len(cp.positions())) + full.shape[2:]
    got = exchange(cp, [full[:, cp.index(xp, r)] for r in range(groups)], [mine] * groups)
    return xp.stack(got, axis=2)


class _HeadsDropout:
    """Dropout on the probabilities (B, H/N, T, T) of this rank's heads: their part of the
    one-process draw over all H heads (``draw``: ContextParallel.attention_draw)."""
    training = True

    def __init__(self, cp, draw, p: float, heads: int):
        self.cp, self.draw, self.p, self.heads = cp, draw, p, heads

    def __call__(self, att: Tensor) -> Tensor:
        rng, (counter, shape) = backend.rng(), self.draw
        mine = np.arange(self.cp.rank * self.heads, (self.cp.rank + 1) * self.heads)
        keep = rng.keep_mask_at(shape, {1: mine}, self.p, backend.array_module(att.data),
                                counter)
        return ops.dropout(att, self.p, True, keep.reshape(att.shape))


def _units(qkv, shape):
    """(B, T, shape.width) -> (B, T, nkv, G + 2, hs): each kv head's unit (its G query
    heads, its k, its v) together."""
    B, T = qkv.shape[:2]
    xp = backend.array_module(qkv)
    q, k, v = shape.views(qkv)
    G = shape.n_head // shape.n_kv_head
    return xp.concatenate([q.reshape(B, T, shape.n_kv_head, G, -1), k[:, :, :, None],
                           v[:, :, :, None]], axis=3)


def _fused(units):
    """(B, T, nkv, G + 2, hs) units -> (B, T, width) q | k | v, the fused layout."""
    B, T, nkv, G2, hs = units.shape
    xp = backend.array_module(units)
    return xp.concatenate([units[:, :, :, :G2 - 2].reshape(B, T, -1),
                           units[:, :, :, G2 - 2].reshape(B, T, -1),
                           units[:, :, :, G2 - 1].reshape(B, T, -1)], axis=-1)


def ulysses_attention(cp, qkv: Tensor, shape, p: float = 0.0) -> Tensor:
    """(B, T_r, shape.width) of this rank's tokens -> (B, T_r, shape.out_width), attention by
    all-to-all; ``p``: dropout on the probabilities (then the attention goes op by op, as
    one process's)."""
    n = cp.n
    B, Tl, W = qkv.shape
    hs, nkv, G = shape.head_dim, shape.n_kv_head, shape.n_head // shape.n_kv_head
    local = AttentionShape(shape.n_head // n, nkv // n, hs)

    def forward(a):                              # sequence-split -> head-split
        return _fused(_to_heads(cp, _units(a, shape)[:, :, None], n)[:, :, 0])

    def backward(g):                             # (B, T, local.width) -> (B, T_r, W)
        back = _to_tokens(cp, _units(g, local), n)           # (B, T_r, N, nkv/N, G + 2, hs)
        return (_fused(back.reshape(B, Tl, nkv, G + 2, hs)),)
    split = Tensor._make(forward(qkv.data), (qkv,), backward)
    if p:                                                        # (B, T, local.out_width)
        y = attention(split, local, _HeadsDropout(cp, cp.attention_draw(B, shape.n_head, p),
                                                  p, local.n_head))
    else:
        y = ops.fused_attention(split, local.n_head, local.n_kv_head)

    def back_to_heads(g):
        return (_to_heads(cp, g.reshape(B, Tl, 1, shape.n_head, hs), n)
                .reshape(B, cp.T, local.out_width),)
    out = _to_tokens(cp, y.data, n).reshape(B, Tl, shape.out_width)
    return Tensor._make(out, (y,), back_to_heads)
