"""Llama (and Mistral, and with experts Mixtral), declared as a family (nn/family.py): RMSNorm
pre-norm blocks, rotary positions (applied to q and k at each token's global position inside
attention), grouped-query attention from one fused q|k|v projection, a SwiGLU MLP from one
fused gate|up projection, no biases, an untied head; Llama 3.1's scaled rotary frequencies a
declared rotary kind. The config declares what a family built on it changes (nn/qwen2.py,
nn/gemma.py); LlamaHF reads and writes Llama, Mistral and Mixtral folders."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..autograd.tensor import Tensor
from ..device.kernels.attention_kinds import PLAIN, Scores
from .attention import Rotary, SelfAttention, rotary_of
from .family import Anatomy, AttentionShape, DecoderLM, Family, Projection, count_parameters
from .hf_adapter import HFAdapter, Renamed, rope_fields, rope_json
from .gpt import LMLoss
from .layers import Dropout, Embedding, Linear, RMSNorm, SwiGLU, active
from .module import Module, ModuleList
from .moe import MoE, moe_settings
from .placement import HEADS


def option(default, help: str):
    """A family's own setting: a --flag of ``python -m hpcdist.train`` listed under the
    families that declare it (run/config.py makes the flags from these)."""
    return field(default=default, metadata={"help": help})


@dataclass
class LlamaConfig:
    block_size: int = 64         # longest sequence (rotary positions have no table)
    vocab_size: int = 16
    vocab_multiple: int = 1      # token table and head padded to a multiple of it (GPU: 64)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = option(0, "key/value heads, each shared by n_head / n_kv_head query "
                               "heads (grouped-query attention; 0: n_head, 1: multi-query)")
    n_embd: int = 64
    head_dim: int = option(0, "each head's size (0: n_embd / n_head)")
    ffn_hidden: int = option(0, "the gated MLP's width (0: 8/3 of n_embd, up to a multiple "
                                "of 64)")
    rope_theta: float = option(10000.0, "the rotary embeddings' base")
    rope_type: str = option("default", "rotary frequencies: default | llama3 (Llama 3.1's "
                                       "long-context scaling, the --rope-* below) | yarn")
    rope_factor: float = option(8.0, "llama3 and yarn rotary: how many times the long "
                                     "wavelengths are slowed")
    rope_low_freq_factor: float = option(1.0, "llama3 rotary: wavelengths past "
                                              "original context / this are slowed")
    rope_high_freq_factor: float = option(4.0, "llama3 rotary: wavelengths under "
                                               "original context / this are kept")
    rope_original_context: int = option(8192, "llama3 and yarn rotary: the context the "
                                              "model was pretrained at")
    rope_beta_fast: float = option(32.0, "yarn rotary: dimensions turning more than this "
                                         "often in the original context are kept")
    rope_beta_slow: float = option(1.0, "yarn rotary: dimensions turning less than this "
                                        "often are slowed --rope-factor times")
    rope_attention_factor: float = option(0.0, "yarn rotary: cos and sin scaled by this "
                                               "(0: 0.1 ln(factor) + 1)")
    sliding_window: int = option(0, "attention sees at most this many positions back "
                                    "(Mistral; 0: the whole context)")
    norm_eps: float = option(1e-5, "RMSNorm's epsilon")
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
    # What the family is made of, declared (a family that differs sets these, not code):
    activation = "silu"          # the gated MLP's: silu (SwiGLU) | gelu_tanh (GeGLU)
    norm_offset = 0.0            # RMSNorm scales by (offset + weight): Gemma's 1
    scale_embeddings = False     # the token vectors times sqrt(n_embd) (Gemma)
    out_bias = True              # the output projection has a bias where --bias is on
                                 # (Qwen2: q|k|v biases only)
    head_norms = False           # RMSNorm on each q and k head before rotary (Qwen3)
    final_cap = 0.0              # the final logits soft-capped (Gemma 2: 30)
    norm_topk = True             # MoE: the chosen experts' gates renormalised (Mixtral)

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def hidden(self) -> int:
        return self.ffn_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def mlp_width(self) -> int:
        return self.hidden()

    def parameters(self) -> int:
        """The model's parameters, counted from the declaration (nn/family.py)."""
        return count_parameters(self)

    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_head, self.kv_heads, self.head_size())

    def rotary(self) -> Rotary:
        """The declared rotary kind with this config's settings (validated there)."""
        return rotary_of(self)

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                     "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps", "rope_factor", "rope_original_context"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("ffn_hidden", "head_dim", "sliding_window", "expert_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not self.head_dim and self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head "
                             f"({self.n_head}), or give head_dim")
        if self.head_size() % 2:
            raise ValueError(f"the head size {self.head_size()} must be even: rotary "
                             "embeddings rotate pairs of each head's dimensions")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head "
                             f"({self.n_kv_head}): each kv head serves a whole group of queries")
        rotary_of(self)
        if self.sliding_window and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} is shorter than the "
                             f"{self.block_size} positions trained: hpcdist's training "
                             "attention sees the whole block; train with --block-size <= "
                             "the window")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def describe(self) -> str:
        """The run header's words for the shape: "2x64 (4 heads, 2 kv heads"."""
        kv = f", {self.kv_heads} kv head{'s' if self.kv_heads > 1 else ''}" \
            if self.kv_heads != self.n_head else ""
        hd = f", head size {self.head_dim}" if self.head_dim else ""
        rope = f", rotary {self.rope_type}" if self.rope_type != "default" else ""
        return f"{self.n_layer}x{self.n_embd} ({self.n_head} heads{kv}{hd}{rope}"

    def anatomy(self) -> Anatomy:
        """The rotary families' parts, from the declared differences above."""
        return Anatomy(self.attention_shape(), self.hidden(), gated=True, qkv_bias=self.bias,
                       out_bias=self.bias and self.out_bias, mlp_bias=False, norm="rmsnorm",
                       norm_bias=False, rotary=True, tied=self.tie_weights,
                       scaled_embeddings=self.scale_embeddings,
                       expert_width=self.expert_hidden or self.hidden(),
                       head_norms=2 * self.head_size() if self.head_norms else 0)

    def scores(self, layer: int) -> Scores:
        """Layer ``layer``'s attention kind (kernels/attention_kinds.py; Llama's: plain)."""
        return PLAIN

    def feed_window(self) -> int:
        """The longest KV-cache window (sampling feeds rows past it one at a time)."""
        return self.sliding_window

    def qk_norms(self) -> dict:
        """The attention's seam between the projections and the core (nn/attention.py):
        ``q_norm`` / ``k_norm`` modules applied to each head, declared over the heads."""
        if not self.head_norms:
            return {}
        hd = self.head_size()
        return {"q_norm": RMSNorm(hd, self.norm_eps, self.norm_offset, over=HEADS),
                "k_norm": RMSNorm(hd, self.norm_eps, self.norm_offset, over=HEADS)}


