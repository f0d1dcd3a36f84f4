"""Mixture of experts against a dense GPT on real text, the same active parameters, the
same tokens: ``python -m hpcdist.bench moe --quality [--steps 800]``.

The corpus: the standard library's docstrings (real English on every machine with Python,
``bench.slowlinks.corpus``), tokenized by ``python -m hpcdist.data prepare`` (BPE, 2,048
tokens). The contenders, GPT 4x128 (block 128, batch 16, AdamW, the same schedule and
seed): the dense MLP (width 4 x 128 = 512), and 8 experts of width 256 with top-2 routing,
so each token meets 2 x 256 = 512 hidden units, the dense model's count (its router adds
8 x 128 weights a layer; it holds 4x the dense model's MLP weights in all). Each runs in its
own process on this machine (one rank); the held-out loss every ``--eval-every`` steps.
Writes runs/moe_quality/{results.json, quality.png} and prints a markdown table.
"""
from __future__ import annotations

import json
import os
import sys

from hpcdist.bench.common import run_job, write_json

MODEL = ["--task", "text", "--block-size", "128", "--n-layer", "4", "--n-embd", "128",
         "--n-head", "4", "--batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4",
         "--warmup", "50", "--eval-batch", "256", "--grad-clip", "1.0"]
CONTENDERS = {
    "dense (MLP 512)": [],
    "MoE 8 x 256, top-2": ["--experts", "8", "--top-k", "2", "--expert-hidden", "256"],
    "MoE 8 x 256, top-2, sigmoid + bias": ["--experts", "8", "--top-k", "2",
                                           "--expert-hidden", "256", "--router", "sigmoid",
                                           "--balance", "bias"],
}


def prepared(out: str) -> str:
    """The token shards of the corpus under ``out`` (made once)."""
    from hpcdist.bench.slowlinks import corpus
    from hpcdist.data.__main__ import prepare
    folder = os.path.join(out, "data")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        prepare([corpus(os.path.join(out, "docstrings.txt"), 4_000_000)], folder,
                vocab_size=2048)
    return folder


def run(name: str, flags: list, data: str, args, out: str) -> dict:
    from hpcdist.bench.slowlinks import folder_of
    folder = folder_of(out, name)
    cmd = [sys.executable, "-m", "hpcdist.train", *MODEL, "--data", data, "--steps",
           str(args.steps), "--eval-every", str(args.eval_every), "--log-every",
           str(args.eval_every), "--out-dir", folder, *flags]
    print(" ".join(cmd[1:]), flush=True)
    r = run_job(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    evals = [(x["step"], x["test_loss"]) for x in lines if x.get("event") == "eval"]
    steps = [x for x in lines if "loss" in x and "event" not in x]
    final = lines[-1]
    evals.append((final["steps"], final["test_loss"]))
    loads = [x["moe_load"] for x in steps if "moe_load" in x]
    return {"contender": name, "held_out": final["test_loss"], "evals": evals,
            "train_seconds": final["train_seconds"],
            "step_ms": final["step_ms_median"],
            "load_last": loads[-1] if loads else None}


def markdown(rows: list) -> str:
    dense = rows[0]["held_out"]
    out = ["| contender | held-out loss | vs dense | median step ms | experts max/mean (last "
           "step) |", "|---|---|---|---|---|"]
    for r in rows:
        load = "-" if r["load_last"] is None else f"{r['load_last']:.2f}"
        out.append(f"| {r['contender']} | {r['held_out']:.4f} | {r['held_out'] - dense:+.4f} | "
                   f"{r['step_ms']:.0f} | {load} |")
    return "\n".join(out)


def plot(rows: list, path: str) -> str:
    from hpcdist.bench.common import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in rows:
        ax.plot(*zip(*r["evals"]), marker="o", markersize=3, label=r["contender"])
    ax.set_xlabel("step (16 x 128 tokens each)")
    ax.set_ylabel("held-out loss")
    ax.set_title("GPT 4x128 on the stdlib's docstrings: dense vs MoE, equal active params")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def quality(args) -> int:
    out = args.quality_out
    os.makedirs(out, exist_ok=True)
    data = prepared(out)
    rows = [run(name, flags, data, args, out) for name, flags in CONTENDERS.items()]
    write_json(os.path.join(out, "results.json"), rows)
    png = plot(rows, os.path.join(out, "quality.png"))
    print(markdown(rows))
    print(f"wrote {out}/results.json and {png}")
    return 0
