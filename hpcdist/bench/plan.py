"""The planner against our own runs: ``python -m hpcdist.bench plan``.

Calibrates the planner (hpcdist/plan/) on this machine — the FLOP/s a 1-rank training step
reaches, shared by the ranks that share the cores, and the links from a ping-pong — then runs
each layout at ``--ranks`` ranks (the same GPT and global batch) and prints the planner's
step time beside the measured median, and the rank agreement of the two orders (Spearman).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

import numpy as np

from hpcdist.bench.common import (end_job, mpiexec, run_job, start_job, table, train_args,
                                  write_json)
from hpcdist.run.config import TrainConfig
from hpcdist import nn
from hpcdist.data import make_task
from ..host.cli import Parser

# (label, train flags, planner Layout fields) at 8 ranks; global batch fixed
LAYOUTS = [
    ("DP 8", dict(), dict(tp=1, pp=1, zero=0)),
    ("DP 8 ZeRO-1", dict(zero=1), dict(tp=1, pp=1, zero=1)),
    ("DP 8 ZeRO-2", dict(zero=2), dict(tp=1, pp=1, zero=2)),
    ("DP 8 ZeRO-3", dict(zero=3), dict(tp=1, pp=1, zero=3)),
    ("DP 4 x TP 2", dict(tp=2), dict(tp=2, pp=1, zero=0)),
    ("DP 2 x PP 4 1F1B", dict(pp=4, schedule="1f1b"), dict(tp=1, pp=4, zero=0, schedule="1f1b")),
    ("DP 2 x PP 4 GPipe", dict(pp=4, schedule="gpipe"), dict(tp=1, pp=4, zero=0, schedule="gpipe")),
    ("DP 2 x PP 4 ZB-H1", dict(pp=4, schedule="zb-h1"), dict(tp=1, pp=4, zero=0, schedule="zb-h1")),
    ("DP 2 x PP 4 interleaved v2", dict(pp=4, schedule="interleaved", virtual_stages=2),
     dict(tp=1, pp=4, zero=0, schedule="interleaved", virtual=2)),
    ("DP 2 x TP 2 x PP 2", dict(tp=2, pp=2), dict(tp=2, pp=2, zero=0, schedule="1f1b")),
]


def _command(n: int, flags: dict, out: str) -> list:
    return [mpiexec(), "-n", str(n), sys.executable, "-m", "hpcdist.train"] + \
        train_args(flags, out)




def _median_step(out: str) -> float:
    """Median step ms of a finished run (its first 3 steps left out)."""
    times = [json.loads(line)["step_ms"] for line in open(os.path.join(out, "metrics.jsonl"))
             if '"loss"' in line and '"step"' in line]
    return float(np.median(times[3:] if len(times) > 3 else times))


def _train(n: int, flags: dict, base: dict, out: str, env=None) -> float:
    """Median step ms of a run."""
    args = _command(n, {**base, **flags}, out)
    r = run_job(args, timeout=900, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return _median_step(out)


def _links(n: int) -> tuple:
    """(alpha s, bytes/s, seconds per small collective call) with ``n`` ranks running:
    a ping-pong between two of them, and the median of 200 1-KiB allreduces over all."""
    code = ("import json, time, numpy as np; from hpcdist.comm import Communicator; "
            "from hpcdist.comm.model import fit_links; c = Communicator(); "
            "l = fit_links(c, big=4 << 20); x = np.ones(256, np.float32); ts = []\n"
            "for _ in range(200):\n"
            "    c.barrier(); t = time.perf_counter(); c.allreduce(x); "
            "ts.append(time.perf_counter() - t)\n"
            "print(json.dumps(list(l['intra']) + [float(np.median(ts))])) if c.rank == 0 "
            "else None")
    r = run_job([mpiexec(), "-n", str(n), sys.executable, "-c", code], timeout=300)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    alpha, beta, call = json.loads(r.stdout.strip().splitlines()[-1])
    return alpha, 1.0 / beta if beta else 1e12, call


_SYNC = """
import json, time, numpy as np
from hpcdist.comm import Communicator
c = Communicator(); pair = c.split(c.rank // 2)
a = np.random.default_rng(c.rank).standard_normal((160, 160)).astype(np.float32)
x = np.ones(256, np.float32)
def run(sync, n=60):
    c.barrier(); t = time.perf_counter()
    for _ in range(n):
        for _ in range(4):
            a @ a
        if sync:
            pair.allreduce(x)
    return (time.perf_counter() - t) / n
run(True, 10)
times = {s: min(run(s) for _ in range(3)) for s in (False, True, False, True)}
cost = c.allreduce(np.array([times[True] - times[False]]), op="avg")[0]
print(json.dumps(max(float(cost), 0.0))) if c.rank == 0 else None
"""


def _loaded(n: int, flags: dict, tmp: str) -> float:
    """Median step ms of ``n`` one-rank runs started together (each its own job)."""
    procs, outs = [], []
    cores = len(os.sched_getaffinity(0))
    # the threads each rank of an n-rank job would get, not a lone run's whole machine
    env = dict(os.environ, HPCDIST_THREADS=str(max(1, cores // n)))
    for i in range(n):
        outs.append(os.path.join(tmp, f"loaded{i}"))
        procs.append(start_job(_command(1, flags, outs[-1]), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:
        _, err = p.communicate(timeout=900)
        end_job(p)                                     # (reaped: no longer the bench's)
        if p.returncode != 0:
            raise RuntimeError(f"a loaded calibration run failed:\n{err[-2000:]}")
    return float(np.median([_median_step(out) for out in outs]))


def _sync_cost(n: int) -> float:
    """Seconds one blocking exchange costs a rank while the other ranks compute: ``n`` ranks
    in pairs, each loop a little compute and (or not) a short allreduce with its partner.
    With more ranks than cores the partner is often descheduled: this, not the link's
    alpha, is what each tensor-parallel collective, ZeRO-3 gather and pipeline send costs
    on an oversubscribed machine."""
    r = run_job([mpiexec(), "-n", str(n), sys.executable, "-c", _SYNC], timeout=300)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def _model(args, arch: str = "gpt"):
    """The planner's view of the model these runs train (the default task's sequences): a
    GPT, or another family with ``FAMILY_SETTINGS``' settings."""
    from hpcdist import plan as P
    cfg = TrainConfig()
    train_set = make_task(cfg.task, length=cfg.length, num_digits=cfg.num_digits,
                          block_size=cfg.block_size)[0]
    return P.Model(args.n_layer, args.n_embd, args.n_head, train_set.block_size,
                   train_set.vocab_size, arch=arch,
                   settings=tuple(FAMILY_SETTINGS.get(arch, {}).items()))


