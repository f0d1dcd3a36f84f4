"""What runs with what: every pair of features put through the trainer's own checks
(``config.validate``: its settings, then parallel/capabilities.py's refusals), so the table
in docs/compositions.md is generated, never written by hand.

    python -m hpcdist.run.compositions          # the table (docs/compositions.md holds it)
"""
from __future__ import annotations

import sys

from .config import ConfigError, TrainConfig, validate

# A small model that every dimension below can cut: 4 heads (TP 2, then Ulysses' CP 2),
# 4 layers (PP 2 x 2 virtual stages), a batch of 8 (4 micro-batches)
BASE = dict(n_layer=4, n_head=4, n_embd=64, batch_size=8)

FEATURES = {                    # name -> the settings that ask for it
    "ZeRO-1": {"zero": 1},
    "ZeRO-2": {"zero": 2},
    "ZeRO-3": {"zero": 3},
    "TP": {"tp": 2},
    "TP + SP": {"tp": 2, "sequence_parallel": True},
    "PP 1F1B": {"pp": 2},
    "PP interleaved": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "PP ZB-H1": {"pp": 2, "schedule": "zb-h1"},
    "CP ring": {"cp": 2},
    "CP Ulysses": {"cp": 2, "cp_impl": "ulysses"},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "fp64": {"dtype": "fp64"},
    "recompute": {"checkpoint_activations": True},
    "dropout": {"dropout": 0.1},
    "grad accum": {"grad_accum": 2},
    "fp16 wire": {"compress": "fp16"},
    "Top-K": {"compress": "topk"},
    "PowerSGD": {"compress": "powersgd"},
    "NCCL": {"backend": "nccl", "device": "gpu"},
    "param servers": {"strategy": "ps"},
    "DiLoCo": {"strategy": "diloco"},
    "hybrid ZeRO": {"zero": 2, "shard_group": "node"},
    "in-job recovery": {"on_failure": "shrink", "save_dir": "runs/ck"},
    "experts": {"experts": 4},
    "EP": {"experts": 4, "ep": 2},
    "CUDA graphs": {"cuda_graph": "on", "device": "gpu"},
}


def refusal(settings: dict) -> str | None:
    """The trainer's first refusal of these settings (on the small model), or None."""
    try:
        validate(TrainConfig(**{**BASE, **settings}))
    except ConfigError as e:
        return str(e)
    return None


def pairs(features: dict = FEATURES) -> dict:
    """{(a, b): None (runs), "same" (two values of one setting) or the refusal}, a < b in
    the order of ``features``."""
    names, out = list(features), {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            fa, fb = features[a], features[b]
            if any(k in fb and fb[k] != v for k, v in fa.items()):
                out[(a, b)] = "same"
            else:
                out[(a, b)] = refusal({**fa, **fb})
    return out


def markdown(features: dict = FEATURES) -> str:
    """The matrix (runs, refused with a numbered reason, or one setting's two values) and
    the reasons."""
    got, names = pairs(features), list(features)
    reasons: list = []
    for why in got.values():
        if why not in (None, "same") and why not in reasons:
            reasons.append(why)
    refused = sum(why not in (None, "same") for why in got.values())
    runs = sum(why is None for why in got.values())
    lines = [f"{runs} pairs run, {refused} are refused "
             f"(`python -m hpcdist.run.compositions`; model: {BASE}).", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            why = got.get((a, b), got.get((b, a)))
            cells.append("" if a == b else "·" if why == "same" else "yes" if why is None
                         else f"no ({reasons.index(why) + 1})")
        lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
    lines += ["", "yes: runs; no (n): refused, reason n below; ·: two values of one setting.",
              ""] + [f"{i}. {why}" for i, why in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    if argv:
        print("usage: python -m hpcdist.run.compositions (no options)", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
