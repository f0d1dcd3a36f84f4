"""``python -m hpcdist.bench plan --memory``: the planner's memory per rank beside
``--trace-memory`` training runs at 4 ranks, layout by layout (``MEMORY_LAYOUTS``): the model
state exactly, activations within 10% (tests/test_plan.py).

Every layout of one run of it trains in one MPI job (``job``: the trainer called once a
layout in the same 4 processes), so each rank imports, loads and self-checks its CPU kernels
once rather than once a layout — that start was most of a layout's run (about 5 of 8 s on 2
cores). Each run starts its tracing from nothing (memtrace), and what a run before it left
allocated is not traced: the layouts measure as they do in jobs of their own."""
from __future__ import annotations

import json
import os
import sys

from hpcdist.bench.common import mpiexec, run_job, train_args

# (label, train flags, planner Layout fields) at 4 ranks: model state and activations
MEMORY_LAYOUTS = [
    ("DP 4", dict(), dict(tp=1, pp=1, zero=0)),
    ("DP 4 ZeRO-1", dict(zero=1), dict(tp=1, pp=1, zero=1)),
    ("DP 4 ZeRO-2", dict(zero=2), dict(tp=1, pp=1, zero=2)),
    ("DP 4 ZeRO-3", dict(zero=3), dict(tp=1, pp=1, zero=3)),
    ("DP 4 recompute", dict(checkpoint_activations=True), dict(tp=1, pp=1, zero=0, recompute=True)),
    ("DP 2 x TP 2", dict(tp=2), dict(tp=2, pp=1, zero=0)),
    ("DP 2 x TP 2 SP", dict(tp=2, sequence_parallel=True), dict(tp=2, pp=1, zero=0, sp=True)),
    ("DP 2 x TP 2 SP recompute", dict(tp=2, sequence_parallel=True, checkpoint_activations=True),
     dict(tp=2, pp=1, zero=0, sp=True, recompute=True)),
    ("DP 2 x PP 2", dict(pp=2), dict(tp=1, pp=2, zero=0)),
    ("DP 2 x PP 2 ZeRO-1", dict(pp=2, zero=1), dict(tp=1, pp=2, zero=1)),
    ("DP 2 x PP 2 recompute", dict(pp=2, checkpoint_activations=True),
     dict(tp=1, pp=2, zero=0, recompute=True)),
    ("DP 2 x PP 2 interleaved v2", dict(pp=2, schedule="interleaved", virtual_stages=2),
     dict(tp=1, pp=2, zero=0, schedule="interleaved", virtual=2)),
    ("PP 4 GPipe", dict(pp=4, schedule="gpipe"), dict(tp=1, pp=4, zero=0, schedule="gpipe")),
    ("TP 2 x PP 2 SP recompute", dict(tp=2, pp=2, sequence_parallel=True,
                                       checkpoint_activations=True),
     dict(tp=2, pp=2, zero=0, sp=True, recompute=True)),
]


def memory_rows(model, base: dict, tmp: str, n: int = 4, only: list | None = None) -> list:
    """The planner's memory per rank beside a ``--trace-memory`` training run's, rank 0 (the
    first stage): parameters, gradients and optimizer state (fp32 run: 4 + 4 + 8 bytes per
    parameter) and activations at their most (hpcdist's layers).

    The runs average their gradients after the backward (``--no-overlap``): with overlap a
    bucket's average runs in the progress thread during the backward, and where the measure
    falls while it runs (recompute's nested backwards) its scratch counts too — up to a
    bucket's chunks, as the threads happen to interleave (the planner counts the graph)."""
    from hpcdist import plan as P
    settings = P.Settings(param_bytes=4, grad_bytes=4, optimizer_bytes=8, buffers=0.0,
                          activations="hpcdist")
    known = [label for label, _, _ in MEMORY_LAYOUTS]
    if only and set(only) - set(known):
        raise SystemExit(f"unknown layouts {sorted(set(only) - set(known))}: {known}")
    chosen = [(label, flags, f) for label, flags, f in MEMORY_LAYOUTS
              if not only or label in only]
    finals = _finals(n, [(label, dict(base, steps=3, **flags, trace_memory=True,
                                      overlap=False)) for label, flags, _ in chosen], tmp)
    rows = []
    for (label, _, f), got in zip(chosen, finals):
        tp, pp = f["tp"], f["pp"]
        m = 2 * pp if pp > 1 else 1                      # train's default micro-batches
        L = P.Layout(tp, pp, n // (tp * pp), f["zero"], base["batch_size"] // m, m,
                     f.get("schedule", "1f1b" if pp > 1 else "none"), f.get("virtual", 1),
                     f.get("recompute", False), f.get("sp", False))
        want = P.memory(model, L, settings, stage="first")
        for kind in ("params", "grads", "optimizer", "activations"):
            rows.append({"layout": label, "kind": kind, "planner": int(want[kind]),
                         "run": int(got[kind]), "ratio": got[kind] / want[kind]})
    return rows


def _finals(n: int, runs: list, tmp: str) -> list:
    """Rank 0's model state and measured activations of each (label, TrainConfig fields) in
    ``runs``, trained one after another by one ``n``-rank job, every op on its fused kernel
    whatever its size (as a GPU runs them: the planner's fused_kernels; on the CPU the small
    ones would take the NumPy twins, which keep more)."""
    spec = os.path.join(tmp, "memory_runs.json")
    result = os.path.join(tmp, "memory_results.json")
    with open(spec, "w") as f:
        json.dump({"result": result, "runs": [
            [label, train_args(flags, os.path.join(tmp, "mem_" + label.replace(" ", "_")))]
            for label, flags in runs]}, f)
    code = f"from hpcdist.bench.plan_memory import job; job({spec!r})"
    r = run_job([mpiexec(), "-n", str(n), sys.executable, "-c", code], timeout=900,
                env=dict(os.environ, HPCDIST_CPU_KERNELS_MIN="0"))
    if r.returncode != 0:
        raise RuntimeError(f"the memory runs failed:\n{r.stderr[-3000:]}")
    with open(result) as f:
        return json.load(f)


def job(spec: str) -> None:
    """The MPI job of ``_finals``: each run of ``spec`` trained in this process, rank 0
    writing what it held."""
    from hpcdist import train
    from hpcdist.comm import Communicator
    comm = Communicator()
    with open(spec) as f:
        todo = json.load(f)
    held = []
    for _, argv in todo["runs"]:
        final = train.train(train.parse_config(argv), comm=comm, log=lambda *a, **k: None)
        held.append(dict(final["memory_state"],
                         activations=final["memory_activations"]["activations"]))
    if comm.rank == 0:
        with open(todo["result"], "w") as f:
            json.dump(held, f)
