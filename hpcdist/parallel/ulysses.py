"""Context parallelism by all-to-all (DeepSpeed-Ulysses' idea): around attention, this rank's
tokens of every head become every token of n_head / N heads, and back.

    qkv (B, T_r, 3, H, hs) --all-to-all--> (B, T, 3, H/N, hs) --causal attention-->
    y (B, T, H/N * hs) --all-to-all--> (B, T_r, H * hs)

Rank j gets heads [j H/N, (j+1) H/N); the tokens arrive in the group's order (parallel/
context.py) and are put in position order, so the attention in the middle is the ordinary
fused one. Each all-to-all's backward is the reverse all-to-all, and each is the
Communicator's collective (comm/alltoall.py: numbered, watched, counted). Needs N to divide
the heads this rank holds (n_head / tp): the configuration checks it.
"""
from __future__ import annotations

import math

import numpy as np

from ..device import backend
from ..autograd import ops
from ..host import timeline
from ..autograd.tensor import Tensor
from ..nn.gpt import attention


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
        return ops.dropout(att, self.p, True, keep)


def ulysses_attention(cp, qkv: Tensor, n_head: int, p: float = 0.0) -> Tensor:
    """(B, T_r, 3C) of this rank's tokens -> (B, T_r, C), attention by all-to-all; ``p``:
    dropout on the probabilities (then the attention goes op by op, as one process's)."""
    n = cp.n
    B, Tl, C3 = qkv.shape
    hs = C3 // 3 // n_head
    heads = n_head // n

    def forward(a):                              # sequence-split -> head-split
        return _to_heads(cp, a.reshape(B, Tl, 3, n_head, hs), n).reshape(B, cp.T, 3 * heads * hs)

    def backward(g):
        back = _to_tokens(cp, g.reshape(B, cp.T, 3, heads, hs), n)    # (B, T_r, N, 3, H/N, hs)
        return (back.transpose(0, 1, 3, 2, 4, 5).reshape(B, Tl, C3),)
    split = Tensor._make(forward(qkv.data), (qkv,), backward)
    if p:                                                                # (B, T, H/N * hs)
        y = attention(split, heads, _HeadsDropout(cp, cp.attention_draw(B, n_head, p), p,
                                                  heads))
    else:
        y = ops.fused_attention(split, heads)

    def back_to_heads(g):
        return (_to_heads(cp, g.reshape(B, Tl, 1, n_head, hs), n).reshape(B, cp.T, heads * hs),)
    out = _to_tokens(cp, y.data, n).reshape(B, Tl, C3 // 3)
    return Tensor._make(out, (y,), back_to_heads)
