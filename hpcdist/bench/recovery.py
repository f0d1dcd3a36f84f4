"""In-job recovery (``--on-failure shrink``, Open MPI's ULFM): ``python -m hpcdist.bench
recovery``. Needs ``.venv-ompi`` (``make venv-ompi``).

``--ranks 3,4,8``: per world size, ``--kills`` runs each SIGKILL one rank (a random one, at a
random moment of a step) and time from the kill to the end of the next completed step (the
step's wall-clock in metrics.jsonl), against the median step before. ``--minutes M --every S``:
one run of ``--start`` ranks with a rank killed every S seconds for M minutes (``--respawn``:
each replaced): goodput (the share of the wall-clock spent in committed steps) and tokens/s
between the losses. ``--layout "--zero 3"``: the train flags of the layout under test (a
sharded one recovers from its buddies' memory, ``--mirror-every``); the mirror's exchange
after each step (``mirror_ms``) counts as time outside committed steps.
Writes a JSON (and prints a Markdown table) for docs/failures.md.
"""
from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import time

import numpy as np

from hpcdist.bench.common import end_job, owns, start_job, write_json
from hpcdist.comm.ulfm_launch import RESPAWN_FLAGS
from ..host.cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OMPI = os.path.join(ROOT, ".venv-ompi", "bin")
MODEL = ["--log-every", "1", "--batch-size", "32", "--on-failure", "shrink",
         "--timeout", "120"]


