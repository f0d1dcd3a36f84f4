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

from .model import (FEATURES, GB, GPU, HARDWARE, NARAYANAN_TABLE_1, Estimate, Layout, Model,
                    Settings, flops_per_token, stage_splits)
from .memory import activations, hpcdist_layer, megatron_layer, memory, stash_at_peak
from .steptime import closed_form, estimate, pipeline_makespan
from .search import _divisors, _schedules, best_per_mesh, candidates, plan
from .cli import calibrated, main

__all__ = ["FEATURES", "GB", "GPU", "HARDWARE", "NARAYANAN_TABLE_1", "Estimate", "Layout",
           "Model", "Settings", "flops_per_token", "stage_splits", "activations", "hpcdist_layer", "megatron_layer", "memory",
           "stash_at_peak", "closed_form", "estimate", "pipeline_makespan", "_divisors",
           "_schedules", "best_per_mesh", "candidates", "plan", "calibrated", "main"]
