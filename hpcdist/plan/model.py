"""The planner's vocabulary: a model (any family, counted from its declaration), a layout, an
estimate, the assumptions (``Settings``) and what a framework offers (``FEATURES``). The cards
and the published runs: facts.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import functools
from functools import cached_property

from .. import nn
from ..nn.family import DEFAULT_ARCH

from .facts import GB, PRESETS

# the config fields the planner's own words set (the rest: ``Model.settings``)
_SHAPE = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "seq": "block_size",
          "vocab": "vocab_size", "experts": "experts", "top_k": "top_k",
          "expert_hidden": "expert_hidden", "moe_every": "moe_every",
          "vocab_multiple": "vocab_multiple"}


@dataclass(frozen=True)
class Model:
    """A model as the planner counts it: a family (``arch``: any registered in nn/, GPT-2 by
    default) of ``layers`` blocks ``hidden`` wide with ``heads`` query heads, trained at
    ``seq`` positions over ``vocab`` tokens, with the family's own ``settings`` ((name, value)
    pairs by its config's names, as the trainer's flags set them: kv heads, MLP width, head
    size, rotary base ...), ``tied`` and ``bias`` (None: the family's). Parameters, FLOPs and memory
    read the family's declaration (``anatomy``: nn/family.py), never its name."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    experts: int = 0            # routed experts of an MoE layer (0: dense MLPs)
    top_k: int = 2
    expert_hidden: int = 0      # an expert's MLP width (0: the dense MLP's)
    moe_every: int = 1          # an MoE MLP in every n-th block, from block 0
    arch: str = DEFAULT_ARCH
    settings: tuple = ()        # the family's own settings: (("n_kv_head", 8), ...)
    tied: bool | None = None    # the head tied to the token table (None: the family's)
    bias: bool | None = None    # the family's biases on (None: the family's)
    vocab_multiple: int = 1     # the table and head padded to multiples of it x TP (train's
                                # --vocab-multiple: 64 on a GPU)

    @classmethod
    def of(cls, config, seq: int | None = None, vocab: int | None = None) -> "Model":
        """The planner's model of a family config (nn/<family>.py), at ``seq`` positions
        (default: its block_size) over ``vocab`` tokens (default: its vocab_size)."""
        values = {k: getattr(config, name) for k, name in _SHAPE.items()}
        values.update(seq=seq or values["seq"], vocab=vocab or values["vocab"])
        defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
        own = tuple((n, getattr(config, n)) for n in nn.own_settings(config.arch)
                    if getattr(config, n) != defaults[n])
        return cls(**values, arch=config.arch, settings=own, tied=config.tie_weights,
                   bias=config.bias)

    @property
    def config(self):
        """The family's config of this shape (ValueError: a setting it refuses)."""
        return _config(self)

    @property
    def anatomy(self):
        return _anatomy(self)

    @property
    def family(self):
        return nn.family(self.arch)

    def vocab_rows(self, tp: int) -> int:
        """The token table's (and head's) rows one of ``tp`` ranks holds: the vocabulary
        padded to a multiple of vocab_multiple x tp, split tp ways."""
        unit = self.vocab_multiple * tp
        return -(-self.vocab // unit) * unit // tp

    @property
    def head_tied(self) -> bool:
        return self.anatomy.tied

    @property
    def kv_heads(self) -> int:
        return self.anatomy.attention.n_kv_head

    @property
    def kv_width(self) -> int:
        """k's (and v's) width: kv heads x head size."""
        shape = self.anatomy.attention
        return shape.n_kv_head * shape.head_dim

    @property
    def attention_width(self) -> int:
        """Attention's inner width, heads x head size (n_embd unless the family sets a head
        size of its own)."""
        return self.anatomy.attention.out_width

    @property
    def mlp_width(self) -> int:
        return self.anatomy.mlp_width

    @property
    def matmul_weights(self) -> int:
        """A dense block's weights in matmuls: q|k|v, the output projection, the MLP's (GPT-2:
        12h^2)."""
        a, h = self.anatomy, self.hidden
        up = 2 * a.mlp_width if a.gated else a.mlp_width
        return h * a.attention.width + a.attention.out_width * h + h * up + a.mlp_width * h

    def lora_parameters(self, rank: int, tp: int) -> float:
        """A dense block's LoRA adapters (every linear adapted: ``--lora-targets
        all-linear``) on one of ``tp`` ranks: one A (in, r) and one B (r, out) per Hugging
        Face module, a column-parallel layer's B and a row-parallel one's A cut over TP.
        Gated families have q, k, v and gate, up as modules of their own; GPT-2 fuses each."""
        a, h = self.anatomy, self.hidden
        up = 2 * a.mlp_width if a.gated else a.mlp_width
        pieces_qkv, pieces_up = (3, 2) if a.gated else (1, 1)
        return rank * (pieces_qkv * h + a.attention.width / tp            # q | k | v
                       + a.attention.out_width / tp + h                    # the output
                       + pieces_up * h + up / tp                           # gate | up
                       + a.mlp_width / tp + h)                             # down

    @property
    def block_split(self) -> int:
        """A dense block's parameters tensor parallelism splits (matmuls, column biases)."""
        return self.matmul_weights + self.anatomy.column_biases()

    @property
    def block_whole(self) -> int:
        """... and those every TP rank holds whole (norms, per-head norms, row-parallel
        biases)."""
        a = self.anatomy
        return 2 * a.norm_size * self.hidden + a.head_norms + a.row_biases(self.hidden)

    @property
    def norm_size(self) -> int:
        """One norm's parameters (the final norm's)."""
        return self.anatomy.norm_size * self.hidden

    @property
    def mlp_params(self) -> int:
        """A dense block's MLP, weights and biases (GPT-2: 8h^2 + 5h)."""
        return self.anatomy.mlp_parameters(self.hidden)

    @property
    def mlp_whole(self) -> int:
        """... of which every TP rank holds whole (the down projection's bias)."""
        return int(self.anatomy.mlp_bias) * self.hidden

    @property
    def expert_matmuls(self) -> int:
        """An expert's (and the dense MLP's) matmuls: three gated, two not."""
        return 3 if self.anatomy.gated else 2

    @property
    def positions(self) -> int:
        """The learned position table's parameters (rotary: none)."""
        return 0 if self.anatomy.rotary else self.seq * self.hidden

    @property
    def moe_layers(self) -> int:
        """The blocks with experts, as the family's config places them (``is_moe``: one in
        ``moe_every`` from block 0, or the family's own pattern)."""
        if not self.experts:
            return 0
        cfg = self.config
        return sum(1 for i in range(self.layers) if cfg.is_moe(i))

    @property
    def expert_size(self) -> int:
        """One expert's parameters (GPT-2's: 2hf + f + h, two linears with biases)."""
        return self.anatomy.mlp_parameters(self.hidden, self.anatomy.expert_width)

    def moe_change(self, experts_per_token: float) -> float:
        """Parameters the MoE blocks add to a dense model's: each MoE block's MLP replaced by
        its router (hE) and ``experts_per_token`` experts."""
        h = self.hidden
        return self.moe_layers * (h * self.experts + experts_per_token * self.expert_size
                                  - self.mlp_params)

    @cached_property
    def parameters(self) -> float:
        """The family's count from its declaration (nn/family.py ``count_parameters``): the
        blocks, the token table, a learned position table, the final norm, an untied head;
        with experts, every expert of an MoE block."""
        return self.config.parameters()

    @property
    def active_parameters(self) -> float:
        """What one token meets: an MoE block's top-k experts of its E."""
        return self.parameters - self.moe_change(self.experts) + self.moe_change(self.top_k)

    def flops(self, batch: int, recompute: bool) -> float:
        """FLOPs of one iteration on ``batch`` sequences: ``flops_per_token`` of the active
        parameters (the count the training run reports too; Narayanan et al. 2021's eq. 3 up
        to the biases; torchtitan's for Llama), plus one more forward of the blocks under
        full recompute."""
        B, s, l, d = batch, self.seq, self.layers, self.attention_width
        windows = layer_windows(_config(self))
        per_token = flops_per_token(self.active_parameters - self.positions, l, d, s, windows)
        extra = 2 * l * self.matmul_weights + 4 * d * attended(l, s, windows) + \
            2 * self.moe_change(self.top_k) if recompute else 0
        return B * s * (per_token + extra)


@functools.lru_cache(maxsize=512)
def _config(model: Model):
    """``Model.config``, made once per model (the search asks it of every layout, and of a
    copy at each context-parallel size)."""
    fam = nn.family(model.arch)
    given = {name: getattr(model, k) for k, name in _SHAPE.items()}
    given.update(dict(model.settings))
    if model.tied is not None:
        given["tie_weights"] = model.tied
    if model.bias is not None:
        given["bias"] = model.bias
    known = {f.name for f in dataclasses.fields(fam.config)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"the {fam.title} family has no {', '.join(unknown)}")
    cfg = fam.config(**given)
    cfg.validate()
    return cfg


@functools.lru_cache(maxsize=512)
def _anatomy(model: Model):
    return _config(model).anatomy()


def preset(name: str) -> Model:
    """The planner's model of a published size (its family's SIZES and ``PRESETS``'
    vocabulary)."""
    arch, shape = nn.size(name)
    vocab = PRESETS.get(name, {}).get("vocab")
    config = nn.family(arch).config(**dict(shape, **({"vocab_size": vocab} if vocab
                                                              else {})))
    return Model.of(config)


def flops_per_token(params: float, layers: int, width: int, seq: int,
                    windows: tuple = ()) -> float:
    """Training FLOPs per token as the peers count them (PaLM's appendix, nanoGPT, llm.c):
    6N for every weight's matmuls forward and backward (N without the position table),
    plus attention's 12 L d T (Q K^T and the weighted sum of V, forward and backward; d
    the heads' width); ``windows``: each layer's (0: global), a local layer's keys min(T, w)."""
    return 6 * params + 12 * width * attended(layers, seq, windows)


def attended(layers: int, seq: int, windows: tuple = ()) -> int:
    """The keys a token's attention reads over the layers: L T, or sum min(T, window)."""
    return sum(min(seq, w) if w else seq for w in windows) if windows else layers * seq


def layer_windows(cfg) -> tuple:
    """Each layer's attention window (0: global) from a family's config (``scores``)."""
    return tuple(cfg.scores(i).window for i in range(cfg.n_layer)) \
        if hasattr(cfg, "scores") else ()


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int
    micro_batches: int
    schedule: str
    virtual: int
    recompute: bool
    sp: bool
    cp: int = 1                 # context parallel: each sequence split over cp ranks
    cp_impl: str = "ring"       # ring | ulysses
    split: tuple = ()           # blocks per pipeline stage when not even (() = even)
    shard: int = 0              # ZeRO sharded over groups of this many ranks, replicated
                                # across them (hybrid sharding; 0: over all of DP x CP)
    ep: int = 1                 # expert parallel: each MoE layer's experts over ep of DP

    def stages(self, layers: int) -> tuple:
        """Blocks on each pipeline stage."""
        return self.split or (layers // self.pp,) * self.pp


def stage_splits(layers: int, pp: int) -> list:
    """The splits of ``layers`` blocks over ``pp`` stages the search considers: as even as
    possible with the extra blocks on the middle stages (the first stage embeds, the last
    holds the head), and, where every stage keeps a block, the ends one block lighter
    still. () stands for the even split. Empty when some stage would get no block."""
    if pp == 1:
        return [()]
    if layers < pp:
        return []
    base, extra = divmod(layers, pp)
    middle = [base] * (pp - 2)
    for i in range(extra):
        if i < pp - 2:
            middle[i % (pp - 2)] += 1
    first = base + (1 if extra > pp - 2 else 0)
    splits = [() if extra == 0 else (first, *middle, base)]
    if pp > 2 and base >= 2:                       # lighter ends: one block each to the middle
        lighter = [first - 1, *middle, base - 1]
        for i in range(2):
            lighter[1 + i % (pp - 2)] += 1
        splits.append(tuple(lighter))
    return splits


@dataclass
class Estimate:
    layout: Layout
    memory: dict = field(default_factory=dict)     # bytes per GPU by kind (first/last max)
    step_s: float = 0.0
    parts: dict = field(default_factory=dict)      # seconds: compute, tp, pp, dp, bubble...
    bubble: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    fits: bool = True
    why: str = ""

    def row(self) -> dict:
        L = self.layout
        return {"tp": L.tp, "pp": L.pp, "dp": L.dp, "cp": L.cp, "ep": L.ep,
                "cp_impl": L.cp_impl if L.cp > 1 else "-",
                "split": ",".join(map(str, L.split)) or "even", "zero": L.zero,
                "shard": "node" if L.shard else "all",
                "micro_batch": L.micro_batch, "micro_batches": L.micro_batches,
                "schedule": L.schedule + (f" v{L.virtual}" if L.virtual > 1 else ""),
                "recompute": "full" if L.recompute else "none", "sp": L.sp,
                "memory_gb": self.memory.get("total", 0.0) / GB, "step_s": self.step_s,
                "tflops_per_gpu": self.tflops_per_gpu / 1e12, "mfu": self.mfu,
                "bubble": self.bubble,
                "comm_share": (self.parts.get("tp", 0) + self.parts.get("pp", 0)
                               + self.parts.get("dp", 0) + self.parts.get("cp", 0)
                               + self.parts.get("ep", 0))
                / self.step_s if self.step_s else 0.0}


@dataclass(frozen=True)
class Settings:
    """What the estimate assumes beyond the card: the fraction of the peak a transformer
    layer's matmuls reach (Narayanan et al. measured 44-52% end to end on A100; a GEMM alone
    reaches more), bytes per parameter of mixed-precision Adam, fixed buffers."""
    efficiency: float = 0.62
    dtype: str = "bf16"
    buffers: float = 2 * GB           # CUDA context, communication buckets, workspace
    grad_bytes: int = 4               # fp32 gradient accumulation and reduction
    param_bytes: int = 2              # bf16 parameters (4: an fp32 run)
    optimizer_bytes: int = 12         # fp32 master + Adam's two moments (8: an fp32 run)
    # LoRA (nn/lora.py): adapters of this rank on every block linear, the base frozen (its
    # parameters at param_bytes, or base_bits a block weight: NF4's 4.127), no gradient or
    # optimizer state for it, not sharded by ZeRO (hpcdist's ZeRO-3 keeps the base whole)
    lora_rank: int = 0
    base_bits: float = 0.0
    # Costs a FLOP count misses (0 for a GPU's fused kernels at scale; calibrated for a CPU
    # run by ``bench plan``): seconds per layer per forward (a backward costs two), seconds
    # per byte of activations a layer writes in forward (memory-bound elementwise work:
    # LayerNorms, GELU, residuals, softmax; hpcdist's layers, a backward twice), and per
    # collective call inside the step beyond the link's alpha
    layer_overhead: float = 0.0
    byte_cost: float = 0.0
    call_overhead: float = 0.0
    # more ranks than cores (an oversubscribed CPU run): a rank idle in the pipeline's bubble
    # leaves its core to another, so a step takes at least the busy time, at most the
    # critical path at a whole core's speed
    ranks_per_core: float = 1.0
    memory_headroom: float = 0.95     # of the card usable for the above
    activations: str = "megatron"     # whose layers: "megatron" (Korthikanti) | "hpcdist"
    # hpcdist's fused kernels run (a GPU's; the CPU's on ops of >= device/kernels/cpu.py's
    # MIN_SIZE elements): no LayerNorm x-hat, GELU tanh or attention probabilities kept
    fused_kernels: bool = True
    # attention's (s, s) probabilities kept for backward: only by the GPU's --attention
    # gemms and Megatron-LM 2021's unfused layers (Korthikanti's 5as/ht term); tiled
    # attention, every device's default (ring and Ulysses steps too), keeps the log-sum-exp
    attention_probs: bool | None = None
    tp_across_nodes: bool = False
    # the share of the experts' all-to-all hidden behind compute (hpcdist: 0, the dispatch
    # waits; DeepSeek-V3's DualPipe overlaps all of it)
    ep_overlap: float = 0.0
    # what the framework offers (``FEATURES``): SP, ZeRO levels, pipeline schedules
    sequence_parallel: bool = True
    zero_levels: tuple = (0, 1, 2, 3)
    schedules: tuple | None = None    # None: every registered one (parallel/schedules.py)
    cp_sizes: tuple = (1, 2, 4, 8)    # context parallelism (ring attention or all-to-all)
    cp_impls: tuple = ("ring", "ulysses")
    uneven_splits: bool = True        # pipeline splits with lighter first and last stages


# The search restricted to what a framework offered: "megatron-2021" is Megatron-LM as
# Narayanan et al. ran it (SC21): no distributed optimizer (ZeRO), no sequence parallelism
# (Korthikanti et al. 2022), 1F1B and their interleaved schedule (ZB-H1 is 2023's), no
# context parallelism, layers divided evenly over the stages, attention's probabilities
# kept for backward (FlashAttention is 2022's).
FEATURES = {
    "all": {},
    "megatron-2021": {"sequence_parallel": False, "zero_levels": (0,),
                      "schedules": ("1f1b", "interleaved"), "cp_sizes": (1,),
                      "uneven_splits": False, "attention_probs": True},
}
