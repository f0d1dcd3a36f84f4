"""The facts the planner plans with: cards and their links (vendors' datasheets), the
published runs it is checked against, and the published model sizes it knows (each family's,
declared in nn/)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import nn

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


# The published sizes the planner knows (``python -m hpcdist.plan --preset NAME``): every
# family's ``runs`` (nn/<family>.py: the published vocabulary, GPUs and global batch of a run
# to plan where the command line gives none), on H100s.
PRESETS = {name: dict(run, gpu="h100") for fam in nn.FAMILIES.values()
           for name, run in fam.runs.items()}

# Published runs the planner is held to (bench plan --published): Llama 3 405B on
# 16,384 H100s at 8,192 positions, TP 8 x PP 16 x DP 128, 16M-token batches (2048
# sequences), 38-43% bf16 MFU (the Llama 3 paper, Table 4: 43% at 8,192 GPUs, 41% and 38%
# at 16,384); torchtitan's Llama 3.1 8B on 8 H100s, FSDP (ZeRO-3) over all 8, one sequence
# of 8,192 a GPU: 5,762 tokens/s per GPU (torchtitan's benchmarks, bf16, torch.compile).
LLAMA_PUBLISHED = [
    dict(preset="llama3-405b", tp=8, pp=16, zero=1, gpus=16384, batch=2048,
         mfu=(0.38, 0.43)),
    dict(preset="llama3-8b", tp=1, pp=1, zero=3, gpus=8, batch=8, tokens_per_gpu_s=5762),
]