class Attention(Module):
    def __init__(self, cfg: LlamaConfig, proj_std: float, layer: int = 0):
        shape = cfg.attention_shape()
        self.qkv = Linear(cfg.n_embd, shape.width, bias=cfg.bias, std=0.02)
        self.core = SelfAttention(shape, cfg.dropout, cfg.rotary(), cfg.sliding_window,
                                  **cfg.qk_norms(), scores=cfg.scores(layer))
        self.proj = Linear(shape.out_width, cfg.n_embd, bias=cfg.bias and cfg.out_bias,
                           std=proj_std)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, pos=None, cache: dict | None = None,
                residual: Tensor | None = None, norm=None):
        """``norm``: the result's norm too, with the residual in one pass (returns both)."""
        y = self.core(self.qkv(x), pos, cache)
        if not active(self.resid_drop):
            return self.proj(y, residual, norm)
        out = self.resid_drop(self.proj(y))
        out = out if residual is None else residual + out
        return out if norm is None else (out, norm(out))


class Block(Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): RMSNorm, rotary GQA attention, a gated MLP
    (or gated experts)."""

    attention = "attn.core"

    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.norm_offset)
        self.attn = Attention(cfg, proj_std, layer)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.norm_offset)
        H = cfg.hidden()
        if cfg.is_moe(layer):
            E = cfg.expert_hidden or H
            self.mlp = MoE(cfg.n_embd, E, cfg.experts, **moe_settings(cfg), bias=False,
                           proj_std=proj_std, dropout=cfg.dropout,
                           expert=lambda: SwiGLU(cfg.n_embd, E, False, 0.02, proj_std,
                                                 activation=cfg.activation))
        else:
            self.mlp = SwiGLU(cfg.n_embd, H, False, 0.02, proj_std, cfg.dropout,
                              activation=cfg.activation)

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
        x, h = self.attn(self.attn_norm(x), pos, cache, residual=x, norm=self.mlp_norm)
        return self.mlp(h, residual=x)


class Llama(DecoderLM):
    PARTS = {"tokens": "embed_tokens", "positions": None, "drop": "drop", "norm": "norm",
             "head": "lm_head", "loss": "lm_loss"}
    BLOCK = Block                # (a family with blocks of its own names its class)

    def __init__(self, cfg: LlamaConfig):
        cfg.validate()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.n_embd, std=0.02,
                                      multiple=cfg.vocab_multiple)
        if cfg.scale_embeddings:
            self.embed_scale = math.sqrt(cfg.n_embd)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([self.BLOCK(cfg, i) for i in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.norm_offset)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02, multiple=cfg.vocab_multiple)
        self.lm_loss = LMLoss(cfg.vocab_size, cfg.final_cap)


# ---- Hugging Face: Llama, Mistral, Mixtral folders -------------------------------------------

class LlamaHF(HFAdapter):
    """Hugging Face's Llama names: separate q, k, v (and gate, up) projections as torch
    Linears (out, in), fused into ours on load and cut back on export."""

    model_types = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "mixtral": "MixtralForCausalLM"}
    activations = ("silu",)          # config.json's hidden_act values this family computes
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}  # a block's

    def fields(self, c: dict, where: str) -> dict:
        kind = c.get("model_type")
        act = c.get("hidden_act", c.get("hidden_activation", self.activations[0]))
        if act not in self.activations:
            raise ValueError(f"{where}: activation {act!r}; this family's gated MLP is "
                             f"{' or '.join(self.activations)}")
        if c.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias is set; hpcdist's rotary families have no "
                             "MLP biases")
        C, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
        hd = int(c.get("head_dim") or C // nh)
        block = int(c.get("max_position_embeddings", 2048))
        window = int(c.get("sliding_window") or 0) if c.get("use_sliding_window", True) else 0
        window = window if 0 < window < block else 0
        if window:                      # training sees whole blocks: blocks of the window
            block = window              # (sampling runs past it, the cache kept to the window)
        out = {"n_layer": int(c["num_hidden_layers"]), "n_head": nh, "n_embd": C,
               "n_kv_head": int(c.get("num_key_value_heads") or nh),
               "head_dim": hd if hd * nh != C else 0,
               "ffn_hidden": int(c["intermediate_size"]), "vocab_size": int(c["vocab_size"]),
               "block_size": block, "sliding_window": window, **rope_fields(c, where),
               "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
               "tie_weights": bool(c.get("tie_word_embeddings", False)),
               "bias": bool(c.get("attention_bias", False))}
        if kind == "mixtral":
            out.update(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                       aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))
        return out

    def table(self, cfg) -> list:
        shape, H = cfg.attention_shape(), cfg.hidden()
        qkv = shape.pieces
        out = [Renamed("embed_tokens.weight", ("model.embed_tokens.weight",)),
               Renamed("norm.weight", ("model.norm.weight",)),
               Renamed("lm_head.weight", ("lm_head.weight",), "linear",
                       instead="model.embed_tokens.weight")]
        for i in range(cfg.n_layer):
            b, L = f"blocks.{i}.", f"model.layers.{i}."
            a = L + "self_attn."
            out += [Renamed(f"{b}{ours}.weight", (f"{L}{theirs}.weight",))
                    for ours, theirs in self.norms.items()]
            out += [Renamed(b + "attn.qkv.weight", (a + "q_proj.weight", a + "k_proj.weight",
                                                    a + "v_proj.weight"), "linear", qkv),
                    Renamed(b + "attn.qkv.bias", (a + "q_proj.bias", a + "k_proj.bias",
                                                  a + "v_proj.bias"), "same", qkv),
                    Renamed(b + "attn.proj.weight", (a + "o_proj.weight",), "linear"),
                    Renamed(b + "attn.proj.bias", (a + "o_proj.bias",))]
            if not cfg.is_moe(i):
                m = L + "mlp."
                out += [Renamed(b + "mlp.gate_up.weight", (m + "gate_proj.weight",
                                                           m + "up_proj.weight"), "linear",
                                (H, H)),
                        Renamed(b + "mlp.down.weight", (m + "down_proj.weight",), "linear")]
                continue
            m, E = L + "block_sparse_moe.", cfg.expert_hidden or H
            out.append(Renamed(b + "mlp.router.weight", (m + "gate.weight",), "linear"))
            for e in range(cfg.experts):
                x = f"{m}experts.{e}."
                out += [Renamed(f"{b}mlp.experts.{e}.gate_up.weight",
                                (x + "w1.weight", x + "w3.weight"), "linear", (E, E)),
                        Renamed(f"{b}mlp.experts.{e}.down.weight", (x + "w2.weight",),
                                "linear")]
        return out

    def model_type(self, cfg) -> str:
        return "mixtral" if cfg.experts else "mistral" if cfg.sliding_window else "llama"

    def config_json(self, cfg) -> dict:
        kind = self.model_type(cfg)
        shape = cfg.attention_shape()
        out = {"architectures": [self.model_types[kind]], "model_type": kind,
               "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.n_embd),
               "intermediate_size": int(cfg.hidden()), "num_hidden_layers": int(cfg.n_layer),
               "num_attention_heads": int(cfg.n_head), "num_key_value_heads": int(cfg.kv_heads),
               "head_dim": int(shape.head_dim), "hidden_act": self.activations[0],
               "max_position_embeddings": int(cfg.block_size),
               "sliding_window": int(cfg.sliding_window) or None,
               "rms_norm_eps": float(cfg.norm_eps), **rope_json(cfg),
               "attention_bias": bool(cfg.bias), "mlp_bias": False,
               "tie_word_embeddings": bool(cfg.tie_weights), "attention_dropout": 0.0,
               "torch_dtype": "float32"}
        if cfg.experts:
            out.update(num_local_experts=int(cfg.experts), num_experts_per_tok=int(cfg.top_k),
                       router_aux_loss_coef=float(cfg.aux_loss_coef))
        return out


# The published sizes (their Hugging Face config.json files; the Llama 3 paper, Table 3;
# Mixtral, arXiv:2401.04088), trained at the context given here (block_size).
_LLAMA3 = dict(n_kv_head=8, rope_theta=5e5, norm_eps=1e-5, block_size=8192)
_SCALED = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_context=8192)
SIZES = {
    "llama3-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_embd=8192, ffn_hidden=28672),
    "llama3-405b": dict(_LLAMA3, n_layer=126, n_head=128, n_embd=16384, ffn_hidden=53248),
    "llama3.1-8b": dict(_LLAMA3, **_SCALED, n_layer=32, n_head=32, n_embd=4096,
                        ffn_hidden=14336),
    "llama3.2-1b": dict(_LLAMA3, **dict(_SCALED, rope_factor=32.0), n_layer=16, n_head=32,
                        n_embd=2048, ffn_hidden=8192, tie_weights=True),
    "llama3.2-3b": dict(_LLAMA3, **dict(_SCALED, rope_factor=32.0), n_layer=28, n_head=24,
                        n_embd=3072, ffn_hidden=8192, tie_weights=True),
    "mistral-7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                       rope_theta=1e4, norm_eps=1e-5, block_size=4096, sliding_window=4096),
    "mixtral-8x7b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                         rope_theta=1e6, norm_eps=1e-5, block_size=4096, experts=8, top_k=2),
}

# What the planner plans the sizes with: the published vocabulary (Llama 3: 128,256; Mistral
# and Mixtral 32,000), a run's GPUs and global batch (Llama 3 405B: the paper's 16,384 GPUs).
RUNS = {"llama3-8b": dict(vocab=128256, gpus=8, batch=8),
        "llama3-70b": dict(vocab=128256, gpus=512, batch=512),
        "llama3-405b": dict(vocab=128256, gpus=16384, batch=2048),
        "llama3.1-8b": dict(vocab=128256, gpus=8, batch=8),
        "llama3.2-1b": dict(vocab=128256, gpus=8, batch=32),
        "llama3.2-3b": dict(vocab=128256, gpus=8, batch=16),
        "mistral-7b": dict(vocab=32000, gpus=8, batch=16),
        "mixtral-8x7b": dict(vocab=32000, gpus=64, batch=256)}

LLAMA = Family("llama", "Llama", LlamaConfig, Llama, LlamaHF(),
               "Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU; with "
               "--experts: Mixtral; Mistral's folders too)", sizes=SIZES, runs=RUNS)
