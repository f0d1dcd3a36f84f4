"""DiLoCo against DDP at the same tokens, from a warm start: ``python -m hpcdist.bench diloco``.

The papers' parity (DiLoCo, OpenDiLoCo) starts from a pretrained model; from scratch hpcdist's
DiLoCo reached 1.143x DDP's held-out loss at H = 100 over 2 groups (docs/diloco.md). Here, on
one host (links change the wall-clock, not the loss): DDP trains ``--warm`` steps and saves;
from that checkpoint DDP and DiLoCo at each H and group count train on to ``--steps`` (the same
schedule, the same tokens: every rank's batch the same), and the held-out losses are compared.
Several ``--warm`` lengths give the curve of the loss ratio against the warm-up; several H the
curve against H. The slow-link cells of ``bench slowlinks --warm N`` use the same recipe.
Writes a JSON and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from hpcdist.bench.common import mpiexec, run_job, write_json
from hpcdist.bench.slowlinks import MODEL, corpus
from hpcdist.run.preemption import EXIT_PREEMPTED
from ..host.cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(n: int, data: str, steps: int, folder: str, extra=(), limit: float = 1800,
          *, stop_at: int = 0) -> dict:
    """One run of ``n`` ranks to ``steps``; its final record. ``stop_at``: a checkpoint
    and a stop after that step (the schedule still the ``steps``-step one: the warm-up is
    the first steps of the run it starts)."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "hpcdist.train", *MODEL, "--data",
           data, "--steps", str(steps), "--log-every", str(steps), "--out-dir", folder, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if stop_at:               # SIGUSR1 as step stop_at - 1 begins: saved after stop_at
        env["HPCDIST_SIGNAL_AT"] = f"0:{stop_at - 1}:SIGUSR1"
    r = run_job(cmd, timeout=limit, env=env, cwd=ROOT)
    if r.returncode != (EXIT_PREEMPTED if stop_at else 0):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f][-1]


def from_warm(n: int, data: str, steps: int, warm: str, folder: str, extra) -> dict:
    """A run resumed from the warm-up's checkpoint (a copy of its folder: the run saves)."""
    os.makedirs(folder, exist_ok=True)
    ck = os.path.join(folder, "ck")
    shutil.copytree(warm, ck)
    return train(n, data, steps, folder, ["--save-dir", ck, "--resume", *extra])


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench diloco", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--groups", default="2,4", help="DiLoCo group counts (each divides --ranks)")
    ap.add_argument("--inner", default="100", help="H values, comma-separated")
    ap.add_argument("--warm", default="600", help="DDP warm-up lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=1800, help="total steps (warm-up included)")
    ap.add_argument("--data", default="runs/slowlinks/corpus.txt")
    ap.add_argument("--json", default="runs/bench-diloco.json")
    ap.add_argument("--tmp", default="runs", help="where each invocation's run folders go")
    args = ap.parse_args(argv)
    warms = [int(w) for w in args.warm.split(",")]
    if any(w == 1 or w < 0 or w >= args.steps for w in warms):
        ap.error(f"--warm: 0 (from scratch) or 2 .. {args.steps - 1} steps")
    if any(args.ranks % int(g) for g in args.groups.split(",")):
        ap.error(f"--groups: each must divide --ranks {args.ranks}")
    data = os.path.abspath(corpus(args.data))
    os.makedirs(args.tmp, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-diloco-", dir=os.path.abspath(args.tmp))
    rows = []
    print("| warm-up (DDP steps) | then | held-out loss | vs DDP |")
    print("|---|---|---|---|")
    for warm in warms:
        base = os.path.join(tmp, f"warm{warm}")
        if warm:
            train(args.ranks, data, args.steps, base, ["--save-dir", os.path.join(base, "ck")],
                  stop_at=warm)
        runs = {"DDP": []}
        for h in (int(x) for x in args.inner.split(",")):
            for g in (int(x) for x in args.groups.split(",")):
                runs[f"DiLoCo H={h}, {g} groups"] = ["--strategy", "diloco", "--inner-steps",
                                                     str(h), "--group-size", str(args.ranks // g)]
        ddp = None
        for name, extra in runs.items():
            folder = os.path.join(tmp, f"warm{warm}-{len(rows)}")
            final = from_warm(args.ranks, data, args.steps, os.path.join(base, "ck"), folder,
                              extra) if warm else train(args.ranks, data, args.steps, folder,
                                                        extra)
            ddp = ddp if ddp is not None else final["test_loss"]
            rows.append({"warm": warm, "run": name, "held_out": final["test_loss"],
                         "vs_ddp": final["test_loss"] / ddp})
            print(f"| {warm} | {name} | {final['test_loss']:.4f} | "
                  f"{final['test_loss'] / ddp:.3f}x |", flush=True)
    write_json(args.json, {"ranks": args.ranks, "steps": args.steps, "rows": rows})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
