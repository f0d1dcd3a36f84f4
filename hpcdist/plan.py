"""``python -m hpcdist.plan``: the layout to run a GPT on a cluster, with memory, step time and
bubble for every layout considered.

    python -m hpcdist.plan --layers 80 --hidden 8192 --heads 64 --seq 2048 --vocab 32000 \\
        --global-batch 1536 --gpus 512 --gpus-per-node 8 --gpu a100-80g

Search: every DP x TP x PP that divides the GPUs (TP inside a node and dividing the heads,
PP dividing the layers), ZeRO stage 0-3 (2 and 3 only without a pipeline, as hpcdist and
DeepSpeed require), micro-batch size 1-8, schedule (1F1B, GPipe, interleaved with v = 2 or 4,
ZB-H1), activation recompute (none / full) and sequence parallelism. Each layout gets:

- **memory per GPU**: parameters, gradients and optimizer state by ZeRO's formulas for mixed
  precision Adam (bf16 parameters, K = 12 bytes of fp32 master weights and moments), with
  gradients accumulated and reduced in fp32 as Megatron-LM and hpcdist's DDP do (4 bytes;
  ``Settings.grad_bytes`` = 2 gives ZeRO's 2 + 2 + 12), activations by Korthikanti et al.
  2022, Table 2 (per layer: sbh(10 + 24/t + 5as/(ht)) bytes, sbh(34/t + 5as/(ht)) with
  sequence parallelism, 2sbh with full recompute) times the micro-batch chunks the schedule
  keeps in flight on the first stage (``schedules.REGISTRY``'s stash bound), the logits on
  the last, and fixed buffers; a layout that does not fit is refused, saying by how much;
- **step time**: each stage's forward and backward from FLOPs at an achievable fraction of the
  card's peak, tensor-parallel collectives per layer (ring over NVLink, or the network when
  TP leaves the node), the stage-to-stage sends, the pipeline's makespan from hpcdist's own
  schedule simulator (closed forms past its size), and the data-parallel gradient reduction
  (ZeRO-3: 1.5x) over the network, not overlapped (as Megatron-LM ran it);
- TFLOP/s per GPU counted as Narayanan et al. 2021 count it (96Bslh^2(1 + s/6h + V/16lh)
  with recompute, 72... without), MFU against the peak, the bubble and the comm share.

Hardware: ``HARDWARE`` (vendors' published peaks and links; ``--gpu custom`` with flags).
Features: ``--features megatron-2021`` searches only what Megatron-LM offered in 2021 (the
published runs' framework). Calibration: ``--calibrate FILE`` (efficiency, link alpha/beta,
CPU overheads; ``bench plan`` writes it). Activations: Korthikanti et al.'s formula for
Megatron-LM's layers, or hpcdist's own layers counted tensor by tensor
(``Settings(activations="hpcdist")``, what ``bench plan --memory`` checks against runs).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace

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
# GPU in a DGX H100. H200: H100's compute, 141 GB.
HARDWARE = {
    "a100-40g": GPU("A100 40GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    40 * GB, 300 * GB, 25 * GB),
    "a100-80g": GPU("A100 80GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
                    80 * GB, 300 * GB, 25 * GB),
    "h100": GPU("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                80 * GB, 450 * GB, 50 * GB),
    "h200": GPU("H200 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                141 * GB, 450 * GB, 50 * GB),
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


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int

    @property
    def parameters(self) -> float:
        """12lh^2(1 + 13/12h) + (V + s)h: blocks, embeddings (the head tied)."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h)) + (self.vocab + self.seq) * h

    def flops(self, batch: int, recompute: bool) -> float:
        """FLOPs of one iteration on ``batch`` sequences (Narayanan et al. 2021, eq. 3: the
        backward twice the forward; full recompute one more forward of the blocks)."""
        B, s, l, h, V = batch, self.seq, self.layers, self.hidden, self.vocab
        blocks = 24 * B * s * l * h * h * (1 + s / (6 * h))
        logits = 2 * B * s * h * V
        return (4 if recompute else 3) * blocks + 3 * logits


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
        return {"tp": L.tp, "pp": L.pp, "dp": L.dp, "zero": L.zero,
                "micro_batch": L.micro_batch, "micro_batches": L.micro_batches,
                "schedule": L.schedule + (f" v{L.virtual}" if L.virtual > 1 else ""),
                "recompute": "full" if L.recompute else "none", "sp": L.sp,
                "memory_gb": self.memory.get("total", 0.0) / GB, "step_s": self.step_s,
                "tflops_per_gpu": self.tflops_per_gpu / 1e12, "mfu": self.mfu,
                "bubble": self.bubble,
                "comm_share": (self.parts.get("tp", 0) + self.parts.get("pp", 0)
                               + self.parts.get("dp", 0)) / self.step_s if self.step_s else 0.0}


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
    tp_across_nodes: bool = False
    # what the framework offers (``FEATURES``): SP, ZeRO stages, pipeline schedules
    sequence_parallel: bool = True
    zero_stages: tuple = (0, 1, 2, 3)
    schedules: tuple = ("1f1b", "gpipe", "zb-h1", "interleaved")


