"""GPT: a decoder-only transformer in the style of GPT-2 / nanoGPT."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..device import backend
from ..autograd import ops
from ..autograd.recompute import checkpoint
from ..autograd.tensor import Tensor
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear
from .module import Module, ModuleList


@dataclass
class GPTConfig:
    block_size: int = 64     # longest sequence the position table covers
    vocab_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True  # the output head reuses the token embedding (wte.T)
    checkpoint_activations: bool = False  # recompute each block's activations in backward

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def attention(qkv: Tensor, n_head: int, mask, drop, cache: dict | None = None,
              cp=None) -> Tensor:
    """Causal self-attention of the fused projection qkv (B, T, 3C) -> (B, T, C): one fused op
    (ops.fused_attention) unless the probabilities take dropout or a KV cache is in use;
    ``cp``: this rank holds a slice of each sequence (parallel/context.py)."""
    if cp is not None and cache is None:
        return cp.attention(qkv, n_head)
    if cache is None and not active(drop):
        return ops.fused_attention(qkv, n_head)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    q, k, v = qkv.split(3, axis=2)                                 # 3 x (B, T, C)
    q = q.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)          # (B, nh, T, hs)
    k = k.reshape(B, T, n_head, hs).transpose(0, 2, 3, 1)          # (B, nh, hs, T)
    v = v.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)          # (B, nh, T, hs)
    y = causal_attention(q, k, v, mask, drop, cache)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)          # (B, T, C)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, mask, drop, cache: dict | None = None):
    """softmax(q k / sqrt(hs), causal) v for q (B, nh, T, hs), k (B, nh, hs, T), v (B, nh, T,
    hs) -> (B, nh, T, hs). ``mask``: the (block, block) causal mask; ``cache`` (inference): the
    keys and values of the tokens before these, extended with theirs (a KV cache: each new
    token attends to all before it)."""
    past, T = 0, q.shape[2]
    if cache is not None:
        if cache.get("k") is not None:
            past = cache["k"].shape[-1]
            k, v = ops.concat([cache["k"], k], axis=3), ops.concat([cache["v"], v], axis=2)
        cache["k"], cache["v"] = k, v                               # (B, nh, hs, past + T)
    att = ops.causal_softmax(q @ k, 1.0 / math.sqrt(q.shape[-1]), past)  # (B, nh, T, past+T)
    return drop(att) @ v


class CausalSelfAttention(Module):
    cp = None                       # a ContextParallel group (parallel/context.py), if any

    def __init__(self, cfg: GPTConfig):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, std=0.02)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=proj_std)
        self.attn_drop = Dropout(cfg.dropout)
        self.resid_drop = Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        xp = backend.xp()
        # True above the diagonal: position t may not look at t' > t.
        self.causal_mask = xp.triu(xp.ones((cfg.block_size, cfg.block_size), dtype=bool), k=1)

    def forward(self, x: Tensor, cache: dict | None = None, residual: Tensor | None = None):
        """``cache``: this layer's KV cache (inference; see ``causal_attention``);
        ``residual``: added to the output (with the projection's bias, in one pass)."""
        y = attention(self.c_attn(x), self.n_head, self.causal_mask, self.attn_drop, cache,
                      self.cp)
        if residual is not None and not active(self.resid_drop):    # + residual, one pass
            return ops.linear(y, self.c_proj.weight, self.c_proj.bias, residual)
        out = self.resid_drop(self.c_proj(y))
        return out if residual is None else residual + out


class Block(Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP([cfg.n_embd, 4 * cfg.n_embd, cfg.n_embd], activation="gelu",
                       dropout=cfg.dropout, bias=cfg.bias, std=0.02,
                       proj_std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: Tensor, cache: dict | None = None) -> Tensor:
        x = self.attn(self.ln_1(x), cache, residual=x)        # x + attn(ln(x))
        return self.mlp(self.ln_2(x), residual=x)             # x + mlp(ln(x))


class GPT(Module):
    cp = None                       # a ContextParallel group: each rank a slice of a sequence

    def __init__(self, cfg: GPTConfig):
        cfg.validate()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=0.02)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, std=0.02)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02)

    def forward(self, idx, targets=None, ignore_index: int = -100, cache=None):
        """idx (B, T) integer tokens -> logits (B, T, vocab), and the loss when targets given.
        ``cache``: a list of one dict per block (inference with a KV cache: ``idx`` are the
        tokens after those the cache holds; see hpcdist.sample)."""
        if isinstance(idx, Tensor):
            idx = idx.data
        if cache is not None:
            x = self.embed(idx, cached_length(cache))
            for block, layer_cache in zip(self.blocks, cache):
                x = block(x, layer_cache)
            return self.head(x, targets, ignore_index)
        x = self.embed(idx)                                         # (B, T, C)
        for block in self.blocks:
            x = self.run_block(block, x, idx.shape[1])
        return self.head(x, targets, ignore_index)

    # The pieces a pipeline stage runs (parallel/pipeline.py): embed, blocks, head.
    def embed(self, idx, past: int = 0) -> Tensor:
        B, T = idx.shape
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size "
                             f"{self.config.block_size}")
        if self.cp is not None:                                     # this rank's tokens
            idx, pos = self.cp.take(idx)
        else:
            pos = backend.array_module(idx).arange(past, past + T)
        return self.drop(self.wte(idx) + self.wpe(pos))              # (B, T, C)

    def run_block(self, block, x: Tensor, T: int) -> Tensor:
        if self.cp is not None:
            self.cp.begin(T)
        recompute = self.config.checkpoint_activations and self.training
        return checkpoint(block, x) if recompute else block(x)

    def head(self, x: Tensor, targets=None, ignore_index: int = -100, T: int | None = None):
        """(logits, loss) of the final norm and the LM head (``T``: the sequence length, which
        a sequence-parallel or context-parallel model needs)."""
        x = self.ln_f(x)
        if self.lm_head is None:
            logits = x @ self.wte.weight.T                          # (B, T, vocab)
        else:
            logits = self.lm_head(x)
        if self.cp is not None:
            if T is not None:
                self.cp.begin(T)
            loss = None if targets is None else ops.cross_entropy(
                logits, self.cp.local_targets(targets), ignore_index=ignore_index)
            return self.cp.finish(logits, loss, targets, ignore_index, self.training)
        if targets is None:
            return logits
        return logits, ops.cross_entropy(logits, targets, ignore_index=ignore_index)


def active(drop) -> bool:
    """Whether a Dropout module drops anything now."""
    return bool(drop.p) and drop.training


def cached_length(cache) -> int:
    """Tokens a KV cache (one dict per block) holds."""
    return cache[0]["k"].shape[-1] if cache and cache[0].get("k") is not None else 0
