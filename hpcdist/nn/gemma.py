"""Gemma, declared as a family: Llama's blocks with a GeGLU MLP (the tanh GELU), RMSNorm
scaling by (1 + weight), the token vectors multiplied by sqrt(n_embd), a head size of its
own (256 at 2B and 7B, independent of n_embd / n_head), the head tied to the token table,
RMSNorm's epsilon 10^-6. What differs from Llama is this file."""
from __future__ import annotations

from dataclasses import dataclass

from .family import Family
from .llama import Llama, LlamaConfig, LlamaHF


@dataclass
class GemmaConfig(LlamaConfig):
    norm_eps: float = 1e-6
    tie_weights: bool = True     # Gemma's head is always the token table

    arch = "gemma"
    activation = "gelu_tanh"     # GeGLU
    norm_offset = 1.0            # x / rms(x) * (1 + w)
    scale_embeddings = True      # the token vectors times sqrt(n_embd)

    def validate(self) -> None:
        super().validate()
        if not self.tie_weights:
            raise ValueError("Gemma's head is the token table (tie_weights): hpcdist's Gemma "
                             "has no untied head")


class Gemma(Llama):
    """Llama's model over Gemma's config (its declared differences)."""


class GemmaHF(LlamaHF):
    """Gemma's folders: Llama's names; the norms' weights stored as the w of (1 + w), as
    ours are; GELU's tanh form under either of its names."""

    model_types = {"gemma": "GemmaForCausalLM"}
    activations = ("gelu_pytorch_tanh", "gelu")    # ("gelu": old configs' name for it)

    def fields(self, c: dict, where: str) -> dict:
        out = super().fields(c, where)
        out["tie_weights"] = True
        return out

    def model_type(self, cfg) -> str:
        if cfg.experts or cfg.sliding_window:
            raise ValueError("Gemma has no mixture-of-experts or sliding-window form in "
                             "transformers (Gemma 2's alternates windows by layer)")
        return "gemma"

    def config_json(self, cfg) -> dict:
        out = super().config_json(cfg)
        out.pop("mlp_bias")
        out.pop("sliding_window")
        out["hidden_activation"] = out["hidden_act"]
        return out


# The published sizes (Gemma's config.json files: heads of 256 at both).
SIZES = {
    "gemma-2b": dict(n_layer=18, n_head=8, n_kv_head=1, n_embd=2048, head_dim=256,
                     ffn_hidden=16384, block_size=8192),
    "gemma-7b": dict(n_layer=28, n_head=16, n_kv_head=16, n_embd=3072, head_dim=256,
                     ffn_hidden=24576, block_size=8192),
}

# What the planner plans the sizes with: the published vocabulary, a run's GPUs and batch.
RUNS = {name: dict(vocab=256000, gpus=8, batch=16) for name in SIZES}

GEMMA = Family("gemma", "Gemma", GemmaConfig, Gemma, GemmaHF(),
               "Gemma (Llama with GeGLU, (1 + w) RMSNorm, embeddings x sqrt(n_embd), "
               "its own head size)", sizes=SIZES, runs=RUNS)