# The search restricted to what a framework offered: "megatron-2021" is Megatron-LM as
# Narayanan et al. ran it (SC21): no distributed optimizer (ZeRO), no sequence parallelism
# (Korthikanti et al. 2022), 1F1B and their interleaved schedule (ZB-H1 is 2023's).
FEATURES = {
    "all": {},
    "megatron-2021": {"sequence_parallel": False, "zero_stages": (0,),
                      "schedules": ("1f1b", "interleaved")},
}


# ---- the search ---------------------------------------------------------------------------

def candidates(model: Model, gpus: int, per_node: int, batch: int,
               settings: Settings = Settings()):
    """Every layout considered, and every one refused with its reason: ([Layout], [(dict,
    why)])."""
    from .parallel import schedules as S
    ok, refused = [], []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            base = {"tp": tp, "pp": pp, "dp": dp}
            why = _mesh_problem(model, tp, pp, dp, per_node, batch, settings)
            if why:
                refused.append((base, why))
                continue
            per_replica = batch // dp
            for b in (1, 2, 4, 8):
                if per_replica % b:
                    refused.append(({**base, "micro_batch": b},
                                    f"{per_replica} sequences per replica do not split into "
                                    f"micro-batches of {b}"))
                    continue
                m = per_replica // b
                for name, v in _schedules(pp, settings.schedules):
                    if pp > 1:
                        try:
                            S.check(name, v)
                        except ValueError as e:
                            refused.append(({**base, "schedule": name}, str(e)))
                            continue
                        if v > 1 and ((model.layers // pp) % v or m % pp):
                            refused.append(({**base, "schedule": f"{name} v{v}"},
                                            f"interleaving needs layers per stage ({model.layers // pp}) "
                                            f"divisible by v = {v} and micro-batches ({m}) by pp"))
                            continue
                    for zero in settings.zero_stages:
                        if pp > 1 and zero > 1:
                            refused.append(({**base, "zero": zero}, f"ZeRO-{zero} shards "
                                            "gradients during backward: with a pipeline use "
                                            "ZeRO 0 or 1"))
                            continue
                        for recompute in (False, True):
                            sps = (False, True) if tp > 1 and settings.sequence_parallel \
                                else (False,)
                            for sp in sps:
                                ok.append(Layout(tp, pp, dp, zero, b, m, name, v, recompute, sp))
    return ok, refused


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_problem(model, tp, pp, dp, per_node, batch, settings) -> str | None:
    if tp > per_node and not settings.tp_across_nodes:
        return f"TP {tp} leaves the node ({per_node} GPUs): its collectives per layer would " \
               "cross the network (--tp-across-nodes to consider it)"
    if per_node % tp and tp < per_node:
        return f"TP {tp} does not divide the {per_node} GPUs of a node"
    if model.heads % tp or model.hidden % tp:
        return f"TP {tp} does not divide the heads ({model.heads}) and hidden ({model.hidden})"
    if model.layers % pp:
        return f"PP {pp} does not divide the {model.layers} layers"
    if batch % dp:
        return f"the global batch {batch} does not split over DP {dp}"
    return None


def _schedules(pp: int, allowed=None):
    if pp == 1:
        return [("none", 1)]
    return [(n, v) for n, v in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                ("interleaved", 4)) if allowed is None or n in allowed]


# ---- one layout ---------------------------------------------------------------------------

def memory(model: Model, L: Layout, settings: Settings = Settings(),
           stage: str | None = None) -> dict:
    """Bytes per GPU on the ``stage`` "first" or "last" (None: the fuller of the two).

    Parameters counted as a GPT-2 block holds them under tensor parallelism: 12h^2 + 7h split
    over the TP ranks (QKV, the projections, the MLP and their column-parallel biases), 6h
    on every rank (the row-parallel biases and two LayerNorms); the vocabulary-parallel table
    padded to a multiple of TP and the position table on the first stage; the final
    LayerNorm and the tied head's copy on the last."""
    s, h, V, t = model.seq, model.hidden, model.vocab, L.tp
    block = (12 * h * h + 7 * h) / t + 6 * h
    layers = model.layers // L.pp
    table = -(-V // t) * h
    first = layers * block + table + s * h + (2 * h if L.pp == 1 else 0)
    last = layers * block + 2 * h + (table if L.pp > 1 else 0)
    d = L.dp
    pb, gb, ob = settings.param_bytes, settings.grad_bytes, settings.optimizer_bytes

    def state(psi):                       # bytes per parameter, ZeRO's sharding (rank 0's
        shard = -(-int(psi) // d)         # shard: the layout's first, ceil(psi / d))
        if L.zero == 0:
            return pb * psi, gb * psi, ob * psi
        if L.zero == 1:
            return pb * psi, gb * psi, ob * shard
        if L.zero == 2:
            return pb * psi, gb * shard, ob * shard
        return pb * shard, gb * shard, ob * shard
    act_first, act_last = (activations(model, L, settings, st) for st in ("first", "last"))
    out = {}
    for name, psi, act in (("first", first, act_first), ("last", last, act_last)):
        p, g, o = state(psi)
        out[name] = {"params": p, "grads": g, "optimizer": o, "activations": act,
                     "buffers": settings.buffers, "total": p + g + o + act + settings.buffers}
    return out[stage] if stage else max(out.values(), key=lambda x: x["total"])


def activations(model: Model, L: Layout, settings: Settings = Settings(),
                stage: str = "first") -> float:
    """Bytes of activations a GPU holds at its most on the ``stage`` "first" or "last": one
    layer's stored tensors times the layers of a chunk times the micro-batch chunks the
    schedule keeps in flight there (``stash_at_peak``), plus the embedding
    (first) or the logits and loss (last) of each micro-batch in flight and, with full
    recompute, the one layer rebuilt in backward. ``settings.activations`` picks the layer:

    - "megatron": Korthikanti et al. 2022, Table 2, for Megatron-LM's layers in 16-bit
      (sbh(10 + 24/t + 5as/(ht)) bytes, sbh(34/t + 5as/(ht)) with sequence parallelism,
      2sbh, the layer's input, with full recompute); the fp32 logits and their gradient;
    - "hpcdist": hpcdist's own GPT (nn/gpt.py, parallel/tp/) counted tensor by tensor in
      ``hpcdist_layer``; checked against ``--trace-memory`` runs by ``bench plan --memory``.
    """
    layers = model.layers // L.pp
    held, edge = stash_at_peak(L.schedule, L.pp, L.micro_batches, L.virtual, stage)
    per = hpcdist_layer if settings.activations == "hpcdist" else megatron_layer
    stored, rebuilt, ends = per(model, L, settings, stage)
    if L.pp == 1:                                   # one stage: both ends
        ends += per(model, L, settings, "last" if stage == "first" else "first")[2]
    # each chunk in flight holds its layers; the embedding or the head comes with the
    # micro-batches in flight through the chunk that has it
    return held * layers / L.virtual * stored + edge * ends + rebuilt


_STASH: dict = {}


def stash_at_peak(name: str, P: int, m: int, v: int, stage: str) -> tuple:
    """(micro-batch chunks the ``stage`` ("first" or "last") holds activations for at its
    most, how many of them are through its edge chunk: the first stage's chunk 0 embeds, the
    last stage's chunk v - 1 holds the head). Walked along our schedule's own action list
    (F adds a chunk, B or W frees it) where it is small enough; past that the registry's
    bound, with the edge chunks an even share."""
    from .parallel import schedules as S
    if P == 1:
        return 1, 1
    key = (name, P, m, v, stage)
    if key not in _STASH:
        rank = 0 if stage == "first" else P - 1
        if P * m * v > 4096:
            held = S.promised_stash(name, P, m, v)[rank]
            _STASH[key] = (held, held / v)
        else:
            costs = {"F": 1.0, "I": 1.0, "W": 1.0} if S.get(name).replan else None
            edge_chunk = 0 if stage == "first" else v - 1
            live, best = set(), (0, 0)
            for a in S.make(name, P, m, v, costs)[rank]:
                if a.kind == "F":
                    live.add((a.mb, a.chunk))
                    best = max(best, (len(live), sum(c == edge_chunk for _, c in live)))
                elif a.kind in ("B", "W"):
                    live.discard((a.mb, a.chunk))
            _STASH[key] = best
    return _STASH[key]


def megatron_layer(model: Model, L: Layout, settings: Settings, stage: str) -> tuple:
    """(bytes stored per layer, the layer rebuilt in backward, embedding / head per
    micro-batch): Korthikanti et al.'s Table 2 for Megatron-LM's 16-bit layers."""
    s, h, a, V, t, b = model.seq, model.hidden, model.heads, model.vocab, L.tp, L.micro_batch
    full = s * b * h * ((34 / t) if L.sp else (10 + 24 / t)) + 5 * a * s * s * b / t
    if L.recompute:
        stored, rebuilt = 2 * s * b * h / (t if L.sp else 1), full
    else:
        stored, rebuilt = full, 0.0
    ends = 4 * s * b * V / t * 2 if stage == "last" else 0.0     # fp32 logits and their grad
    return stored, rebuilt, ends


def hpcdist_layer(model: Model, L: Layout, settings: Settings, stage: str) -> tuple:
    """The same three for hpcdist's GPT, tensor by tensor. Every op's output stays with the
    graph until backward, and some ops keep more (LayerNorm its normalised input and 1/std,
    GELU its tanh). Per layer, in elements (n = b s tokens of the micro-batch):

    - no TP: LN 2nh + n, fused QKV 3nh, scores, scaled, masked and softmax 4bas^2, attention
      output and its reshaped copy 2nh, projection nh, residual nh, LN 2nh + n, fc 4nh, GELU
      and its tanh 8nh, projection nh, residual nh: 25nh + 4bas^2 + 2n;
    - TP t: the linears' matmul and bias add are two ops, the row-parallel outputs are full
      (partial sums, the allreduced result, the bias add): 12nh + 24nh/t + 4bas^2/t + 2n;
    - and sequence parallel: the two allgathered inputs and the two row-parallel partial sums
      are full, the rest split: 4nh + 34nh/t + 4bas^2/t + 2n/t.

    Full recompute keeps each block's output (nh, or nh/t with SP) and rebuilds one layer.
    First stage: the token and position embeddings and their sum (TP: the masked rows and
    the reduced sum; SP: reduce-scattered). Last stage: the final LayerNorm, the logits and
    the cross-entropy's shifted logits (TP: and their exponentials), its per-token vectors."""
    s, h, a, V, t, b = model.seq, model.hidden, model.heads, model.vocab, L.tp, L.micro_batch
    n, ab = b * s, settings.param_bytes
    lnb = max(ab, 4)                       # LayerNorm keeps its normalised input in fp32
    scores = 4 * b * a * s * s / t
    if t == 1:
        full = 21 * n * h + scores
        split = 1
    elif not L.sp:
        full = 8 * n * h + 24 * n * h / t + scores
        split = 1
    else:
        full = 4 * n * h + 30 * n * h / t + scores
        split = t
    full = full * ab + 2 * (n * h / split) * (lnb + ab) + 2 * n / split * 4
    act = n * h / split * ab                    # one activation between layers
    # full recompute: the block's output kept, and in backward the rebuilt block beside the
    # gradient arriving at it
    stored, rebuilt = (act, full + act) if L.recompute else (full, 0.0)
    if L.pp > 1:                                # the gradient received, the output being sent
        rebuilt += 2 * act
    Vt = -(-V // t)
    if stage == "first":
        if t == 1:
            ends = (2 * n * h + s * h) * ab
        elif not L.sp:
            ends = (4 * n * h + n + s * h) * ab
        else:
            ends = (2 * n * h + n + (2 * n * h + s * h) / t) * ab
        ends += 2 * n * 8                                  # the batch's tokens and targets
    else:
        norm = (n * h / split) * (lnb + ab) + n / split * 4
        logits = n * Vt * (2 if t == 1 else 3) * ab + (n * h * ab if L.sp else 0)
        ends = norm + logits + n * (4 + 1 + 8 + 8)         # lse, valid, target, row index
        if L.pp > 1:
            ends += act                                    # the input received from before
    return stored, rebuilt, ends


_SIM: dict = {}


def pipeline_makespan(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """(makespan, bubble) of one step's pipeline with per-chunk forward ``f`` and backward
    ``b`` seconds: hpcdist's schedule simulator (schedules.verify) where the list is small
    enough, closed forms beyond (checked against the simulator in tests)."""
    from .parallel import schedules as S
    if P == 1:
        return m * (f + b), 0.0
    ratio = round(b / f, 2) if f else 2.0
    key = (name, P, m, v, ratio)
    if key not in _SIM:
        if P * m * v <= 4096:
            costs = {"F": 1.0, "B": ratio, "I": ratio / 2, "W": ratio / 2}
            sched = S.make(name, P, m, v, {"F": 1.0, "I": ratio / 2, "W": ratio / 2}
                           if S.get(name).replan else None)
            r = S.verify(sched, P, m, v, costs=costs)
            _SIM[key] = (r.makespan, r.bubble)
        else:
            _SIM[key] = closed_form(name, P, m, v, 1.0, ratio)
    unit, bubble = _SIM[key]
    return unit * f, bubble


def closed_form(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """Makespan and bubble for uniform op costs: GPipe and 1F1B (m + P - 1)(f + b);
    interleaved (mv + P - 1)(f + b) with per-chunk costs; ZB-H1 m(f + b) + (P - 1) f
    (Qi et al.: the bubble (P - 1)(T_F + T_I - T_W), with I = W = b/2)."""
    if name == "zb-h1":
        total = m * (f + b) + (P - 1) * f
        busy = m * (f + b)
    else:
        total = (m * v + P - 1) * (f + b)
        busy = m * v * (f + b)
    return total, 1 - busy / total


def _allreduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def estimate(model: Model, L: Layout, gpu: GPU, gpus: int, per_node: int, batch: int,
             settings: Settings = Settings()) -> Estimate:
    e = Estimate(L)
    e.memory = memory(model, L, settings)
    usable = gpu.memory * settings.memory_headroom
    if e.memory["total"] > usable:
        e.fits = False
        e.why = (f"needs {e.memory['total'] / GB:.1f} GB per GPU, {usable / GB:.1f} GB usable "
                 f"({(e.memory['total'] - usable) / GB:.1f} GB over)")
    s, h, V, t, b = model.seq, model.hidden, model.vocab, L.tp, L.micro_batch
    peak = gpu.flops[settings.dtype] * settings.efficiency
    layers = model.layers // L.pp
    layer_fwd = 24 * b * s * h * h * (1 + s / (6 * h)) / t
    tp_bw, tp_alpha = (gpu.nvlink, gpu.nvlink_alpha) if t <= per_node else \
        (gpu.network, gpu.network_alpha)
    act_bytes = settings.param_bytes * b * s * h
    call = settings.call_overhead
    tp_fwd = 2 * (_allreduce(act_bytes, t, tp_bw, tp_alpha) + call) if t > 1 else 0.0
    over = settings.layer_overhead
    if settings.byte_cost:
        written = hpcdist_layer(model, replace(L, recompute=False), settings, "first")[0]
        over += settings.byte_cost * written
    f = layers * (layer_fwd / peak + tp_fwd + over)
    bwd = layers * (2 * layer_fwd / peak + tp_fwd + 2 * over)
    if L.recompute:
        bwd += layers * (layer_fwd / peak + tp_fwd + over)
    logits = 2 * b * s * h * V / t / peak                          # on the last stage
    f_last, b_last = f + logits, bwd + 2 * logits
    # rank = (pp * DP + dp) * TP + tp, a node's ranks consecutive: neighbouring stages are
    # TP x DP ranks apart, a data-parallel group's ranks TP apart
    pp_send = 0.0
    if L.pp > 1:                        # scatter/gather over TP: each rank sends 1/t
        across = t * L.dp >= per_node
        pp_send = act_bytes / t / (gpu.network if across else gpu.nvlink) \
            + (gpu.network_alpha if across else gpu.nvlink_alpha) + call
    fc = max(f, f_last) / L.virtual + pp_send       # each chunk sends its own activations
    bc = max(bwd, b_last) / L.virtual + pp_send
    schedule = L.schedule if L.pp > 1 else "1f1b"
    pipe, bubble = pipeline_makespan(schedule, L.pp, L.micro_batches, L.virtual, fc, bc)
    if settings.ranks_per_core > 1 and L.pp > 1:
        busy = L.micro_batches * L.virtual * (fc + bc)
        pipe = max(busy, pipe / settings.ranks_per_core)
        bubble = 1 - busy / pipe
    psi = (layers * 12 * h * h * (1 + 13 / (12 * h)) + V * h + s * h) / t
    grad_bytes = settings.grad_bytes * psi
    inside = t * L.dp <= per_node
    dp = _allreduce(grad_bytes, L.dp, gpu.nvlink if inside else gpu.network,
                    gpu.nvlink_alpha if inside else gpu.network_alpha) \
        * (1.5 if L.zero == 3 else 1)
    if L.dp > 1:                   # a call per 25 MB bucket; ZeRO-3 gathers every block twice
        calls = max(1, math.ceil(grad_bytes / 25e6)) + (3 * layers if L.zero == 3 else 0)
        dp += calls * call
    optimizer = 16 * psi / (L.dp if L.zero else 1) / 2e12     # a memory-bound pass over state
    e.step_s = pipe + dp + optimizer
    tp_total = L.micro_batches * layers * tp_fwd * (3 if L.recompute else 2)
    e.parts = {"pipeline": pipe, "tp": tp_total,
               "pp": 2 * L.micro_batches * L.virtual * pp_send,
               "dp": dp, "optimizer": optimizer}
    e.bubble = bubble
    executed = model.flops(batch, L.recompute)
    e.tflops_per_gpu = executed / e.step_s / gpus
    e.mfu = model.flops(batch, False) / e.step_s / gpus / gpu.flops[settings.dtype]
    return e


def plan(model: Model, gpu: GPU, gpus: int, per_node: int, batch: int,
         settings: Settings = Settings()):
    """(fitting estimates fastest first, refused [(layout dict, why)])."""
    layouts, refused = candidates(model, gpus, per_node, batch, settings)
    fits = []
    for L in layouts:
        e = estimate(model, L, gpu, gpus, per_node, batch, settings)
        if e.fits:
            fits.append(e)
        else:
            refused.append((asdict(L), e.why))
    fits.sort(key=lambda e: e.step_s)
    return fits, refused


def best_per_mesh(fits: list) -> list:
    """The fastest estimate of each DP x TP x PP, fastest first (``fits`` sorted)."""
    seen, out = set(), []
    for e in fits:
        key = (e.layout.tp, e.layout.pp, e.layout.dp)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def calibrated(gpu: GPU, settings: Settings, path: str) -> tuple:
    """The card and settings with what our benchmarks measured: a JSON object (or the
    ``calibration`` inside ``bench plan``'s ``bench_plan.json``) with any of ``efficiency``,
    ``nvlink`` / ``network`` as [alpha s, bytes/s], ``layer_overhead_s``, ``byte_cost_s``,
    ``call_overhead_s``, ``ranks_per_core`` (a byte cost counts hpcdist's own layers)."""
    doc = json.load(open(path))
    doc = doc.get("calibration", doc)
    if "efficiency" in doc:
        settings = replace(settings, efficiency=float(doc["efficiency"]))
    for level in ("nvlink", "network"):
        if level in doc:
            alpha, bw = doc[level]
            gpu = replace(gpu, **{level: float(bw), f"{level}_alpha": float(alpha)})
    for key, name in (("layer_overhead_s", "layer_overhead"), ("byte_cost_s", "byte_cost"),
                      ("call_overhead_s", "call_overhead"), ("ranks_per_core", "ranks_per_core")):
        if key in doc:
            settings = replace(settings, **{name: float(doc[key])})
    if settings.byte_cost:
        settings = replace(settings, activations="hpcdist")
    return gpu, settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.plan",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="gpt", choices=("gpt",))
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="a100-80g", choices=sorted(HARDWARE) + ["custom"])
    ap.add_argument("--peak-tflops", type=float, help="custom: dense TFLOP/s of --dtype")
    ap.add_argument("--memory-gb", type=float, help="custom: memory per GPU")
    ap.add_argument("--nvlink-gbs", type=float, help="custom: NVLink GB/s each way")
    ap.add_argument("--network-gbs", type=float, help="custom: network GB/s per GPU")
    ap.add_argument("--efficiency", type=float, default=Settings.efficiency,
                    help="fraction of the peak the layers' matmuls reach")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tp-across-nodes", action="store_true")
    ap.add_argument("--no-sequence-parallel", action="store_true",
                    help="leave sequence parallelism out (a framework without it)")
    ap.add_argument("--features", default="all", choices=sorted(FEATURES),
                    help="what the framework offers: all of hpcdist's, or megatron-2021 (no "
                         "ZeRO, no sequence parallelism, 1F1B and interleaved only)")
    ap.add_argument("--calibrate", help="JSON of measured efficiency, links and overheads "
                    "(bench plan's runs/bench/bench_plan.json)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="the ranked list as JSON")
    args = ap.parse_args(argv)
    if args.gpu == "custom":
        if not (args.peak_tflops and args.memory_gb and args.nvlink_gbs and args.network_gbs):
            ap.error("--gpu custom needs --peak-tflops, --memory-gb, --nvlink-gbs, --network-gbs")
        gpu = GPU("custom", {args.dtype: args.peak_tflops * 1e12}, args.memory_gb * GB,
                  args.nvlink_gbs * GB, args.network_gbs * GB)
    else:
        gpu = HARDWARE[args.gpu]
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        ap.error(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    settings = Settings(efficiency=args.efficiency, dtype=args.dtype,
                        tp_across_nodes=args.tp_across_nodes,
                        **FEATURES[args.features])
    if args.no_sequence_parallel:
        settings = replace(settings, sequence_parallel=False)
    if args.calibrate:
        gpu, settings = calibrated(gpu, settings, args.calibrate)
    model = Model(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    fits, refused = plan(model, gpu, args.gpus, args.gpus_per_node, args.global_batch,
                         settings)
    if args.json:
        print(json.dumps([e.row() for e in fits[:args.top]], indent=1))
        return 0 if fits else 1
    print(f"GPT {model.layers} layers x {model.hidden} hidden ({model.heads} heads), "
          f"{model.parameters / 1e9:.1f} B parameters, seq {model.seq}, global batch "
          f"{args.global_batch} on {args.gpus} x {gpu.name} ({args.gpus_per_node} per node); "
          f"{len(fits)} layouts fit, {len(refused)} refused")
    if not fits:
        reasons = {}
        for _, why in refused:
            reasons[why.split(" (")[0]] = why
        print("nothing fits; e.g. " + "; ".join(list(reasons.values())[:3]))
        return 1
    cols = ["tp", "pp", "dp", "zero", "micro_batch", "micro_batches", "schedule", "recompute",
            "sp", "memory_gb", "step_s", "tflops_per_gpu", "mfu", "bubble", "comm_share"]
    meshes = best_per_mesh(fits)
    print(f"the {min(args.top, len(meshes))} fastest meshes (DP x TP x PP), each with its best "
          f"settings (--json: every layout, ranked):")
    print(" ".join(f"{c:>14s}" for c in cols))
    for e in meshes[:args.top]:
        r = e.row()
        print(" ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{str(r[c]):>14s}"
                       for c in cols))
    best = fits[0]
    p = best.parts
    print(f"best: TP {best.layout.tp} x PP {best.layout.pp} x DP {best.layout.dp}: "
          f"{best.step_s:.2f} s per step = pipeline {p['pipeline']:.2f} s (bubble "
          f"{best.bubble * 100:.1f}%, TP collectives {p['tp']:.2f} s inside it) + DP gradient "
          f"reduction {p['dp']:.2f} s + optimizer {p['optimizer']:.3f} s; "
          f"{best.memory['total'] / GB:.1f} GB per GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
