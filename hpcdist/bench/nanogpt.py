"""A whole training run on real text against a nanoGPT-style PyTorch loop, on the same token
shards: ``python -m hpcdist.bench nanogpt [--steps 300] [--batch 32] [--shape 4x128:128]``.
hpcdist: ``python -m hpcdist.train`` on one rank, as a user runs it (its own process). PyTorch:
nanoGPT's loop in a process of its own — the same GPT from the same initial weights (hpcdist's
initialisation, carried over by name; weight tying, tanh GELU, no dropout), attention through
``scaled_dot_product_attention(is_causal=True)`` as nanoGPT has it, AdamW with decay on the
matrices only, the same warmup + cosine schedule and gradient clipping, and the same batches
(hpcdist's sampler over hpcdist's reading of the shards), on the standard library's
docstrings, BPE 2,048. Each reports tokens per second over its whole run (every step, the
first included) and its median step; the losses should agree. Threads: both take the
machine's (``--threads``). ``--rounds N``: N pairs of runs, which runs first alternating (a
drift of the machine's speed falls on both sides), and the median of the pairs' ratios."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from hpcdist.bench.common import run_job
from ..host.cli import Parser

SHAPE = "4x128:128"                      # layers x width : context (heads of 64)


def shape_of(text: str) -> dict:
    """``LxC:T`` -> the GPT's layers, width, heads (of 64) and context."""
    from hpcdist.bench.shapes import layers_width
    try:
        lc, t = text.split(":")
        n_layer, n_embd, n_head = layers_width(lc)
        return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=int(t))
    except ValueError:
        raise SystemExit(f"--shape {text!r}: expected layers x width : context, e.g. 6x384:256")


def hpcdist_run(data: str, args, out: str) -> dict:
    folder = os.path.join(out, "hpcdist")
    shape = shape_of(args.shape)
    cmd = [sys.executable, "-m", "hpcdist.train", "--task", "text", "--data", data,
           "--block-size", str(shape["block_size"]), "--n-layer", str(shape["n_layer"]),
           "--n-embd", str(shape["n_embd"]), "--n-head", str(shape["n_head"]),
           "--batch-size", str(args.batch), "--steps", str(args.steps),
           "--log-every", str(args.steps), "--out-dir", folder]
    env = dict(os.environ, HPCDIST_THREADS=str(args.threads))
    r = run_job(cmd, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"hpcdist failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        final = [json.loads(x) for x in f][-1]
    tokens = args.steps * args.batch * shape["block_size"]
    return {"tokens_per_s": tokens / final["train_seconds"], "step_ms": final["step_ms_median"],
            "loss": final["train_loss"]}


def torch_run(data: str, steps: int, batch: int, shape: dict) -> dict:
    """nanoGPT's loop (run in its own process by ``main``)."""
    import torch
    from hpcdist import data as hdata, nn, optim
    from hpcdist.bench.autograd import torch_gpt
    from hpcdist.run.config import TrainConfig
    d = TrainConfig()
    cfg = TrainConfig(task="text", data=data, block_size=shape["block_size"])
    train_set, _ = hdata.datasets_of(cfg)
    sampler = hdata.DistributedSampler(len(train_set), batch, 0, 1, seed=d.seed)
    nn.manual_seed(d.seed)
    model = nn.GPT(nn.GPTConfig(vocab_size=train_set.vocab_size, **shape))
    sd = {k: np.asarray(v) for k, v in model.state_dict().items()}
    p, forward = torch_gpt(model.config, sd, batch, sdpa=True)
    groups = [{"params": [t for t in p.values() if t.ndim >= 2], "weight_decay": d.weight_decay},
              {"params": [t for t in p.values() if t.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=d.lr, betas=(d.beta1, d.beta2))
    times, t0 = [], time.perf_counter()
    for step in range(1, steps + 1):
        s0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = optim.lr_at(step, d.lr, d.warmup, steps, d.min_lr)
        x, y = train_set.batch(sampler.next_batch())
        loss = forward(*(torch.from_numpy(np.asarray(a, np.int64)) for a in (x, y)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), d.grad_clip)
        opt.step()
        times.append(time.perf_counter() - s0)
    total = time.perf_counter() - t0
    return {"tokens_per_s": steps * batch * shape["block_size"] / total,
            "step_ms": float(np.median(times)) * 1e3, "loss": float(loss)}


def one_round(data: str, args, torch_first: bool) -> dict:
    """{"hpcdist": ..., "nanoGPT-style PyTorch": ...}, the two runs in the order given."""
    def torch_side() -> dict:
        r = run_job([sys.executable, "-m", "hpcdist.bench", "nanogpt", "--torch-side", data,
                     "--steps", str(args.steps), "--batch", str(args.batch), "--threads",
                     str(args.threads), "--shape", args.shape],
                    env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if r.returncode != 0:
            raise RuntimeError(f"the PyTorch loop failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    runs = [("hpcdist", lambda: hpcdist_run(data, args, args.out)),
            ("nanoGPT-style PyTorch", torch_side)]
    return {who: run() for who, run in (runs[::-1] if torch_first else runs)}


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench nanogpt", description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shape", default=SHAPE, help="layers x width : context, heads of 64 "
                    f"(default {SHAPE})")
    from hpcdist.host.threads import usable_cores
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=1,
                    help="pairs of runs, which runs first alternating; the median ratio")
    ap.add_argument("--out", default="runs/bench_nanogpt")
    ap.add_argument("--torch-side", default="", help=argparse.SUPPRESS)   # the child process
    args = ap.parse_args(argv)
    if args.torch_side:
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(torch_run(args.torch_side, args.steps, args.batch,
                                   shape_of(args.shape))))
        return 0
    from hpcdist.bench.moe_quality import prepared
    data = prepared(args.out)
    shape = shape_of(args.shape)
    print(f"GPT {shape['n_layer']}x{shape['n_embd']}, block {shape['block_size']}, batch "
          f"{args.batch}, {args.steps} steps, {args.threads} threads, one process each", flush=True)
    rounds, ratios = [], []
    for k in range(max(1, args.rounds)):
        rows = one_round(data, args, torch_first=k % 2 == 1)
        if args.rounds > 1:
            print(f"round {k + 1} of {args.rounds} ({next(iter(rows))} first)")
        for who in ("hpcdist", "nanoGPT-style PyTorch"):
            row = rows[who]
            print(f"{who:22s} {row['tokens_per_s']:10,.0f} tok/s   median step "
                  f"{row['step_ms']:7.1f} ms   loss after {args.steps} steps {row['loss']:.4f}")
        ratios.append(rows["hpcdist"]["tokens_per_s"] /
                      rows["nanoGPT-style PyTorch"]["tokens_per_s"])
        print(f"hpcdist / PyTorch tokens per second: {ratios[-1]:.3f} (target >= 1.15)",
              flush=True)
        rounds.append(rows)
    if len(ratios) > 1:
        print(f"median over {len(ratios)} rounds: {float(np.median(ratios)):.3f} (each: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}; target >= 1.15)")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rounds[0] if len(rounds) == 1 else {"rounds": rounds, "ratios": ratios}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
