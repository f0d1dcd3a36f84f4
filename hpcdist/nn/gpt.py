"""GPT: a decoder-only transformer in the style of GPT-2 / nanoGPT, declared as a family
(nn/family.py): learned positions, pre-norm LayerNorm blocks, multi-head attention from one
fused projection, a GELU MLP, a head tied to the token table."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..autograd import ops
from ..autograd.tensor import Tensor
from .attention import SelfAttention, active
from .family import AttentionShape, DecoderLM, Projection
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear
from .module import Module, ModuleList
from .moe import MoE


@dataclass
class GPTConfig:
    block_size: int = 64     # longest sequence the position table covers
    vocab_size: int = 16
    vocab_multiple: int = 1  # token table and head padded to a multiple of it (GPU: 64)
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

    arch = "gpt"

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == 0

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_head, self.n_head, self.n_embd // self.n_head)

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                     "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, std=0.02)
        self.core = SelfAttention(cfg.attention_shape(), cfg.dropout)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=proj_std)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, pos=None, cache: dict | None = None,
                residual: Tensor | None = None):
        """``cache``: this layer's KV cache (inference); ``residual``: added to the output
        (with the projection's bias, in one pass)."""
        y = self.core(self.c_attn(x), pos, cache)
        return self.c_proj(y, residual) if not active(self.resid_drop) else \
            _add(self.resid_drop(self.c_proj(y)), residual)


def _add(out: Tensor, residual: Tensor | None) -> Tensor:
    return out if residual is None else residual + out


class Block(Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    attention = "attn.core"            # the path of its attention core (context parallelism)

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

    def projections(self) -> list:
        """How tensor parallelism cuts this block's linear layers (the experts stay whole)."""
        out = [Projection("attn.c_attn", "column", self.attn.core.shape.pieces),
               Projection("attn.c_proj", "row")]
        if not isinstance(self.mlp, MoE):
            out += [Projection("mlp.layers.0", "column"), Projection("mlp.layers.1", "row")]
        return out

    def dropouts(self) -> list:
        """(owner, attribute) of the dropouts on activations (sequence-parallel draws)."""
        return [(self.attn, "resid_drop"), (self.mlp, "drop")]

    def forward(self, x: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        x = self.attn(self.ln_1(x), pos, cache, residual=x)   # x + attn(ln(x))
        return self.mlp(self.ln_2(x), residual=x)             # x + mlp(ln(x))


class LMLoss(Module):
    """Logits -> (logits, mean cross-entropy of the targets), or the logits alone without
    targets. A module of its own so that a parallel version (each rank a slice of the
    vocabulary, or of the sequence) can take its place. ``vocab_size``: the vocabulary, where
    the head is padded past it (``vocab_multiple``): the padding columns are left out of the
    loss, and the logits it returns outside training (evaluation, sampling) are the
    vocabulary's alone; in training they are returned as computed (padded, no copy)."""

    def __init__(self, vocab_size: int | None = None):
        self.vocab_size = vocab_size

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        V = self.vocab_size
        padded = V is not None and logits.shape[-1] > V
        loss = None if targets is None else ops.cross_entropy(
            logits, targets, ignore_index=ignore_index, vocab=V if padded else None)
        if padded and (targets is None or not self.training):
            logits = logits[..., :V]
        return logits if targets is None else (logits, loss)


class GPT(DecoderLM):
    """The one GPT. Parallel versions of it are this model with some modules swapped for
    parallel ones in place (parallel/tp/, parallel/context.py): its forward, the pieces a
    pipeline stage runs and its parameter names stay these."""

    PARTS = {"tokens": "wte", "positions": "wpe", "drop": "drop", "norm": "ln_f",
             "head": "lm_head", "loss": "lm_loss"}

    def __init__(self, cfg: GPTConfig):
        cfg.validate()
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, std=0.02, multiple=cfg.vocab_multiple)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, std=0.02)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02, multiple=cfg.vocab_multiple)
        self.lm_loss = LMLoss(cfg.vocab_size)
