"""``python -m hpcdist.plan``: the layout to run a model of any family (nn/) on a cluster,
with memory, step time and bubble for every layout considered.

    python -m hpcdist.plan --layers 80 --hidden 8192 --heads 64 --seq 2048 --vocab 32000 \
        --global-batch 1536 --gpus 512 --gpus-per-node 8 --gpu a100-80g

The rest of this design: docs/planner.md, "hpcdist/plan/__init__.py"."""
from __future__ import annotations

from .facts import DEEPSEEK_V3, GB, GPU, HARDWARE, LLAMA_PUBLISHED, NARAYANAN_TABLE_1, PRESETS
from .model import (FEATURES, Estimate, Layout, Model, Settings, flops_per_token, preset,
                    stage_splits)
from .memory import activations, hpcdist_layer, megatron_layer, memory, stash_at_peak
from .steptime import closed_form, estimate, pipeline_makespan
from .search import _divisors, _schedules, best_per_mesh, candidates, plan
from .cli import calibrated, main

__all__ = ["DEEPSEEK_V3", "FEATURES", "LLAMA_PUBLISHED", "PRESETS", "GB", "GPU", "HARDWARE", "NARAYANAN_TABLE_1", "Estimate",
           "Layout", "Model", "Settings", "flops_per_token", "preset", "stage_splits", "activations", "hpcdist_layer", "megatron_layer", "memory",
           "stash_at_peak", "closed_form", "estimate", "pipeline_makespan", "_divisors",
           "_schedules", "best_per_mesh", "candidates", "plan", "calibrated", "main"]
