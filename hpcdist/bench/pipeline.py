"""Pipeline schedules measured: ``python -m hpcdist.bench pipeline``.

At P = 2 (two ranks), each schedule trains a 4-block GPT for a few steps with ``--trace``; from
the trace, per step: the bubble (idle share of stage-time between the step's first pipeline
action and its last; time in sends and receives counts as idle), the peak stash per stage
(micro-batches whose F has run and whose B or W has not), the median time of each F, B, I and
W per stage, and a COMM's transfer time (10th percentile: its data had already arrived).
Against: the theory, (P-1)/(m+P-1) for GPipe and 1F1B, (P-1)/(vm+P-1) interleaved, which
assumes equal stages and free communication; and the verifier's simulation of the same
schedule with the per-stage costs and transfer time measured here. At P = 4 the simulation
with the mean measured costs. And the median step time of each schedule.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser

RUNS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def measure(doc: dict):
    """From a pipeline trace: (bubble of each step, peak stash per rank, median time of each
    kind of action per rank, the transfer time of one COMM: its 10th percentile, when the data
    had already arrived)."""
    from hpcdist.bench.schedule import bubble_of
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"] == "step" and e["pid"] == 0),
                   key=lambda e: e["ts"])
    pipe = [e for e in spans if e.get("cat") == "pipeline"]
    acts = [e for e in pipe if e["args"]["kind"] != "COMM"]
    ranks = sorted({e["pid"] for e in acts})
    bubbles, costs, comm = [], {}, []
    for st in steps[2:]:                              # after two warm-up steps
        inside = [e for e in pipe if st["ts"] <= e["ts"] <= st["ts"] + st["dur"]]
        work = [e for e in inside if e["args"]["kind"] != "COMM"]
        bubbles.append(bubble_of([[(0, 0, 0, e["ts"], e["ts"] + e["dur"]) for e in work
                                   if e["pid"] == r] for r in ranks]))
        for e in work:
            costs.setdefault(e["args"]["kind"], {}).setdefault(e["pid"], []).append(e["dur"] / 1e3)
        comm += [e["dur"] / 1e3 for e in inside if e["args"]["kind"] == "COMM"]
    peaks = {}
    for r in ranks:
        live = peak = 0
        for e in sorted((e for e in acts if e["pid"] == r), key=lambda e: e["ts"]):
            live += {"F": 1, "B": -1, "W": -1}.get(e["args"]["kind"], 0)
            peak = max(peak, live)
        peaks[r] = peak
    per_stage = {k: [float(np.median(v[r])) for r in ranks] for k, v in costs.items()}
    return bubbles, peaks, per_stage, float(np.percentile(comm, 10)) if comm else 0.0


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.parallel import schedules as S
    from hpcdist.train import train
    comm = Communicator()
    P, m = comm.size, args.micro_batches
    out = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    for name, v in RUNS:
        trace = os.path.join(out, f"{name}.json")
        cfg = TrainConfig(pp=P, schedule=name, virtual_stages=v, micro_batches=m,
                          n_layer=args.n_layer, n_embd=args.n_embd, n_head=4,
                          batch_size=args.batch, steps=args.steps, log_every=10 ** 9,
                          trace=trace, out_dir=os.path.join(out, name))
        final = train(cfg, comm, log=lambda *a: None)
        if comm.rank != 0:
            continue
        with open(trace) as f:
            bubbles, peaks, costs, send = measure(json.load(f))
        sim_costs = dict(costs, send=send)
        if "B" not in sim_costs:                          # zb-h1 measured I and W
            sim_costs["B"] = [i + w for i, w in zip(costs["I"], costs["W"])]
        for k, half in (("I", 0.5), ("W", 0.5)):
            sim_costs.setdefault(k, [b * half for b in sim_costs["B"]])
        mean = {k: float(np.mean(x)) for k, x in sim_costs.items() if k != "send"}
        plan = dict(mean, send=send)                      # ZB-H1 plans with these (the run did)
        sim = S.verify(S.make(name, P, m, v, plan), P, m, v, sim_costs)
        try:                                              # e.g. interleaved needs m % 4 == 0
            sim4 = S.verify(S.make(name, 4, m, v, plan), 4, m, v, plan).bubble
        except S.ScheduleError:
            sim4 = None
        theory = (P - 1) / (v * m + P - 1) if name != "zb-h1" else None
        emit({"schedule": name + (f" v{v}" if v > 1 else ""), "P": P, "m": m,
              "bubble": float(np.median(bubbles)), "theory": theory, "simulated": sim.bubble,
              "peak_stash": [peaks[r] for r in sorted(peaks)],
              "promised": S.promised_stash(name, P, m, v),
              "sim4_bubble": sim4, "theory4": (3 / (v * m + 3)) if theory else None,
              "step_ms": final["step_ms_median"], "send_ms": send,
              "costs_ms": {k: [round(x, 2) for x in xs] for k, xs in costs.items()}})
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench pipeline", description=__doc__)
    ap.add_argument("--ranks", type=int, default=2, help="pipeline stages measured (P)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="runs/bench_pipeline.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("pipeline", args.ranks, argv)
    print(f"pipeline schedules | P = {args.ranks} measured, P = 4 simulated with the measured "
          f"costs | m = {args.micro_batches} | GPT {args.n_layer}x{args.n_embd}, batch "
          f"{args.batch}")
    for r in rows:
        r["bubble_pct"] = 100 * r["bubble"]
        r["theory_pct"] = 100 * r["theory"] if r["theory"] is not None else None
        r["sim_pct"] = 100 * r["simulated"]
        r["gap_pts"] = r["bubble_pct"] - r["sim_pct"]
        r["sim4_pct"] = 100 * r["sim4_bubble"] if r["sim4_bubble"] is not None else None
        r["theory4_pct"] = 100 * r["theory4"] if r["theory4"] is not None else None
        r["stash"] = "/".join(map(str, r["peak_stash"]))
        r["bound"] = "/".join(map(str, r["promised"]))
        r["costs"] = " ".join(f"{k} {'/'.join(map(str, v))}" for k, v in
                              sorted(r["costs_ms"].items())) + f" COMM {r['send_ms']:.2f}"
    print(table(rows, [("schedule", "schedule", "s"), ("bubble %", "bubble_pct", ".1f"),
                       ("theory %", "theory_pct", ".1f"), ("simulated %", "sim_pct", ".1f"),
                       ("meas - sim", "gap_pts", "+.1f"), ("P=4 sim %", "sim4_pct", ".1f"),
                       ("P=4 theory", "theory4_pct", ".1f"), ("stash", "stash", "s"),
                       ("bound", "bound", "s"), ("step ms", "step_ms", ".1f")]))
    print("median op times per stage (ms): " + "; ".join(f"{r['schedule']}: {r['costs']}"
                                                        for r in rows))
    write_json(args.out, {"ranks": args.ranks, "rows": rows})
    print(f"wrote {args.out}")
    return 0
