"""Qwen2 and Qwen2.5, declared as a family: Llama's blocks with biases on q, k and v (none on
the output projection), a rotary base of 10^6, RMSNorm's epsilon 10^-6, the head tied at the
small sizes (0.5B-3B) and untied above. What differs from Llama is this file."""
from __future__ import annotations

from dataclasses import dataclass

from .family import Family
from .llama import Llama, LlamaConfig, LlamaHF


@dataclass
class Qwen2Config(LlamaConfig):
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    bias: bool = True            # on q, k and v: Qwen2's attention always has them

    arch = "qwen2"
    out_bias = False             # the output projection: no bias


class Qwen2(Llama):
    """Llama's model over Qwen2's config (its declared differences)."""


class Qwen2HF(LlamaHF):
    """Qwen2's folders: Llama's names; q, k, v biases; ``use_sliding_window`` (off in every
    released Qwen2) honoured as Mistral's window."""

    model_types = {"qwen2": "Qwen2ForCausalLM"}

    def fields(self, c: dict, where: str) -> dict:
        out = super().fields(c, where)
        out["bias"] = True
        return out

    def model_type(self, cfg) -> str:
        if cfg.experts:
            raise ValueError("Qwen2 with experts (Qwen2-MoE) has other names and a shared "
                             "expert gate: export it as --arch llama, or train it dense")
        if cfg.sliding_window:
            raise ValueError("a Qwen2 with --sliding-window: Qwen2's folders window only "
                             "some layers (max_window_layers); export it as --arch llama")
        return "qwen2"

    def config_json(self, cfg) -> dict:
        out = super().config_json(cfg)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            out.pop(key)
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        return out


# The published sizes (Qwen2.5's config.json files), trained at 4,096 positions here.
SIZES = {
    "qwen2.5-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, ffn_hidden=4864,
                         tie_weights=True, block_size=4096),
    "qwen2.5-1.5b": dict(n_layer=28, n_head=12, n_kv_head=2, n_embd=1536, ffn_hidden=8960,
                         tie_weights=True, block_size=4096),
    "qwen2.5-7b": dict(n_layer=28, n_head=28, n_kv_head=4, n_embd=3584, ffn_hidden=18944,
                       block_size=4096),
}

# What the planner plans the sizes with: the published vocabulary, a run's GPUs and batch.
RUNS = {"qwen2.5-0.5b": dict(vocab=151936, gpus=8, batch=32),
        "qwen2.5-1.5b": dict(vocab=151936, gpus=8, batch=32),
        "qwen2.5-7b": dict(vocab=151936, gpus=8, batch=16)}

QWEN2 = Family("qwen2", "Qwen2", Qwen2Config, Qwen2, Qwen2HF(),
               "Qwen2 / Qwen2.5 (Llama with q, k, v biases, rotary base 10^6)", sizes=SIZES,
               runs=RUNS)
