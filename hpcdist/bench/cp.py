"""Context parallelism measured: ``python -m hpcdist.bench cp [--ranks 4]``.

The rest of this design: docs/context-parallel.md, "hpcdist/bench/cp.py"."""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, pyplot, relaunch, table, write_json
from ..host.cli import Parser


def comm_model(impl: str, n: int, layers: int, B: int, T: int, C: int, *, e: int, a: float,
               b: float) -> float:
    """Seconds one rank spends in context-parallel messages per step (alpha-beta, even split:
    each message alpha + bytes * beta, one after another)."""
    if n == 1:
        return 0.0
    blk = 2 * B * (T / n) * C * e                    # one rank's K and V (or dK and dV)
    if impl == "ring":
        msgs, nbytes = 3 * n - 2, (3 * n - 2) * blk   # forward n-1; backward n-1 + n
    else:
        msgs, nbytes = 4 * (n - 1), 8 * (n - 1) * B * (T / n) * (C / n) * e
    return layers * (msgs * a + nbytes * b)


def _config(args, data, T, cp, impl, out):
    from hpcdist.run.config import TrainConfig
    return TrainConfig(task="text", data=data, block_size=T, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, batch_size=1, steps=args.steps,
                       cp=cp, cp_impl=impl, warmup=0, log_every=10 ** 9, out_dir=out,
                       trace_memory=True, eval_batch=1)


def measure(args, comm, data, T, cp, impl, *, steps, record=None) -> dict:
    """Train ``steps`` steps of sequences of T; {peak bytes (max over ranks), median ms, cp
    seconds per step (this rank)}."""
    import numpy as np
    from hpcdist import data as D
    from hpcdist.autograd import memtrace
    from hpcdist.host import timeline
    from hpcdist.parallel.strategy import build_strategy
    from hpcdist.run.loop import train_step
    cfg = _config(args, data, T, cp, impl, tempfile.gettempdir())
    train_set, _ = D.datasets_of(cfg)
    _, strategy = build_strategy(cfg, comm, train_set)
    sampler = D.DistributedSampler(len(train_set), 1, strategy.batch_comm.rank,
                                   strategy.batch_comm.size)
    memtrace.enable(args.memory)
    rec = timeline.Recorder(comm.rank) if record is None else record
    timeline.activate(rec)
    peaks, ms = [], []
    try:
        for s in range(1, steps + 1):
            r = train_step(cfg, strategy, train_set, sampler, s, 1e-3)
            peaks.append(r.get("memory_step_peak", 0))
            ms.append(r["step_ms"])
    finally:
        timeline.deactivate()
        memtrace.enable(False)
        if strategy.mesh is not None:
            strategy.mesh.close()
    cp_ns = sum(t1 - t0 for name, cat, _, t0, t1, _ in rec.events
                if cat == "cp" and name != "cp block")
    peak = int(comm.allreduce(np.array([max(peaks)], dtype=np.int64), op="max")[0])
    return {"peak": peak, "ms": float(np.median(ms[1:] or ms)), "cp_ms": cp_ns / 1e6 / steps}


def longest(args, comm, data, cp, impl, budget) -> dict:
    """The longest T (a multiple of 2 cp) whose step peak stays within ``budget`` bytes."""
    fits, miss, T = None, None, args.start
    while T <= args.max_seq:
        if measure(args, comm, data, T, cp, impl, steps=2)["peak"] <= budget:
            fits, T = T, 2 * T
        else:
            miss = T
            break
    if fits is None:
        return {"cp": cp, "impl": impl, "longest": 0}
    if miss is None:
        return {"cp": cp, "impl": impl, "longest": fits, "capped": True}
    for _ in range(args.bisect):
        mid = (fits + miss) // 2 // (2 * cp) * (2 * cp)
        if mid in (fits, miss):
            break
        if measure(args, comm, data, mid, cp, impl, steps=2)["peak"] <= budget:
            fits = mid
        else:
            miss = mid
    return {"cp": cp, "impl": impl, "longest": fits, "first_miss": miss}


