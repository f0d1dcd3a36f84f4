"""Gemma 2, declared as a family: Gemma's blocks with a norm after each sublayer as well as
before it (four RMSNorms a block), attention logits soft-capped (cap tanh(s / cap), 50),
the final logits capped (30), a softmax scale of query_pre_attn_scalar^-1/2 instead of the
head size's, and local (sliding-window, 4,096) and global layers alternating: each layer's
attention kind is data (``scores``; the local layers from config.json's ``layer_types``,
else every even layer as transformers has it). What differs from Gemma is this file."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..autograd.tensor import Tensor
from ..device.kernels.attention_kinds import Scores
from .family import Family
from .gemma import GemmaConfig, GemmaHF
from .layers import RMSNorm
from .llama import Block, Llama, option


@dataclass
class Gemma2Config(GemmaConfig):
    attn_cap: float = option(50.0, "Gemma 2: attention logits soft-capped at this "
                                   "(attn_logit_softcapping; 0: none)")
    final_cap: float = option(30.0, "Gemma 2: final logits soft-capped at this "
                                    "(final_logit_softcapping; 0: none)")
    query_scalar: float = option(256.0, "Gemma 2: the softmax scale is this^-1/2 "
                                        "(query_pre_attn_scalar)")
    local_window: int = option(4096, "Gemma 2: the local layers' sliding window")
    local_layers: str = option("", "Gemma 2: the local layers, comma-separated (empty: every "
                                   "even layer, as transformers has it; none: no layer)")

    arch = "gemma2"

    def local(self) -> tuple:
        """The local layers' indices (``local_layers`` read)."""
        if not self.local_layers:
            return tuple(range(0, self.n_layer, 2))
        if self.local_layers == "none":
            return ()
        try:
            return tuple(int(i) for i in self.local_layers.split(","))
        except ValueError:
            raise ValueError(f"Gemma 2's local_layers is a comma-separated list of layers "
                             f"(or none), got {self.local_layers!r}") from None

    def is_local(self, layer: int) -> bool:
        return layer in self.local()

    def scores(self, layer: int) -> Scores:
        # (kept at any block: sampling runs past the block, the window still bounds the
        # local layers' cache; a step of T <= window drops it: Scores.within)
        window = self.local_window if self.is_local(layer) else 0
        return Scores(scale=self.query_scalar ** -0.5, cap=self.attn_cap, window=window)

    def anatomy(self):
        return dataclasses.replace(super().anatomy(), block_norms=4)

    def feed_window(self) -> int:
        return max((self.scores(i).window for i in range(self.n_layer)), default=0)

    def validate(self) -> None:
        super().validate()
        if any(not 0 <= i < self.n_layer for i in self.local()):
            raise ValueError(f"Gemma 2's local_layers {self.local_layers!r} names a layer "
                             f"outside 0..{self.n_layer - 1}")
        if self.query_scalar <= 0 or self.local_window < 1:
            raise ValueError(f"Gemma 2's query_scalar must be positive and its local window "
                             f"1 or more, got {self.query_scalar}, {self.local_window}")


class Gemma2Block(Block):
    """x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x)))."""

    def __init__(self, cfg: Gemma2Config, layer: int = 0):
        super().__init__(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.norm_offset)
        self.post_mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps, cfg.norm_offset)

    def forward(self, x: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), pos, cache))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Gemma2(Llama):
    """Llama's model over Gemma 2's config and blocks."""
    BLOCK = Gemma2Block


class Gemma2HF(GemmaHF):
    """Gemma 2's folders: Gemma's names, where ``post_attention_layernorm`` is the norm after
    the attention (Llama's name for the one before the MLP, which Gemma 2 calls
    ``pre_feedforward_layernorm``) and ``post_feedforward_layernorm`` the one after it."""

    model_types = {"gemma2": "Gemma2ForCausalLM"}
    norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm",
             "post_mlp_norm": "post_feedforward_layernorm"}

    def fields(self, c: dict, where: str) -> dict:
        out = super().fields({**c, "sliding_window": None}, where)
        n = out["n_layer"]
        kinds = c.get("layer_types")
        local = [i for i, k in enumerate(kinds) if k == "sliding_attention"] if kinds \
            else list(range(0, n, 2))
        out.update(attn_cap=float(c.get("attn_logit_softcapping") or 0.0),
                   final_cap=float(c.get("final_logit_softcapping") or 0.0),
                   query_scalar=float(c.get("query_pre_attn_scalar") or out["head_dim"] or
                                      out["n_embd"] // out["n_head"]),
                   local_window=int(c.get("sliding_window") or 4096),
                   local_layers=",".join(map(str, local)) or "none")
        return out

    def model_type(self, cfg) -> str:
        if cfg.experts:
            raise ValueError("Gemma 2 has no mixture-of-experts form in transformers")
        return "gemma2"

    def config_json(self, cfg) -> dict:
        out = super().config_json(cfg)
        n = int(cfg.n_layer)
        out.update(attn_logit_softcapping=float(cfg.attn_cap) or None,
                   final_logit_softcapping=float(cfg.final_cap) or None,
                   query_pre_attn_scalar=int(cfg.query_scalar) if
                   float(cfg.query_scalar).is_integer() else float(cfg.query_scalar),
                   sliding_window=int(cfg.local_window),
                   layer_types=["sliding_attention" if cfg.is_local(i) else "full_attention"
                                for i in range(n)])
        return out


GEMMA2 = Family("gemma2", "Gemma 2", Gemma2Config, Gemma2, Gemma2HF(),
                "Gemma 2 (Gemma with norms after each sublayer too, soft-capped attention "
                "and final logits, local and global layers alternating)")
