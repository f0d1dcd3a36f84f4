"""The planner's vocabulary: cards and their links (vendors' datasheets), the published runs
it is checked against, a model, a layout, an estimate, the assumptions (``Settings``) and
what a framework offers (``FEATURES``)."""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class GPU:
    """A card and its links: dense peak FLOP/s per dtype, memory, NVLink per direction and
    the network per GPU (bytes/s), and each link's latency."""
    name: str
    flops: dict
    memory: float
    nvlink: float
    network: float
    nvlink_alpha: float = 5e-6
    network_alpha: float = 10e-6


# Vendors' datasheets: A100 (SXM) 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, 156 tf32; NVLink 3
# 600 GB/s per GPU (300 each way); HDR InfiniBand 200 Gb/s per GPU in a DGX A100. H100 SXM
# 989 TFLOP/s bf16 dense, 67 fp32, 80 GB; NVLink 4 900 GB/s (450 each way); NDR 400 Gb/s per
# GPU in a DGX H100. H200: H100's compute, 141 GB. H800: H100's compute with NVLink cut to
# 400 GB/s; DeepSeek-V3's report (arXiv:2412.19437, section 3.2.2) measured 160 GB/s NVLink and
# 50 GB/s InfiniBand per GPU on its cluster: those are used.
HARDWARE = {
    "a100-40g": GPU("A100 40GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    40 * GB, 300 * GB, 25 * GB),
    "a100-80g": GPU("A100 80GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    80 * GB, 300 * GB, 25 * GB),
    "h100": GPU("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                80 * GB, 450 * GB, 50 * GB),
    "h200": GPU("H200 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                141 * GB, 450 * GB, 50 * GB),
    "h800": GPU("H800 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                80 * GB, 160 * GB, 50 * GB),
}


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC21, Table 1 (weak scaling on A100 80GB; seq 2048, vocab 51200): parameters
# (billions), heads, hidden, layers, TP, PP, GPUs, global batch, achieved TFLOP/s per GPU.
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


# DeepSeek-V3 (arXiv:2412.19437): 61 layers, hidden 7168, 128 heads, 4096 positions, 129,280
# tokens; 256 routed experts of width 2048 (SwiGLU: 3 x 7168 x 2048 weights each) and one shared
# expert, 8 routed per token; the first 3 blocks dense (width 18432). Trained on 2048 H800 with PP
# 16, EP 64 (over 8 nodes), ZeRO-1 data parallelism, no TP, global batch 15,360; "180K H800 GPU
# hours per trillion tokens" (1,543 tokens/s per GPU), FP8 GEMMs, DualPipe overlapping the
# all-to-all with compute. In hpcdist's GPT (GELU experts, MHA, every block MoE): expert width
# 3072 (2 x 7168 x 3072 = the SwiGLU expert's weights), top-9 (the shared expert counted as a
# ninth, always chosen); a dense block's MLP has the active weights of 9 experts, so active
# parameters match (37.8 B against 37 B) and the total is 701 B against 671 B.
DEEPSEEK_V3 = dict(layers=61, hidden=7168, heads=128, seq=4096, vocab=129280, experts=256,
                   top_k=9, expert_hidden=3072, gpus=2048, per_node=8, batch=15360, pp=16,
                   ep=64, zero=1, tokens_per_gpu_s=1e12 / (180e3 * 3600))


# Model presets (``python -m hpcdist.plan --preset NAME``): the published shapes, and a run to
# plan for where the command line gives none. Llama 3 (arXiv:2407.21783, Table 3): 8B 32 x 4096,
# 32 heads, 8 kv heads, SwiGLU 14336; 70B 80 x 8192, 64 / 8, 28672; 405B 126 x 16384, 128 / 8,
# 53248; vocabulary 128,256, rotary base 500,000, pretraining at 8,192 positions. Mixtral
# 8x7B (arXiv:2401.04088): 32 x 4096, 32 / 8 heads, 8 SwiGLU experts of 14336, top-2,
# vocabulary 32,000.
PRESETS = {
    "llama3-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                      vocab=128256, seq=8192, gpus=8, batch=8, gpu="h100", rope_theta=5e5),
    "llama3-70b": dict(arch="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                       vocab=128256, seq=8192, gpus=512, batch=512, gpu="h100",
                       rope_theta=5e5),
    "llama3-405b": dict(arch="llama", layers=126, hidden=16384, heads=128, kv_heads=8,
                        ffn=53248, vocab=128256, seq=8192, gpus=16384, batch=2048,
                        gpu="h100", rope_theta=5e5),
    "mixtral-8x7b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8,
                         ffn=14336, vocab=32000, seq=4096, experts=8, top_k=2, gpus=64,
                         batch=256, gpu="h100", rope_theta=1e6),
}

# Published Llama runs the planner is held to (bench plan --published): Llama 3 405B on
# 16,384 H100s at 8,192 positions, TP 8 x PP 16 x DP 128, 16M-token batches (2048
# sequences), 38-43% bf16 MFU (the Llama 3 paper, Table 4: 43% at 8,192 GPUs, 41% and 38%
# at 16,384); torchtitan's Llama 3.1 8B on 8 H100s, FSDP (ZeRO-3) over all 8, one sequence
# of 8,192 a GPU: 5,762 tokens/s per GPU (torchtitan's benchmarks, bf16, torch.compile).
LLAMA_PUBLISHED = [
    dict(preset="llama3-405b", tp=8, pp=16, zero=1, gpus=16384, batch=2048,
         mfu=(0.38, 0.43)),
    dict(preset="llama3-8b", tp=1, pp=1, zero=3, gpus=8, batch=8, tokens_per_gpu_s=5762),
]


@dataclass(frozen=True)
class Model:
    """A model of a family: ``arch`` "gpt" (GPT-2: LayerNorm, learned positions, a GELU MLP
    of 4h, biases, a tied head) or "llama" (RMSNorm, rotary positions, ``kv_heads`` key/value
    heads, a SwiGLU MLP of ``ffn``, no biases, an untied head unless ``tied``)."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    experts: int = 0            # routed experts of an MoE layer (0: dense MLPs)
    top_k: int = 2
    expert_hidden: int = 0      # an expert's MLP width (0: the dense MLP's)
    moe_every: int = 1          # an MoE MLP in every n-th block, from block 0
    arch: str = "gpt"
    kv_heads: int = 0           # llama: key/value heads (0: heads)
    ffn: int = 0                # llama: SwiGLU's width (0: 8/3 h up to a multiple of 64)
    tied: bool | None = None    # the head tied to the token table (None: the family's)
    vocab_multiple: int = 1     # the table and head padded to multiples of it x TP (train's
                                # --vocab-multiple: 64 on a GPU)
    rope_theta: float = 0.0     # the rotary base of the command printed (0: the family's)

    def vocab_rows(self, tp: int) -> int:
        """The token table's (and head's) rows one of ``tp`` ranks holds: the vocabulary
        padded to a multiple of vocab_multiple x tp, split tp ways."""
        unit = self.vocab_multiple * tp
        return -(-self.vocab // unit) * unit // tp

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def head_tied(self) -> bool:
        return (not self.llama) if self.tied is None else self.tied

    @property
    def kv_width(self) -> int:
        """k's (and v's) width: kv heads x head size."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def mlp_width(self) -> int:
        if self.llama:
            return self.ffn or 64 * -(-8 * self.hidden // (3 * 64))
        return 4 * self.hidden

    @property
    def matmul_weights(self) -> int:
        """A dense block's weights in matmuls: GPT 12h^2; Llama q|k|v, o and SwiGLU's three."""
        h = self.hidden
        if self.llama:
            return h * (h + 2 * self.kv_width) + h * h + 3 * h * self.mlp_width
        return 12 * h * h

    @property
    def block_split(self) -> int:
        """A dense block's parameters tensor parallelism splits (matmuls, column biases)."""
        return self.matmul_weights + (0 if self.llama else 7 * self.hidden)

    @property
    def block_whole(self) -> int:
        """... and those every TP rank holds whole (norms, row-parallel biases)."""
        return 2 * self.hidden if self.llama else 6 * self.hidden

    @property
    def mlp_params(self) -> int:
        """A dense block's MLP: GPT 8h^2 + 5h (with biases), Llama's SwiGLU 3hF."""
        h = self.hidden
        return 3 * h * self.mlp_width if self.llama else 8 * h * h + 5 * h

    @property
    def positions(self) -> int:
        """The learned position table's parameters (rotary: none)."""
        return 0 if self.llama else self.seq * self.hidden

    @property
    def moe_layers(self) -> int:
        return -(-self.layers // self.moe_every) if self.experts else 0

    @property
    def expert_size(self) -> int:
        """One expert's parameters: GPT's 2hf + f + h (two linears with biases), Llama's
        SwiGLU 3hf."""
        h = self.hidden
        f = self.expert_hidden or self.mlp_width
        return 3 * h * f if self.llama else 2 * h * f + f + h

    def moe_change(self, experts_per_token: float) -> float:
        """Parameters the MoE blocks add to a dense model's: each MoE block's MLP replaced by
        its router (hE) and ``experts_per_token`` experts."""
        h = self.hidden
        return self.moe_layers * (h * self.experts + experts_per_token * self.expert_size
                                  - self.mlp_params)

    @property
    def parameters(self) -> float:
        """GPT: 12lh^2(1 + 13/12h) + (V + s)h: blocks, embeddings (the head tied). Llama: the
        blocks, the token table, the final norm and an untied head. With experts, every
        expert of an MoE block."""
        l, h, V = self.layers, self.hidden, self.vocab
        head = 0 if self.head_tied else V * h
        if self.llama:
            return l * (self.block_split + self.block_whole) + V * h + h + head + \
                self.moe_change(self.experts)
        return 12 * l * h * h * (1 + 13 / (12 * h)) + (V + self.seq) * h + head + \
            self.moe_change(self.experts)

    @property
    def active_parameters(self) -> float:
        """What one token meets: an MoE block's top-k experts of its E."""
        return self.parameters - self.moe_change(self.experts) + self.moe_change(self.top_k)

    def flops(self, batch: int, recompute: bool) -> float:
        """FLOPs of one iteration on ``batch`` sequences: ``flops_per_token`` of the active
        parameters (the count the training run reports too; Narayanan et al. 2021's eq. 3 up
        to the biases; torchtitan's for Llama), plus one more forward of the blocks under
        full recompute."""
        B, s, l, h = batch, self.seq, self.layers, self.hidden
        per_token = flops_per_token(self.active_parameters - self.positions, l, h, s)
        extra = 2 * l * self.matmul_weights + 4 * l * h * s + \
            2 * self.moe_change(self.top_k) if recompute else 0
        return B * s * (per_token + extra)


def flops_per_token(params: float, layers: int, hidden: int, seq: int) -> float:
    """Training FLOPs per token as the peers count them (PaLM's appendix, nanoGPT, llm.c):
    6N for every weight's matmuls forward and backward (N without the position table),
    plus attention's 12 L d T (Q K^T and the weighted sum of V, forward and backward)."""
    return 6 * params + 12 * layers * hidden * seq


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