def worker(args) -> int:
    import numpy as np
    from hpcdist.host import timeline
    from hpcdist.comm import Communicator
    from hpcdist.comm.model import fit_links
    comm = Communicator()
    data = comm.mpi.bcast(os.path.join(tempfile.mkdtemp(), "letters.txt") if comm.rank == 0
                          else "", root=0)
    if comm.rank == 0:
        letters = np.random.default_rng(0).integers(97, 123, size=args.text_chars)
        with open(data, "w") as f:
            f.write(bytes(letters.astype(np.uint8)).decode())
    comm.barrier()
    a, b = fit_links(comm, big=1 << 20)["intra"]
    if comm.rank == 0:
        emit({"part": "links", "alpha_us": a * 1e6, "beta_gbs": 1e-9 / b if b else None})
    if not args.skip_memory:
        args.memory = True
        for cp in [c for c in (1, 2, 4) if comm.size % c == 0]:
            for impl in ("ring", "ulysses") if cp > 1 else ("-",):
                if impl == "ulysses" and args.n_head % cp:
                    continue
                row = longest(args, comm, data, cp, "ring" if cp == 1 else impl,
                              args.budget_mb * 2 ** 20)
                if comm.rank == 0:
                    emit({"part": "memory", **row, "impl": impl})
    args.memory = False
    n = comm.size
    for T in args.seqs:
        for impl in ("ring", "ulysses"):
            if impl == "ulysses" and args.n_head % n:
                continue
            got = measure(args, comm, data, T, n, impl, steps=args.steps)
            model = comm_model(impl, n, args.n_layer, 1, T, args.n_embd, e=4, a=a, b=b)
            if comm.rank == 0:
                emit({"part": "time", "impl": impl, "T": T, "step_ms": got["ms"],
                      "comm_ms": got["cp_ms"], "model_ms": model * 1e3})
    rec = timeline.Recorder(comm.rank)
    measure(args, comm, data, args.seqs[-1], n, "ring", steps=2, record=rec)
    spans = [(name, (t0 - rec.events[0][3]) / 1e6, (t1 - t0) / 1e6)
             for name, cat, _, t0, t1, _ in rec.events if cat == "cp"]
    everyone = comm.mpi.gather(spans, root=0)
    if comm.rank == 0:
        busy = [sum(d for nm, _, d in s if nm == "cp block") for s in everyone]
        wait = [sum(d for nm, _, d in s if nm == "cp wait") for s in everyone]
        emit({"part": "overlap", "T": args.seqs[-1], "block_ms": busy, "wait_ms": wait,
              "spans": everyone})
    return 0


def plot(rows, path) -> None:
    plt = pyplot()
    over = next(r for r in rows if r["part"] == "overlap")
    fig, ax = plt.subplots(figsize=(11, 0.8 + 0.5 * len(over["spans"])))
    colours = {"cp block": "#4c72b0", "cp wait": "#c44e52"}
    seen = set()
    for rank, spans in enumerate(over["spans"]):
        for name, t0, d in spans:
            ax.broken_barh([(t0, d)], (rank - 0.4, 0.8), color=colours.get(name, "#999999"),
                           label=None if name in seen else name)
            seen.add(name)
    ax.set_yticks(range(len(over["spans"])))
    ax.set_yticklabels([f"rank {r}" for r in range(len(over["spans"]))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the rank's first ring span (2 steps)")
    ax.set_title(f"ring attention, T {over['T']}: attention per K/V block and the time "
                 "waiting for the next", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench cp", description=__doc__,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="steps per measurement, part (b)")
    ap.add_argument("--budget-mb", type=float, default=24.0,
                    help="activation memory per rank, part (a)")
    ap.add_argument("--start", type=int, default=128, help="first sequence length tried")
    ap.add_argument("--max-seq", type=int, default=16384)
    ap.add_argument("--bisect", type=int, default=3, help="bisection steps after doubling")
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048],
                    help="sequence lengths, part (b)")
    ap.add_argument("--text-chars", type=int, default=200_000)
    ap.add_argument("--skip-memory", action="store_true", help="parts (b) and (c) only")
    ap.add_argument("--out", default="runs/bench_cp.json")
    ap.add_argument("--plot", default="runs/bench_cp_ring.png",
                    help="the overlap picture ('' for none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("cp", args.ranks, argv)
    links = next(r for r in rows if r["part"] == "links")
    print(f"context parallelism | {args.ranks} ranks | GPT {args.n_layer}x{args.n_embd} "
          f"({args.n_head} heads), batch 1, fp32 | ping-pong: alpha {links['alpha_us']:.1f} us")
    memory = [r for r in rows if r["part"] == "memory"]
    if memory:
        base = next((r["longest"] for r in memory if r["cp"] == 1), 0)
        for r in memory:
            r["x_cp1"] = r["longest"] / base if base else None
        print(f"(a) longest sequence within {args.budget_mb:g} MiB of activations per rank")
        print(table(memory, [("cp", "cp", "d"), ("impl", "impl", "s"),
                             ("longest T", "longest", "d"),
                             ("first miss", "first_miss", "d"), ("x cp 1", "x_cp1", ".2f")]))
    print(f"(b) step time against sequence length at cp {args.ranks}")
    print(table([r for r in rows if r["part"] == "time"],
                [("impl", "impl", "s"), ("T", "T", "d"), ("step ms", "step_ms", ".1f"),
                 ("comm ms", "comm_ms", ".1f"), ("model ms", "model_ms", ".2f")]))
    over = next(r for r in rows if r["part"] == "overlap")
    hidden = [1 - w / (w + blk) if w + blk else 0.0
              for w, blk in zip(over["wait_ms"], over["block_ms"])]
    print(f"(c) ring at T {over['T']}, 2 steps: per rank attention ms "
          + ", ".join(f"{x:.1f}" for x in over["block_ms"]) + " | waiting ms "
          + ", ".join(f"{x:.1f}" for x in over["wait_ms"]) + " | share of ring time computing "
          + ", ".join(f"{x:.2f}" for x in hidden))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    write_json(args.out, {"ranks": args.ranks, "rows": rows})
    print(f"wrote {args.out}")
    return 0
