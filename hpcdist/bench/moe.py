"""Mixture of experts: step time and the all-to-all's share of it, by EP size, top-k and
capacity factor, beside the alpha-beta prediction:
``python -m hpcdist.bench moe [--ranks 4] [--experts 8] [--steps 5]``.

Each configuration trains a GPT with an MoE MLP in every block (DP over all ranks, EP over
``ep`` of them): a warm-up step, then ``--steps`` timed ones. The all-to-all's time: this
rank's time inside the EP group's all-to-alls (every call timed, backward too); predicted:
the alpha-beta model's time for the same calls (alpha, beta from a ping-pong). Load: the
busiest expert's assignments over the mean. The rest: docs/moe.md. Writes
runs/bench_moe.json and runs/bench_moe.png (each step split into all-to-all and the rest).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser


def configs(ranks: int, experts: int) -> list:
    out = []
    for ep in [e for e in (1, 2, 4, 8) if ranks % e == 0 and experts % e == 0]:
        for k in (1, 2):
            for cap in (0.0, 1.0):
                out.append({"ep": ep, "top_k": k, "capacity_factor": cap})
    ep = max(c["ep"] for c in out)
    if ep > 1:                 # a shared expert, run while the dispatch travels or before it
        out += [{"ep": ep, "top_k": 2, "capacity_factor": 0.0, "shared_experts": 1,
                 "overlap": on} for on in (False, True)]
    return out


def measure(args, comm, fields: dict, links) -> dict:
    import numpy as np
    from hpcdist import data as D
    from hpcdist.comm.model import predict
    from hpcdist.nn.moe import moe_layers
    from hpcdist.parallel.strategy import build_strategy
    from hpcdist.run.config import TrainConfig
    from hpcdist.run.loop import train_step
    settings = {k: v for k, v in fields.items() if k != "overlap"}
    cfg = TrainConfig(task="sort", n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                      batch_size=args.batch, experts=args.experts, steps=args.steps + 1,
                      warmup=0, log_every=10 ** 9, out_dir=tempfile.gettempdir(), **settings)
    train_set, _ = D.datasets_of(cfg)
    model, strategy = build_strategy(cfg, comm, train_set)
    sampler = D.DistributedSampler(len(train_set), cfg.batch_size, strategy.batch_comm.rank,
                                   strategy.batch_comm.size)
    layers = moe_layers(model)
    train_step(cfg, strategy, train_set, sampler, 1, 1e-3)        # warm-up
    for m in layers:
        if m.exchange is not None:
            m.exchange.calls = []
            m.exchange.overlap = fields.get("overlap", True)
    a, b = links
    P = fields["ep"]
    steps, load, dropped = [], [], 0
    for s in range(2, args.steps + 2):
        comm.barrier()
        t0 = time.perf_counter()
        rec = train_step(cfg, strategy, train_set, sampler, s, 1e-3)
        took = time.perf_counter() - t0
        calls = [c for m in layers if m.exchange is not None for c in m.exchange.calls]
        for m in layers:
            if m.exchange is not None:
                m.exchange.calls = []
        steps.append([took, sum(c[1] for c in calls),
                      sum(predict("alltoall", c[0], P, a, b) for c in calls),
                      sum(c[0] for c in calls)])
        load.append(rec["moe_load"])
        dropped += rec["moe_dropped"]
    steps = np.array(steps)
    mine = np.array([np.median(steps[:, 0]) * 1e3, np.median(steps[:, 1]) * 1e3,
                     np.median(steps[:, 1] / steps[:, 0]), np.median(steps[:, 2]) * 1e3,
                     np.median(steps[:, 3])], dtype=np.float64)
    mean = comm.allreduce(mine) / comm.size          # medians over the steps, mean over ranks
    return {**fields, "step_ms": mean[0], "a2a_ms": mean[1], "share": mean[2],
            "predicted_ms": mean[3], "a2a_kib": mean[4] / 1024,
            "load": float(np.mean(load)), "dropped": dropped / args.steps}


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.comm.model import fit_alpha_beta
    comm = Communicator()
    links = fit_alpha_beta(comm.mpi, big=1 << 20, iters=(100, 5))
    links = tuple(float(x) for x in comm.mpi.bcast(links, root=0))
    for fields in configs(comm.size, args.experts):
        row = measure(args, comm, fields, links)
        if comm.rank == 0:
            emit({**row, "alpha_us": links[0] * 1e6, "gbps": 1e-9 / links[1] if links[1] else 0})
    return 0


def plot(rows: list, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [f"EP {r['ep']}, k {r['top_k']}" + (f", cap {r['capacity_factor']:g}"
                                                  if r["capacity_factor"] else "")
              + (f", shared {'overlapped' if r['overlap'] else 'before'}"
                 if r.get("shared_experts") else "") for r in rows]
    a2a = [r["a2a_ms"] for r in rows]
    rest = [r["step_ms"] - r["a2a_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(labels, rest, label="compute and the rest")
    ax.bar(labels, a2a, bottom=rest, label="EP all-to-all (measured)")
    ax.scatter(labels, [r + p for r, p in zip(rest, [r["predicted_ms"] for r in rows])],
               color="k", marker="_", s=300, label="rest + all-to-all predicted (alpha-beta)")
    ax.set_ylabel("ms per step")
    ax.set_title("MoE step time by expert-parallel size, top-k and capacity factor")
    ax.tick_params(axis="x", rotation=45)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    p = Parser(prog="python -m hpcdist.bench moe", description=__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after a warm-up one)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--json", default=os.path.join("runs", "bench_moe.json"))
    p.add_argument("--png", default=os.path.join("runs", "bench_moe.png"))
    p.add_argument("--quality", action="store_true",
                   help="instead: MoE against a dense GPT with the same active parameters on "
                        "real text (bench/moe_quality.py); --steps counts training steps")
    p.add_argument("--eval-every", type=int, default=100, help="--quality: held-out every N")
    p.add_argument("--quality-out", default=os.path.join("runs", "moe_quality"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quality:
        from hpcdist.bench.moe_quality import quality
        return quality(args)
    rows = relaunch("moe", args.ranks, argv)
    print(f"MoE GPT {args.n_layer}x{args.n_embd}, {args.experts} experts in every block, "
          f"batch {args.batch} per rank, {args.ranks} ranks (DP {args.ranks}; EP of them), "
          f"fp32; all-to-all: this rank's time in the EP group's all-to-alls per step")
    if rows:
        print(f"links fitted by ping-pong: alpha {rows[0]['alpha_us']:.1f} us, "
              f"{rows[0]['gbps']:.2f} GB/s")
    for r in rows:
        r["share_pct"] = 100 * r["share"]
    for r in rows:
        r["shared"] = ("1, overlapped" if r.get("overlap") else "1, before") \
            if r.get("shared_experts") else "-"
    print(table(rows, [("EP", "ep", "d"), ("top-k", "top_k", "d"),
                       ("capacity", "capacity_factor", ".2f"), ("shared expert", "shared", "s"),
                       ("ms/step", "step_ms", ".1f"),
                       ("a2a ms", "a2a_ms", ".2f"), ("a2a %", "share_pct", ".1f"),
                       ("predicted ms", "predicted_ms", ".2f"), ("a2a KiB", "a2a_kib", ".1f"),
                       ("load max/mean", "load", ".2f"), ("dropped", "dropped", ".0f")]))
    write_json(args.json, rows)
    png = plot(rows, args.png)
    print(f"wrote {args.json}" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    return 0
