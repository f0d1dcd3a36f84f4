"""GPT: a decoder-only transformer in the style of GPT-2 / nanoGPT, declared as a family
(nn/family.py): learned positions, pre-norm LayerNorm blocks, multi-head attention from one
fused projection, a GELU MLP, a head tied to the token table."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..autograd import ops
from ..autograd.tensor import Tensor
from .attention import SelfAttention
from .family import Anatomy, AttentionShape, DecoderLM, Family, Projection, count_parameters
from .hf_adapter import HFAdapter, Renamed
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear, active
from .module import Module, ModuleList
from .moe import MoE, moe_settings


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
    norm_eps: float = field(default=1e-5, metadata={"help": "the norms' epsilon"})
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

    def mlp_width(self) -> int:
        return 4 * self.n_embd

    def parameters(self) -> int:
        """The model's parameters, counted from the declaration (nn/family.py)."""
        return count_parameters(self)

    def validate(self) -> None:
        for name in ("block_size", "vocab_size", "vocab_multiple", "n_layer", "n_head",
                     "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")

    def describe(self) -> str:
        """The run header's words for the shape: "2x64 (4 heads"."""
        return f"{self.n_layer}x{self.n_embd} ({self.n_head} heads"

    def anatomy(self) -> Anatomy:
        """GPT-2's parts: LayerNorms, learned positions, a GELU MLP of 4 x n_embd, biases
        everywhere (or nowhere: bias), the head tied or not."""
        return Anatomy(self.attention_shape(), self.mlp_width(), gated=False,
                       qkv_bias=self.bias, out_bias=self.bias, mlp_bias=self.bias,
                       norm="layernorm", norm_bias=self.bias, rotary=False,
                       tied=self.tie_weights, expert_width=self.expert_hidden or self.mlp_width())


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias, std=0.02)
        self.core = SelfAttention(cfg.attention_shape(), cfg.dropout)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=proj_std)
        self.resid_drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, pos=None, cache: dict | None = None,
                residual: Tensor | None = None, norm=None):
        """``cache``: this layer's KV cache (inference); ``residual``: added to the output
        (with the projection's bias, in one pass); ``norm``: the result's norm too, in that
        pass (returns both)."""
        y = self.core(self.c_attn(x), pos, cache)
        if not active(self.resid_drop):
            return self.c_proj(y, residual, norm)
        out = _add(self.resid_drop(self.c_proj(y)), residual)
        return out if norm is None else (out, norm(out))


def _add(out: Tensor, residual: Tensor | None) -> Tensor:
    return out if residual is None else residual + out


class Block(Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    attention = "attn.core"            # the path of its attention core (context parallelism)

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.norm_eps, bias=cfg.bias)
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        if cfg.is_moe(layer):
            self.mlp = MoE(cfg.n_embd, cfg.expert_hidden or 4 * cfg.n_embd, cfg.experts,
                           **moe_settings(cfg), bias=cfg.bias, proj_std=proj_std,
                           dropout=cfg.dropout)
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
        x, h = self.attn(self.ln_1(x), pos, cache, residual=x, norm=self.ln_2)
        return self.mlp(h, residual=x)           # x + attn(ln(x)), then x + mlp(ln(x))


class LMLoss(Module):
    """Logits -> (logits, mean cross-entropy of the targets), or the logits alone without
    targets. A module of its own so that a parallel version (each rank a slice of the
    vocabulary, or of the sequence) can take its place. ``vocab_size``: the vocabulary, where
    the head is padded past it (``vocab_multiple``): the padding columns are left out of the
    loss, and the logits it returns outside training (evaluation, sampling) are the
    vocabulary's alone; in training they are returned as computed (padded, no copy).
    ``cap``: the logits soft-capped first (ops.softcap; Gemma 2's final_logit_softcapping),
    in the loss and in what sampling reads alike."""

    def __init__(self, vocab_size: int | None = None, cap: float = 0.0):
        self.vocab_size, self.cap = vocab_size, cap

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        if self.cap:
            logits = ops.softcap(logits, self.cap)
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
        self.ln_f = LayerNorm(cfg.n_embd, cfg.norm_eps, bias=cfg.bias)
        self.lm_head = None if cfg.tie_weights else \
            Linear(cfg.n_embd, cfg.vocab_size, bias=False, std=0.02, multiple=cfg.vocab_multiple)
        self.lm_loss = LMLoss(cfg.vocab_size)


# ---- Hugging Face GPT-2 folders, and nanoGPT's names ------------------------------------------

