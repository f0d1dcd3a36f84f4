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
from .moe import MoE


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
    # mixture of experts (nn/moe.py): experts > 0 puts an MoE MLP in every moe_every-th block
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    router: str = "softmax"          # softmax | sigmoid (with the balancing bias)
    shared_experts: int = 0
    expert_hidden: int = 0           # each expert's MLP width (0: 4 x n_embd, as a dense MLP)
    capacity_factor: float = 0.0     # 0: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    balance: str = "aux"             # aux (the Switch loss) | bias (DeepSeek-V3's) | none
    bias_rate: float = 1e-3

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == 0

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def attention(qkv: Tensor, n_head: int, drop, cache: dict | None = None) -> Tensor:
    """Causal self-attention of the fused projection qkv (B, T, 3C) -> (B, T, C): one fused op
    (ops.fused_attention) unless the probabilities take dropout or a KV cache is in use."""
    if cache is None and not active(drop):
        return ops.fused_attention(qkv, n_head)
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    q, k, v = qkv.split(3, axis=2)                                 # 3 x (B, T, C)
    q = q.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)          # (B, nh, T, hs)
    k = k.reshape(B, T, n_head, hs).transpose(0, 2, 3, 1)          # (B, nh, hs, T)
    v = v.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)          # (B, nh, T, hs)
    y = causal_attention(q, k, v, drop, cache)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)          # (B, T, C)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, drop, cache: dict | None = None):
    """softmax(q k / sqrt(hs), causal) v for q (B, nh, T, hs), k (B, nh, hs, T), v (B, nh, T,
    hs) -> (B, nh, T, hs). ``cache`` (inference): the keys and values of the tokens before
    these, extended with theirs (a KV cache: each new token attends to all before it)."""
    past = 0
    if cache is not None:
        if cache.get("k") is not None:
            past = cache["k"].shape[-1]
            k, v = ops.concat([cache["k"], k], axis=3), ops.concat([cache["v"], v], axis=2)
        cache["k"], cache["v"] = k, v                               # (B, nh, hs, past + T)
    att = ops.causal_softmax(q @ k, 1.0 / math.sqrt(q.shape[-1]), past)  # (B, nh, T, past+T)
    return drop(att) @ v


class SelfAttention(Module):
    """The attention itself, between the projections: (B, T, 3C) -> (B, T, C) over ``n_head``
    heads, with dropout on the probabilities. A module of its own so that a parallel version
    (parallel/context.py: each rank a slice of the sequence) can take its place."""

    def __init__(self, n_head: int, dropout: float = 0.0):
        self.n_head = n_head
        self.attn_drop = Dropout(dropout)

    def forward(self, qkv: Tensor, cache: dict | None = None) -> Tensor:
        """``cache``: this layer's KV cache (inference; see ``causal_attention``)."""
        return attention(qkv, self.n_head, self.attn_drop, cache)


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, std=0.02)
        self.core = SelfAttention(cfg.n_head, cfg.dropout)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=proj_std)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, cache: dict | None = None, residual: Tensor | None = None):
        """``cache``: this layer's KV cache (inference); ``residual``: added to the output
        (with the projection's bias, in one pass)."""
        y = self.core(self.c_attn(x), cache)
        if residual is not None and not active(self.resid_drop):    # + residual, one pass
            return ops.linear(y, self.c_proj.weight, self.c_proj.bias, residual)
        out = self.resid_drop(self.c_proj(y))
        return out if residual is None else residual + out


class Block(Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        self.ln_1 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, bias=cfg.bias)
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        if cfg.is_moe(layer):
            self.mlp = MoE(cfg.n_embd, cfg.expert_hidden or 4 * cfg.n_embd, cfg.experts, cfg.top_k, cfg.router,
                           cfg.shared_experts, cfg.capacity_factor, cfg.aux_loss_coef,
                           cfg.z_loss_coef, cfg.balance, cfg.bias_rate, cfg.bias, 0.02,
                           proj_std, cfg.dropout)
        else:
            self.mlp = MLP([cfg.n_embd, 4 * cfg.n_embd, cfg.n_embd], activation="gelu",
                           dropout=cfg.dropout, bias=cfg.bias, std=0.02, proj_std=proj_std)

    def forward(self, x: Tensor, cache: dict | None = None) -> Tensor:
        x = self.attn(self.ln_1(x), cache, residual=x)        # x + attn(ln(x))
        return self.mlp(self.ln_2(x), residual=x)             # x + mlp(ln(x))


class LMLoss(Module):
    """Logits -> (logits, mean cross-entropy of the targets), or the logits alone without
    targets. A module of its own so that a parallel version (each rank a slice of the
    vocabulary, or of the sequence) can take its place."""

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        if targets is None:
            return logits
        return logits, ops.cross_entropy(logits, targets, ignore_index=ignore_index)


class GPT(Module):
    """The one GPT. Parallel versions of it are this model with some modules swapped for
    parallel ones in place (parallel/tp/gpt.py, parallel/context.py): its forward, the
    pieces a pipeline stage runs and its parameter names stay these."""

    def __init__(self, cfg: GPTConfig):
        cfg.validate()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=0.02)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, std=0.02)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02)
        self.lm_loss = LMLoss()

    def forward(self, idx, targets=None, ignore_index: int = -100, cache=None):
        """idx (B, T) integer tokens -> logits (B, T, vocab), and the loss when targets given.
        ``cache``: a list of one dict per block (inference with a KV cache: ``idx`` are the
        tokens after those the cache holds; see hpcdist.sample)."""
        if isinstance(idx, Tensor):
            idx = idx.data
        x = self.embed(idx, cached_length(cache))                   # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = self.run_block(block, x) if cache is None else block(x, cache[i])
        return self.head(x, targets, ignore_index)

    # The pieces a pipeline stage runs (parallel/pipeline.py): embed, blocks, head.
    def embed(self, idx, past: int = 0) -> Tensor:
        B, T = idx.shape
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size "
                             f"{self.config.block_size}")
        pos = backend.array_module(idx).arange(past, past + T)
        return self.drop(self.wte(idx) + self.wpe(pos))              # (B, T, C)

    def run_block(self, block, x: Tensor) -> Tensor:
        recompute = self.config.checkpoint_activations and self.training
        return checkpoint(block, x) if recompute else block(x)

    def head(self, x: Tensor, targets=None, ignore_index: int = -100):
        """(logits, loss) of the final norm and the LM head (logits alone without targets)."""
        x = self.ln_f(x)
        logits = self.wte.attend(x) if self.lm_head is None else self.lm_head(x)
        return self.lm_loss(logits, targets, ignore_index)


def active(drop) -> bool:
    """Whether a Dropout module drops anything now."""
    return bool(drop.p) and drop.training


def cached_length(cache) -> int:
    """Tokens a KV cache (one dict per block) holds."""
    return cache[0]["k"].shape[-1] if cache and cache[0].get("k") is not None else 0
