"""The attention between the projections, shared by every family: the fused q|k|v (its shape
an ``AttentionShape``: grouped-query attention reads each kv head for its group, never a
repeated copy), rotary position embeddings applied to q and k at each token's global
position, then causal attention — one fused op (tiled, ops.fused_attention), or op by op
where the probabilities take dropout or a KV cache holds the past keys and values (only the
kv heads). A module of its own so that a parallel version (parallel/context.py: each rank a
slice of the sequence) takes its place."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..autograd import ops
from ..autograd.tensor import Tensor
from .family import AttentionShape
from .layers import Dropout
from .module import Module


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (RoFormer; Llama's half-split layout): q and k's pairs
    (i, i + hd/2) rotated by position x theta^(-2i/hd)."""
    theta: float = 10000.0


class SelfAttention(Module):
    """(B, T, shape.width) -> (B, T, shape.out_width) over ``shape``'s heads, with dropout on
    the probabilities and, with ``rotary``, q and k rotated by their positions first."""

    def __init__(self, shape: AttentionShape, dropout: float = 0.0,
                 rotary: Rotary | None = None):
        self.shape, self.rotary = shape, rotary
        self.attn_drop = Dropout(dropout)

    @property
    def n_head(self) -> int:
        return self.shape.n_head

    def forward(self, qkv: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        """``pos``: the rows' global positions (rotary); ``cache``: this layer's KV cache
        (inference; see ``attention``)."""
        if self.rotary is not None:
            qkv = ops.rotary(qkv, pos, self.shape, self.rotary.theta)
        return attention(qkv, self.shape, self.attn_drop, cache)


def attention(qkv: Tensor, shape: AttentionShape, drop, cache: dict | None = None) -> Tensor:
    """Causal self-attention of qkv (B, T, shape.width) -> (B, T, shape.out_width): the fused
    op unless the probabilities take dropout or a KV cache is in use. ``cache`` (inference):
    the kv heads' keys and values of the tokens before these, extended with theirs."""
    if cache is None and not active(drop):
        return ops.fused_attention(qkv, shape.n_head, shape.n_kv_head)
    B, T, _ = qkv.shape
    nkv, hd = shape.n_kv_head, shape.head_dim
    G = shape.n_head // nkv
    q, k, v = ops.split(qkv, list(shape.pieces), axis=2)
    q = q.reshape(B, T, nkv, G, hd).transpose(0, 2, 3, 1, 4)        # (B, nkv, G, T, hd)
    k = k.reshape(B, T, nkv, 1, hd).transpose(0, 2, 3, 4, 1)        # (B, nkv, 1, hd, T)
    v = v.reshape(B, T, nkv, 1, hd).transpose(0, 2, 3, 1, 4)        # (B, nkv, 1, T, hd)
    past = 0
    if cache is not None:
        if cache.get("k") is not None:
            past = cache["k"].shape[-1]
            k, v = ops.concat([cache["k"], k], axis=4), ops.concat([cache["v"], v], axis=3)
        cache["k"], cache["v"] = k, v
    att = ops.causal_softmax(q @ k, 1.0 / math.sqrt(hd), past)     # (B, nkv, G, T, past+T)
    y = drop(att) @ v                                               # (B, nkv, G, T, hd)
    return y.transpose(0, 3, 1, 2, 4).reshape(B, T, shape.out_width)


def active(drop) -> bool:
    """Whether a Dropout module drops anything now."""
    return bool(drop.p) and drop.training