class GPT2HF(HFAdapter):
    """Hugging Face's GPT-2: its Conv1D weights stored (in, out), as ours are; an untied
    ``lm_head`` a torch Linear (out, in); names with or without "transformer."."""

    model_types = {"gpt2": "GPT2LMHeadModel"}

    def fields(self, c: dict, where: str) -> dict:
        if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{where}: activation {c['activation_function']!r}; hpcdist's "
                             "GELU is the tanh approximation (gelu_new)")
        return {"n_layer": int(c["n_layer"]), "n_head": int(c["n_head"]),
                "n_embd": int(c["n_embd"]), "vocab_size": int(c["vocab_size"]),
                "block_size": int(c.get("n_positions", c.get("n_ctx", 1024))),
                "tie_weights": bool(c.get("tie_word_embeddings", True)), "bias": True,
                "norm_eps": float(c.get("layer_norm_epsilon", 1e-5))}

    def table(self, cfg) -> list:
        out = [Renamed("wte.weight", ("transformer.wte.weight",)),
               Renamed("wpe.weight", ("transformer.wpe.weight",)),
               Renamed("ln_f.weight", ("transformer.ln_f.weight",)),
               Renamed("ln_f.bias", ("transformer.ln_f.bias",)),
               Renamed("lm_head.weight", ("lm_head.weight",), "linear",
                       instead="transformer.wte.weight")]
        ours = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.c_attn": "attn.c_attn",
                "attn.c_proj": "attn.c_proj", "mlp.layers.0": "mlp.c_fc",
                "mlp.layers.1": "mlp.c_proj"}
        for i in range(cfg.n_layer):
            for mine, theirs in ours.items():
                for p in ("weight", "bias"):
                    out.append(Renamed(f"blocks.{i}.{mine}.{p}",
                                       (f"transformer.h.{i}.{theirs}.{p}",)))
        return out

    def lookup(self, theirs: dict, name: str):
        value = theirs.get(name)
        return theirs.get(name.replace("transformer.", "", 1)) if value is None else value

    def to_theirs(self, cfg, params: dict) -> dict:
        """... biases a ``--no-bias`` model lacks as zeros (GPT-2 always has them)."""
        if cfg.experts:
            raise ValueError(f"a mixture-of-experts model ({cfg.experts} experts per MoE "
                             "layer) has no GPT-2 form: Hugging Face's GPT-2 has no experts "
                             "(export refuses it; python -m hpcdist.sample reads it)")
        out = super().to_theirs(cfg, params)
        C = cfg.n_embd
        widths = {"ln_1": C, "ln_2": C, "attn.c_attn": 3 * C, "attn.c_proj": C,
                  "mlp.c_fc": 4 * C, "mlp.c_proj": C}
        for i in range(cfg.n_layer):
            for part, width in widths.items():
                out.setdefault(f"transformer.h.{i}.{part}.bias", np.zeros(width, np.float32))
        out.setdefault("transformer.ln_f.bias", np.zeros(C, np.float32))
        return out

    def config_json(self, cfg) -> dict:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": int(cfg.vocab_size), "n_positions": int(cfg.block_size),
                "n_embd": int(cfg.n_embd), "n_layer": int(cfg.n_layer),
                "n_head": int(cfg.n_head), "n_inner": 4 * int(cfg.n_embd),
                "activation_function": "gelu_new", "layer_norm_epsilon": float(cfg.norm_eps),
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": bool(cfg.tie_weights), "bos_token_id": 0,
                "eos_token_id": 0, "torch_dtype": "float32"}


# our name -> (nanoGPT's name, transposed?): our Linear stores (in, out), torch (out, in)
_NANOGPT = [
    (r"wte\.weight", "transformer.wte.weight", False),
    (r"wpe\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln_(\d)\.(weight|bias)", r"transformer.h.\1.ln_\2.\3", False),
    (r"blocks\.(\d+)\.attn\.(c_attn|c_proj)\.weight", r"transformer.h.\1.attn.\2.weight", True),
    (r"blocks\.(\d+)\.attn\.(c_attn|c_proj)\.bias", r"transformer.h.\1.attn.\2.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"lm_head\.weight", "lm_head.weight", True),
]


def nanogpt_names(params: dict) -> dict:
    """Our parameters under nanoGPT's names and layouts; a tied head becomes lm_head.weight."""
    out = {}
    for name, value in params.items():
        for pattern, target, transpose in _NANOGPT:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, target, name)] = value.T.copy() if transpose else value
                break
        else:
            raise ValueError(f"no nanoGPT name for {name!r}")
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])      # tied
    return out


# The published sizes (OpenAI's GPT-2 release: 124M, 350M, 774M, 1558M; 1,024 positions).
SIZES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
         "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
         "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
         "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024)}

# What the planner plans the sizes with: the published vocabulary, a run's GPUs and batch.
RUNS = {name: dict(vocab=50257, gpus=8, batch=64) for name in SIZES}

GPT_FAMILY = Family("gpt", "GPT", GPTConfig, GPT, GPT2HF(),
                    "GPT-2 (LayerNorm, learned positions, GELU MLP, tied head)",
                    exports=(("nanogpt", nanogpt_names),), sizes=SIZES, runs=RUNS)