# the runs of --memory-arch: grouped-query attention (two kv heads) in the rotary families,
# Gemma with a head size of its own (not n_embd / n_head)
FAMILY_SETTINGS = {"llama": dict(n_kv_head=2), "qwen2": dict(n_kv_head=2),
                   "gemma": dict(n_kv_head=2, head_dim=32)}


def main(argv=None) -> int:
    from hpcdist import plan as P
    ap = Parser(prog="python -m hpcdist.bench plan", description=__doc__)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each layout (the fastest "
                    "median counts)")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--memory", action="store_true",
                    help="only the memory per rank (model state, activations), planner vs "
                         "--trace-memory training runs (4 ranks, 4 layers)")
    ap.add_argument("--memory-embd", type=int, default=256, help="--memory: n_embd")
    ap.add_argument("--memory-arch", default="gpt", choices=list(nn.FAMILIES),
                    help="--memory: the family (the rotary ones with two kv heads; Gemma's "
                         "heads of 32)")
    ap.add_argument("--memory-layouts", help="--memory: only these layouts (comma-separated "
                    "labels of plan_memory.MEMORY_LAYOUTS)")
    ap.add_argument("--published", action="store_true",
                    help="only the comparison with Narayanan et al.'s Table 1 (no runs)")
    args = ap.parse_args(argv)
    if args.memory:
        # wider and shorter than the timing runs: activations dominate the Python objects
        # of the graph (a few hundred bytes per op) as they do at any real size
        args.n_embd, args.n_layer = args.memory_embd, 4
        model = _model(args, args.memory_arch)
        base = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                    log_every=10 ** 6, batch_size=32, arch=args.memory_arch,
                    **FAMILY_SETTINGS.get(args.memory_arch, {}))
        from hpcdist.bench.plan_memory import memory_rows
        rows = memory_rows(model, base, tempfile.mkdtemp(),
                           only=args.memory_layouts.split(",") if args.memory_layouts else None)
        print(table(rows, [("layout", "layout", "s"), ("state", "kind", "s"),
                           ("planner B", "planner", "d"), ("run B", "run", "d"),
                           ("run/planner", "ratio", ".3f")]))
        write_json(os.path.join(args.out, "bench_plan_memory.json"), rows)
        return 0
    if args.published:
        from hpcdist.bench.plan_published import llama_published, published_comparison
        rows = published_comparison()
        print(table(rows, [("model", "model", "s"), ("published", "published", "s"),
                           ("TFLOP/s", "published_tflops", "d"),
                           ("planner's estimate", "estimate_tflops", ".0f"),
                           ("its mesh rank", "rank", "d"),
                           ("rank, 2021 features", "rank_2021", "d"),
                           ("planner's best", "best", "s"),
                           ("best TFLOP/s", "best_tflops", ".0f")]))
        print(table(llama_published(), [("model", "model", "s"), ("published", "published", "s"),
                                        ("its layout", "layout", "s"),
                                        ("planner's estimate", "estimate", "s"),
                                        ("planner's best", "best", "s")]))
        return 0
    n, B = args.ranks, args.global_batch
    model = _model(args)
    base = dict(steps=args.steps, n_layer=args.n_layer, n_embd=args.n_embd,
                n_head=args.n_head, log_every=10 ** 6)
    tmp = tempfile.mkdtemp()
    settings = P.Settings(efficiency=1.0, dtype="fp32", buffers=0.0, grad_bytes=4,
                          param_bytes=4, optimizer_bytes=8, activations="hpcdist")
    # calibration: one rank alone, three runs (the batch, an eighth of it, the batch at half
    # the width) give its FLOP/s, the cost of each byte its layers write (elementwise work,
    # FLOP-free) and its fixed cost per step (Python, per-op work): three unknowns, three
    # equations. Shared out over the ranks that will share the cores. A ping-pong, a short
    # allreduce, and a short exchange while the other ranks compute give the links and
    # the cost of a collective call inside a step
    small = max(B // n, 1)
    half = P.Model(model.layers, model.hidden // 2, model.heads, model.seq, model.vocab)
    one = [(model, B, {}), (model, small, {}), (half, B, {"n_embd": args.n_embd // 2})]
    A, t = [], []
    for i, (mdl, batch, extra) in enumerate(one):
        t.append(_train(1, dict(extra, batch_size=batch), base,
                        os.path.join(tmp, f"one{i}")) / 1e3)
        L1 = P.Layout(1, 1, 1, 0, batch, 1, "none", 1, False, False)
        written = mdl.layers * P.hpcdist_layer(mdl, L1, settings, "first")[0]
        A.append([mdl.flops(batch, False), 3 * written, 1.0])       # backward writes 2x
    inv_rate, byte_cost, fixed = np.linalg.solve(np.array(A), np.array(t))
    if min(inv_rate, byte_cost, fixed) <= 0:     # noise: fall back to FLOPs + fixed cost
        (inv_rate, fixed), byte_cost = np.linalg.solve(np.array(A)[:2, [0, 2]],
                                                      np.array(t[:2])), 0.0
        fixed = max(fixed, 0.0)
    rate = 1.0 / inv_rate
    cores = len(os.sched_getaffinity(0))
    # what sharing the cores costs: the eighth-batch step again, with n copies running at
    # once (more than n / cores when they also fight over caches and memory bandwidth)
    share = max(1.0, n / cores)                  # ranks per core
    loaded = _loaded(n, dict(base, batch_size=small), tmp) / 1e3
    slowdown = max(loaded / t[1], 1.0)
    per_rank = rate / slowdown
    alpha, bw, call = _links(n)
    sync = _sync_cost(n)
    gpu = P.GPU("this machine (a rank)", {"fp32": per_rank}, 24e9, bw, bw, alpha, alpha)
    settings = replace(settings, layer_overhead=fixed / (3 * args.n_layer) * slowdown,
                       byte_cost=byte_cost * slowdown, call_overhead=max(call, sync),
                       ranks_per_core=share)
    calibration = {"efficiency": 1.0, "peak_flops_per_rank": per_rank,
                   "layer_overhead_s": settings.layer_overhead,
                   "byte_cost_s": settings.byte_cost, "call_overhead_s": settings.call_overhead,
                   "ranks_per_core": share, "slowdown": slowdown, "nvlink": [alpha, bw],
                   "network": [alpha, bw]}
    rows = []
    for label, flags, fields in LAYOUTS:
        tp, pp = fields["tp"], fields["pp"]
        dp = n // (tp * pp)
        v = fields.get("virtual", 1)
        m = 2 * pp if pp > 1 else 1                      # train's default micro-batches
        L = P.Layout(tp, pp, dp, fields["zero"], B // dp // m, m,
                     fields.get("schedule", "none"), v, False, False)
        est = P.estimate(model, L, gpu, n, n, B, settings=settings)
        rows.append({"layout": label, "predicted_ms": est.step_s * 1e3, "runs": [],
                     "flags": dict(flags, batch_size=B // dp)})
    # each layout twice, in two passes (a slow spell of the shared machine hits one pass)
    for rep in range(args.repeats):
        for row in rows:
            row["runs"].append(_train(n, row["flags"], base, os.path.join(
                tmp, f"{row['layout'].replace(' ', '_')}_{rep}")))
    for row in rows:
        row.pop("flags")
        row["measured_ms"] = min(row["runs"])
        row["ratio"] = row["measured_ms"] / row["predicted_ms"]
    pred = np.argsort(np.argsort([r["predicted_ms"] for r in rows]))
    meas = np.argsort(np.argsort([r["measured_ms"] for r in rows]))
    k = len(rows)
    spearman = 1 - 6 * float(((pred - meas) ** 2).sum()) / (k * (k * k - 1))
    print(f"calibration: 1 rank {t[0] * 1e3:.1f} ms per step of {B} sequences, "
          f"{t[1] * 1e3:.1f} ms of {small}, {t[2] * 1e3:.1f} ms of {B} at half the width -> "
          f"{rate / 1e9:.2f} GFLOP/s, {byte_cost * 1e9:.3f} ns per byte written, "
          f"{fixed * 1e3:.1f} ms fixed per step; {n} copies at once on {cores} cores "
          f"{loaded * 1e3:.1f} ms ({slowdown:.1f}x) -> {per_rank / 1e9:.2f} GFLOP/s per rank, "
          f"{settings.layer_overhead * 1e3:.2f} ms per layer pass; link alpha "
          f"{alpha * 1e6:.1f} us, {bw / 1e9:.2f} GB/s; a short allreduce {call * 1e6:.0f} us, "
          f"{sync * 1e6:.0f} us while the others compute")
    print(table(rows, [("layout", "layout", "s"), ("predicted ms", "predicted_ms", ".1f"),
                       ("measured ms", "measured_ms", ".1f"), ("meas/pred", "ratio", ".2f")]))
    print(f"rank agreement (Spearman) of predicted and measured order: {spearman:.2f}")
    write_json(os.path.join(args.out, "bench_plan.json"),
               {"calibration": calibration, "rows": rows, "spearman": spearman})
    return 0


if __name__ == "__main__":
    sys.exit(main())
