"""Qwen3 and Qwen3-MoE, declared as a family: Llama's blocks with an RMSNorm on each query
and key head before rotary (over the heads: under tensor parallelism each rank norms its
own, nn/placement.py), a head size of its own, no q/k/v biases, a rotary base of 10^6 and
RMSNorm's epsilon 10^-6. With ``--experts``: Qwen3-MoE's many fine-grained SwiGLU experts,
top-k of a softmax router (renormalised over the chosen only where ``norm_topk_prob``), no
shared expert, dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say. What
differs from Llama is this file."""
from __future__ import annotations

from dataclasses import dataclass, field

from .family import Family
from .hf_adapter import Renamed
from .llama import Llama, LlamaConfig, LlamaHF, option


@dataclass
class Qwen3Config(LlamaConfig):
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    # Qwen3-MoE's layer pattern: an MoE block at layer i where (i + 1) % sparse_step == 0 and
    # i is not one of the dense layers (Hugging Face's decoder_sparse_step, mlp_only_layers)
    sparse_step: int = option(1, "Qwen3-MoE: an MoE block at each layer i with (i + 1) "
                                 "divisible by it (decoder_sparse_step)")
    dense_layers: tuple = field(default=())
    norm_topk: bool = True       # the chosen experts' gates renormalised (norm_topk_prob)

    arch = "qwen3"
    head_norms = True            # RMSNorm on each q and k head before rotary

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (layer + 1) % self.sparse_step == 0 and \
            layer not in self.dense_layers

    def validate(self) -> None:
        super().validate()
        if self.sparse_step < 1:
            raise ValueError(f"sparse_step must be positive, got {self.sparse_step}")


class Qwen3(Llama):
    """Llama's model over Qwen3's config (its declared differences)."""


class Qwen3HF(LlamaHF):
    """Qwen3's and Qwen3-MoE's folders: Llama's names plus ``q_norm`` / ``k_norm``; the MoE
    block's router ``mlp.gate`` and experts ``mlp.experts.E.{gate,up,down}_proj``."""

    model_types = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

    def fields(self, c: dict, where: str) -> dict:
        out = super().fields(c, where)
        if c.get("model_type") == "qwen3_moe":
            experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
            out.update(experts=experts, top_k=int(c["num_experts_per_tok"]),
                       expert_hidden=int(c["moe_intermediate_size"]),
                       sparse_step=int(c.get("decoder_sparse_step", 1)),
                       dense_layers=tuple(int(i) for i in c.get("mlp_only_layers") or ()),
                       norm_topk=bool(c.get("norm_topk_prob", False)),
                       aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))
        return out

    def table(self, cfg) -> list:
        out = [r for r in super().table(cfg) if ".block_sparse_moe." not in r.theirs[0]]
        H = cfg.expert_hidden or cfg.hidden()
        for i in range(cfg.n_layer):
            b, a = f"blocks.{i}.", f"model.layers.{i}.self_attn."
            out += [Renamed(b + "attn.core.q_norm.weight", (a + "q_norm.weight",)),
                    Renamed(b + "attn.core.k_norm.weight", (a + "k_norm.weight",))]
            if not cfg.is_moe(i):
                continue
            m = f"model.layers.{i}.mlp."
            out.append(Renamed(b + "mlp.router.weight", (m + "gate.weight",), "linear"))
            for e in range(cfg.experts):
                x = f"{m}experts.{e}."
                out += [Renamed(f"{b}mlp.experts.{e}.gate_up.weight",
                                (x + "gate_proj.weight", x + "up_proj.weight"), "linear",
                                (H, H)),
                        Renamed(f"{b}mlp.experts.{e}.down.weight", (x + "down_proj.weight",),
                                "linear")]
        return out

    def model_type(self, cfg) -> str:
        if cfg.sliding_window:
            raise ValueError("a Qwen3 with --sliding-window: Qwen3's folders window only some "
                             "layers (max_window_layers); export it as --arch llama")
        if cfg.experts and (cfg.shared_experts or cfg.router != "softmax"):
            raise ValueError("Qwen3-MoE has a softmax router and no shared expert: export "
                             "this model as --arch llama")
        return "qwen3_moe" if cfg.experts else "qwen3"

    def config_json(self, cfg) -> dict:
        out = super().config_json(cfg)
        kind = self.model_type(cfg)
        out.update(architectures=[self.model_types[kind]], model_type=kind,
                   use_sliding_window=False, sliding_window=None, max_window_layers=0)
        out.pop("mlp_bias")
        if cfg.experts:
            for key in ("num_local_experts",):
                out.pop(key, None)
            out.update(num_experts=int(cfg.experts), num_experts_per_tok=int(cfg.top_k),
                       moe_intermediate_size=int(cfg.expert_hidden or cfg.hidden()),
                       decoder_sparse_step=int(cfg.sparse_step),
                       mlp_only_layers=[int(i) for i in cfg.dense_layers],
                       norm_topk_prob=bool(cfg.norm_topk), router_aux_loss_coef=float(
                           cfg.aux_loss_coef))
        return out


# The published sizes (Qwen3's config.json files: heads of 128 at every size), trained at
# 4,096 positions here.
_QWEN3 = dict(head_dim=128, n_kv_head=8, block_size=4096)
SIZES = {
    "qwen3-0.6b": dict(_QWEN3, n_layer=28, n_head=16, n_embd=1024, ffn_hidden=3072,
                       tie_weights=True),
    "qwen3-1.7b": dict(_QWEN3, n_layer=28, n_head=16, n_embd=2048, ffn_hidden=6144,
                       tie_weights=True),
    "qwen3-8b": dict(_QWEN3, n_layer=36, n_head=32, n_embd=4096, ffn_hidden=12288),
    "qwen3-30b-a3b": dict(_QWEN3, n_kv_head=4, n_layer=48, n_head=32, n_embd=2048,
                          ffn_hidden=6144, experts=128, top_k=8, expert_hidden=768,
                          aux_loss_coef=0.001),
}

RUNS = {name: dict(vocab=151936, gpus=8, batch=16) for name in SIZES}
RUNS["qwen3-30b-a3b"] = dict(vocab=151936, gpus=64, batch=256)

QWEN3 = Family("qwen3", "Qwen3", Qwen3Config, Qwen3, Qwen3HF(),
               "Qwen3 (Llama with per-head q and k RMSNorm, its own head size; with "
               "--experts: Qwen3-MoE)", sizes=SIZES, runs=RUNS)
