"""Llama (and Mistral, and with experts Mixtral), declared as a family (nn/family.py): RMSNorm
pre-norm blocks, rotary positions (applied to q and k at each token's global position inside
attention), grouped-query attention from one fused q|k|v projection, a SwiGLU MLP from one
fused gate|up projection, no biases, an untied head. What differs from GPT is the block's
recipe: a third family (Qwen2's q|k|v biases, say) is a config default or two."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..autograd import ops
from ..autograd.tensor import Tensor
from .attention import Rotary, SelfAttention, active
from .family import AttentionShape, DecoderLM, Projection
from .gpt import LMLoss
from .layers import Dropout, Embedding, Linear
from .module import Module, ModuleList, Parameter
from .moe import MoE


@dataclass
class LlamaConfig:
    block_size: int = 64         # longest sequence (rotary positions have no table)
    vocab_size: int = 16
    vocab_multiple: int = 1      # token table and head padded to a multiple of it (GPU: 64)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 0           # key/value heads (0: n_head; 1: multi-query)
    n_embd: int = 64
    ffn_hidden: int = 0          # SwiGLU's width (0: 8/3 n_embd up to a multiple of 64)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = False           # biases on q|k|v and the output projection (Llama: none;
                                 # Hugging Face's attention_bias), never on the MLP
    tie_weights: bool = False    # the head reuses the token table
    checkpoint_activations: bool = False
    # mixture of experts (Mixtral: 8 SwiGLU experts, top-2, softmax router renormalised)
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    router: str = "softmax"
    shared_experts: int = 0
    expert_hidden: int = 0       # each expert's width (0: ffn_hidden's default)
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    balance: str = "aux"
    bias_rate: float = 1e-3

    arch = "llama"

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def hidden(self) -> int:
        return self.ffn_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_head, self.kv_heads, self.n_embd // self.n_head)

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                     "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd ({self.n_embd}) must be n_head ({self.n_head}) heads of "
                             "an even size (rotary embeddings rotate pairs)")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head "
                             f"({self.n_kv_head}): each kv head serves a whole group of queries")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class RMSNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        from ..device import backend
        self.weight = Parameter(backend.xp().ones(dim, dtype=backend.default_float()))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class SwiGLU(Module):
    """down(silu(x gate) * (x up)), gate and up one fused projection [gate | up]."""

    def __init__(self, C: int, H: int, bias: bool = False, std: float = 0.02,
                 proj_std: float = 0.02, dropout: float = 0.0):
        self.gate_up = Linear(C, 2 * H, bias=bias, std=std)
        self.down = Linear(H, C, bias=bias, std=proj_std)
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        h = ops.swiglu(self.gate_up(x))
        if residual is not None and not active(self.drop):
            return self.down(h, residual)
        out = self.drop(self.down(h))
        return out if residual is None else residual + out


class Attention(Module):
    def __init__(self, cfg: LlamaConfig, proj_std: float):
        shape = cfg.attention_shape()
        self.qkv = Linear(cfg.n_embd, shape.width, bias=cfg.bias, std=0.02)
        self.core = SelfAttention(shape, cfg.dropout, Rotary(cfg.rope_theta))
        self.proj = Linear(shape.out_width, cfg.n_embd, bias=cfg.bias, std=proj_std)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, pos=None, cache: dict | None = None,
                residual: Tensor | None = None):
        y = self.core(self.qkv(x), pos, cache)
        if not active(self.resid_drop):
            return self.proj(y, residual)
        out = self.resid_drop(self.proj(y))
        return out if residual is None else residual + out


class Block(Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): RMSNorm, rotary GQA attention, SwiGLU (or
    SwiGLU experts)."""

    attention = "attn.core"

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg, proj_std)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        H = cfg.hidden()
        if cfg.is_moe(layer):
            E = cfg.expert_hidden or H
            self.mlp = MoE(cfg.n_embd, E, cfg.experts, cfg.top_k, cfg.router,
                           cfg.shared_experts, cfg.capacity_factor, cfg.aux_loss_coef,
                           cfg.z_loss_coef, cfg.balance, cfg.bias_rate, False, 0.02,
                           proj_std, cfg.dropout,
                           expert=lambda: SwiGLU(cfg.n_embd, E, False, 0.02, proj_std))
        else:
            self.mlp = SwiGLU(cfg.n_embd, H, False, 0.02, proj_std, cfg.dropout)

    def projections(self) -> list:
        out = [Projection("attn.qkv", "column", self.attn.core.shape.pieces),
               Projection("attn.proj", "row")]
        if not isinstance(self.mlp, MoE):
            H = self.mlp.down.weight.shape[0]
            out += [Projection("mlp.gate_up", "column", (H, H)), Projection("mlp.down", "row")]
        return out

    def dropouts(self) -> list:
        return [(self.attn, "resid_drop"), (self.mlp, "drop")]

    def forward(self, x: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        x = self.attn(self.attn_norm(x), pos, cache, residual=x)
        return self.mlp(self.mlp_norm(x), residual=x)


class Llama(DecoderLM):
    PARTS = {"tokens": "embed_tokens", "positions": None, "drop": "drop", "norm": "norm",
             "head": "lm_head", "loss": "lm_loss"}

    def __init__(self, cfg: LlamaConfig):
        cfg.validate()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.n_embd, std=0.02,
                                      multiple=cfg.vocab_multiple)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02, multiple=cfg.vocab_multiple)
        self.lm_loss = LMLoss(cfg.vocab_size)