def launch(n: int, out: str, steps: int, extra=()):
    """The job, the bench's own (bench/common.py: its process group, ended with the bench)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [os.path.join(OMPI, "mpirun"), "--oversubscribe", "--with-ft", "ulfm", "--mca",
           "btl", "tcp,self", *RESPAWN_FLAGS.split(), "-n", str(n),
           os.path.join(OMPI, "python"), "-m",
           "hpcdist.train", "--steps", str(steps), "--out-dir", out, *MODEL, *extra]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "output.log"), "w") as log:   # (a pipe nobody reads fills)
        return start_job(cmd, stdout=log, stderr=log, env=env, cwd=ROOT)


def records(out: str) -> list:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def wait_steps(out: str, steps: int, limit: float = 300) -> list:
    t0 = time.time()
    while time.time() - t0 < limit:
        recs = [r for r in records(out) if "loss" in r]
        if len(recs) >= steps:
            return recs
        time.sleep(0.2)
    raise RuntimeError(f"{out}: fewer than {steps} steps in {limit} s")


def live_pids(out: str, proc) -> dict:
    """{rank: pid} of ranks.json's ranks that are processes of ``proc``'s job (a PID of
    another run, or one reused since, is never signalled)."""
    with open(os.path.join(out, "ranks.json")) as f:
        return {row["rank"]: row["pid"] for row in json.load(f) if owns(proc, row["pid"])}


def kill_one(out: str, rng, proc) -> tuple:
    """SIGKILL a random live rank at a random moment of a step: (its rank, the time)."""
    pids = live_pids(out, proc)
    rank = rng.choice(sorted(pids))            # (ranks.json: the survivors' table, rewritten)
    time.sleep(rng.uniform(0, 0.05))
    t = time.time()
    os.kill(pids[rank], signal.SIGKILL)
    return rank, t


def stop(out: str, proc) -> None:
    """The survivors (their new table) stop after a step; the job ended either way."""
    for pid in live_pids(out, proc).values():
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=120)
    finally:
        end_job(proc)


def time_to_next_step(n: int, tmp: str, rng, layout=()) -> dict:
    out = tempfile.mkdtemp(prefix=f"n{n}-", dir=tmp)     # a fresh folder for every run
    proc = launch(n, out, 100000, layout)
    before = wait_steps(out, 30)
    rank, t_kill = kill_one(out, rng, proc)
    recs = []
    for _ in range(600):                      # the first step completed after the rebuild
        ev = [r for r in records(out) if r.get("event") == "recovered"]
        recs = [r for r in records(out) if ev and "loss" in r and r["time"] > ev[0]["recovered"]]
        if recs:
            break
        time.sleep(0.1)
    stop(out, proc)
    ev = [r for r in records(out) if r.get("event") == "recovered"]
    step_ms = float(np.median([r["step_ms"] for r in before[5:]]))
    return {"ranks": n, "killed": rank, "seconds_to_next_step": recs[0]["time"] - t_kill
            if recs else None, "median_step_s": step_ms / 1e3,
            "rebuild_s": ev[0]["recovered"] - ev[0]["detected"] if ev else None}


def goodput(n: int, minutes: float, every: float, tmp: str, rng, respawn: bool,
            *, layout=()) -> dict:
    out = tempfile.mkdtemp(prefix=f"goodput-{n}" + ("-respawn-" if respawn else "-"), dir=tmp)
    proc = launch(n, out, 10 ** 7, [*(["--respawn"] if respawn else []), *layout])
    wait_steps(out, 20)
    t0, kills = time.time(), []
    while time.time() - t0 < minutes * 60:
        time.sleep(max(0.0, min(t0 + every * (len(kills) + 1), t0 + minutes * 60)
                       - time.time()))
        if time.time() - t0 >= minutes * 60 or (len(kills) >= n - 2 and not respawn):
            break
        kills.append(kill_one(out, rng, proc))
    t1 = time.time()
    stop(out, proc)
    steps = [r for r in records(out) if "loss" in r and t0 <= r["time"] <= t1]
    worlds = [r for r in records(out) if r.get("event") == "recovered"]
    busy = sum(r["step_ms"] for r in steps) / 1e3       # (the mirror's exchange: outside)
    tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in steps)
    phases, edges = [], [t0] + [t for _, t in kills] + [t1]
    for a, b in zip(edges, edges[1:]):
        seg = [r for r in steps if a <= r["time"] < b]
        if seg:
            phases.append({"from_s": a - t0, "steps": len(seg),
                           "tokens_per_s": float(np.median([r["tokens_per_s"] for r in seg]))})
    return {"ranks": n, "respawn": respawn, "minutes": (t1 - t0) / 60, "kills": len(kills), "wall_s": t1 - t0,
            "in_committed_steps_s": busy, "goodput": busy / (t1 - t0),
            "tokens_per_s": tokens / (t1 - t0), "worlds": [w["world"] for w in worlds],
            "phases": phases}


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench recovery", description=__doc__)
    ap.add_argument("--ranks", default="3,4,8", help="world sizes for the time to next step")
    ap.add_argument("--kills", type=int, default=3, help="runs per world size")
    ap.add_argument("--minutes", type=float, default=0.0, help="goodput run length (0: none)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between kills")
    ap.add_argument("--start", type=int, default=8, help="ranks the goodput run starts with")
    ap.add_argument("--respawn", action="store_true",
                    help="the goodput run replaces each lost rank (train's --respawn)")
    ap.add_argument("--layout", default="",
                    help='train flags of the layout, e.g. "--zero 3" or "--tp 2 --mirror-every 5"')
    ap.add_argument("--tmp", default="runs/bench-recovery")
    ap.add_argument("--json", default="runs/bench-recovery.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(OMPI, "mpirun")):
        print("bench recovery: needs .venv-ompi (make venv-ompi): Open MPI's ULFM")
        return 2
    rng = random.Random(args.seed)
    args.tmp = os.path.abspath(args.tmp)          # (the jobs run from the project root)
    os.makedirs(args.tmp, exist_ok=True)
    result = {"next_step": [], "goodput": None}
    print("| ranks | killed | seconds to the next step | median step (s) | rebuild (s) |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.ranks.split(",") if x]:
        for _ in range(args.kills):
            r = time_to_next_step(n, args.tmp, rng, args.layout.split())
            result["next_step"].append(r)
            print(f"| {n} | {r['killed']} | {r['seconds_to_next_step']:.3f} | "
                  f"{r['median_step_s']:.3f} | {r['rebuild_s']:.3f} |", flush=True)
    if args.minutes:
        g = goodput(args.start, args.minutes, args.every, args.tmp, rng, args.respawn,
                    layout=args.layout.split())
        result["goodput"] = g
        print(f"goodput: {g['goodput'] * 100:.1f}% of {g['wall_s']:.0f} s in committed steps, "
              f"{g['kills']} ranks killed ({args.start} -> {g['worlds'][-1] if g['worlds'] else args.start} ranks); "
              f"tokens/s per phase: " + ", ".join(f"{p['tokens_per_s']:,.0f}" for p in g["phases"]))
    write_json(args.json, result)
    return 0
