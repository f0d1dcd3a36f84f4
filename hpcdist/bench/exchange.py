"""Every gradient exchange on one task: ``python -m hpcdist.bench exchange``.

Dense DDP, fp16 on the wire, Top-K (DGC), PowerSGD at two ranks and the asynchronous
parameter server at three staleness bounds, each trained from the same start on the default
task with the same number of workers (``--workers``; the parameter server adds one server
rank, so the benchmark runs on workers + 1 ranks and the collective methods leave the last
rank idle). For each: held-out accuracy after ``--steps`` steps, bytes a worker sends per
step, and time per step (the slowest rank's training time over the steps) without and with a
straggler (rank 0 sleeps ``--straggler-ms`` in every step; ``--straggler-steps`` steps).
For the parameter server a "step" is one optimizer step on the servers (W gradients); its
workers each run as many steps as their speed allows. Writes a JSON and a PNG of accuracy
against bytes.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, pyplot, relaunch, table, write_json

METHODS = [  # label, TrainConfig settings
    ("dense", {}),
    ("fp16", {"compress": "fp16"}),
    ("topk 0.01", {"compress": "topk", "density": 0.01, "compress_momentum": 0.0}),
    ("powersgd r1", {"compress": "powersgd", "rank": 1}),
    ("powersgd r4", {"compress": "powersgd", "rank": 4}),
    ("ps s=0", {"strategy": "ps", "max_staleness": 0}),
    ("ps s=4", {"strategy": "ps", "max_staleness": 4}),
    ("ps s=inf", {"strategy": "ps", "max_staleness": -1}),
]


def worker(args) -> int:
    from mpi4py import MPI

    from hpcdist.comm import Communicator
    from hpcdist.config import TrainConfig
    from hpcdist.train import train
    world = Communicator()
    W = world.size - 1
    workers = world.split(color=0 if world.rank < W else 1)
    out = world.mpi.bcast(tempfile.mkdtemp() if world.rank == 0 else "", root=0)
    chosen = [m for m in METHODS if not args.only or m[0] in args.only]
    for label, settings in chosen:
        row = {"method": label}
        ps = settings.get("strategy") == "ps"
        comm = world if ps else (workers if world.rank < W else None)
        for tag, steps, straggler in (("", args.steps, ""),
                                      ("_slow", args.straggler_steps,
                                       f"0:{args.straggler_ms:g}")):
            if not steps:
                continue
            cfg = TrainConfig(steps=steps, straggler=straggler, log_every=10 ** 9,
                              out_dir=os.path.join(out, label.replace(" ", "_") + tag),
                              **settings)
            final = train(cfg, comm, log=lambda *a: None) if comm is not None else {}
            took = world.mpi.allreduce(final.get("train_seconds", 0.0), op=MPI.MAX)
            hist = final.get("history") or []
            per_step = world.mpi.bcast(
                sum(h["bytes_sent"] for h in hist) / len(hist) if hist else 0.0, root=1)
            if world.rank == 0:
                row["ms_per_step" + tag] = took / steps * 1e3
                if not tag:
                    row.update(accuracy=final["accuracy"] * 100, bytes_per_step=per_step,
                               local_steps=len(hist))
                    for k in ("staleness_mean", "staleness_max", "clock_gap_max"):
                        row[k] = final.get(k)
                else:
                    row["straggler_steps_done"] = len(hist)
        if world.rank == 0:
            emit(row)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.bench exchange", description=__doc__)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--straggler-ms", type=float, default=50.0)
    ap.add_argument("--straggler-steps", type=int, default=100)
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="comma-separated method labels to run (default: all)")
    ap.add_argument("--out", default="runs/bench_exchange.json")
    ap.add_argument("--plot", default="runs/bench_exchange.png")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("exchange", args.workers + 1, argv)
    dense = next((r for r in rows if r["method"] == "dense"), rows[0])
    for r in rows:
        r["kib"] = r["bytes_per_step"] / 1024
        r["fewer"] = dense["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
        r["slowdown"] = r.get("ms_per_step_slow", 0) / r["ms_per_step"] if r.get(
            "ms_per_step_slow") else None
    print(f"gradient exchange | default task | {args.workers} workers (+1 server rank for ps) "
          f"| {args.steps} steps | straggler: rank 0 sleeps {args.straggler_ms:g} ms per step "
          f"({args.straggler_steps} steps)")
    print(table(rows, [("method", "method", "s"), ("held-out %", "accuracy", ".2f"),
                       ("KiB/step", "kib", ",.1f"), ("x fewer", "fewer", ".1f"),
                       ("ms/step", "ms_per_step", ".1f"),
                       ("ms/step slow", "ms_per_step_slow", ".1f"),
                       ("stale mean", "staleness_mean", ".2f"),
                       ("stale max", "staleness_max", "d"),
                       ("gap max", "clock_gap_max", "d")]))
    write_json(args.out, {"workers": args.workers, "steps": args.steps,
                          "straggler_ms": args.straggler_ms, "rows": rows})
    print(f"wrote {args.out}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["kib"], r["accuracy"])
        ax.annotate(r["method"], (r["kib"], r["accuracy"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KiB sent per step per worker")
    ax.set_ylabel("held-out accuracy %")
    ax.set_title(f"gradient exchanges, {args.workers} workers, {args.steps} steps")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")
    return 0
