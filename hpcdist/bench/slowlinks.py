"""Training across slow links: ``python -m hpcdist.bench slowlinks`` (root: it builds the
cluster in a box, hpcdist/cluster.py).

Per node count and link rate, a cluster of N nodes x 2 ranks on which every contender trains
the same GPT on the same text (the standard library's docstrings; ``--data FILE``) for the
same steps and tokens: DDP (flat ring, hierarchical), Top-K, PowerSGD, hybrid ZeRO-2, DiLoCo
at several H (a group a node; fp16, int4 wires) and Streaming DiLoCo. Per run: held-out loss,
wall-clock, seconds to a target (the training loss smoothed over 25 steps at 1.05 x
hierarchical DDP's at its end), bytes across nodes (every rank's), the share computing (steps
x DiLoCo H=100's median step without an exchange, over the training seconds) and the seconds
waited on outer exchanges. Writes a JSON, a Markdown table and a PNG (docs/diloco.md).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import sysconfig

import numpy as np

from hpcdist.bench.common import pyplot, run_job, write_json
from hpcdist.run.preemption import EXIT_PREEMPTED
from ..host.cli import Parser

DILOCO = ["--strategy", "diloco"]
CONTENDERS = {
    "DDP flat ring": ([], {"HPCDIST_ALLREDUCE": "ring"}),
    "DDP hierarchical": ([], {"HPCDIST_ALLREDUCE": "hierarchical"}),
    "Top-K 1%": (["--compress", "topk", "--density", "0.01"], {}),
    "PowerSGD r4": (["--compress", "powersgd", "--powersgd-rank", "4"], {}),
    "hybrid ZeRO-2": (["--zero", "2", "--shard-group", "node"], {}),
    "DiLoCo H=10": (DILOCO + ["--inner-steps", "10"], {}),
    "DiLoCo H=50": (DILOCO + ["--inner-steps", "50"], {}),
    "DiLoCo H=100": (DILOCO + ["--inner-steps", "100"], {}),
    "DiLoCo H=100 fp16": (DILOCO + ["--inner-steps", "100", "--outer-wire", "fp16"], {}),
    "DiLoCo H=100 int4": (DILOCO + ["--inner-steps", "100", "--outer-wire", "int4"], {}),
    "Streaming H=100 F=4": (DILOCO + ["--inner-steps", "100", "--fragments", "4",
                                      "--outer-overlap", "1"], {}),
}
MODEL = ["--task", "text", "--block-size", "64", "--n-layer", "2", "--n-embd", "128",
         "--n-head", "4", "--batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
         "--warmup", "30", "--eval-batch", "256", "--timeout", "120"]


def corpus(path: str, limit: int = 2_000_000) -> str:
    """The standard library's docstrings (modules, classes, functions; 80+ characters), in
    path order, up to ``limit`` characters: real English prose on every machine with
    Python (the same text for one Python version)."""
    if os.path.exists(path):
        return path
    root, out, total = sysconfig.get_paths()["stdlib"], [], 0
    for d, _, files in sorted(os.walk(root)):             # every folder, in name order
        for f in sorted(x for x in files if x.endswith(".py")):
            if total >= limit:
                break
            try:
                with open(os.path.join(d, f), encoding="utf-8") as src:
                    tree = ast.parse(src.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80 and total < limit:
                        out.append(doc)
                        total += len(doc) + 2
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(out)[:limit])
    return path


def folder_of(out: str, name: str) -> str:
    return os.path.join(out, name.replace(" ", "_").replace("%", "pct").replace("=", ""))


def train_once(cluster, name, args, steps, data, out) -> dict:
    """One contender on the cluster: its metrics (per step, and the final record). With
    ``--warm N``: from a copy of the DDP checkpoint of step N (``warm_up``)."""
    flags, env = CONTENDERS[name]
    folder = folder_of(out, name)
    if args.warm:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(os.path.join(out, "warm", "ck"), os.path.join(folder, "ck"))
        flags = [*flags, "--save-dir", os.path.join(folder, "ck"), "--resume"]
    cmd = cluster.mpiexec(env={**env, "OMP_NUM_THREADS": 1}) + [
        sys.executable, "-m", "hpcdist.train", *MODEL, "--data", data, "--steps", str(steps),
        "--log-every", str(steps), "--out-dir", folder, *flags]
    r = run_job(cmd, timeout=args.limit)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return read_run(folder)


def warm_up(cluster, args, data, out) -> None:
    """``--warm N``: hierarchical DDP's first N steps of the ``--steps`` run, saved (a
    SIGUSR1 as step N - 1 begins stops it after step N: the schedule stays the whole run's)."""
    folder = os.path.join(out, "warm")
    shutil.rmtree(folder, ignore_errors=True)
    cmd = cluster.mpiexec(env={"OMP_NUM_THREADS": 1, "HPCDIST_ALLREDUCE": "hierarchical",
                               "HPCDIST_SIGNAL_AT": f"0:{args.warm - 1}:SIGUSR1"}) + [
        sys.executable, "-m", "hpcdist.train", *MODEL, "--data", data, "--steps",
        str(args.steps), "--log-every", str(args.steps), "--out-dir", folder, "--save-dir",
        os.path.join(folder, "ck")]
    r = run_job(cmd, timeout=args.limit)
    if r.returncode != EXIT_PREEMPTED:
        raise RuntimeError(f"the warm-up failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def read_run(folder: str) -> dict:
    """A finished run's metrics.jsonl: every step's record and the final one."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    return {"steps": [x for x in lines if "step" in x and "event" not in x], "final": lines[-1]}


def smooth(values, k: int = 25) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    return np.array([v[max(0, i - k + 1):i + 1].mean() for i in range(len(v))])


def summarize(runs: dict, steps: int) -> list:
    """A row per contender: the table's numbers."""
    base = runs["DDP hierarchical"]["final"]
    target = 1.05 * smooth([s["loss"] for s in runs["DDP hierarchical"]["steps"]])[-1]
    quiet = [s["step_ms"] for s in runs.get("DiLoCo H=100", runs["DDP hierarchical"])["steps"]
             if s["step"] % 100]
    t_compute = float(np.median(quiet)) / 1e3
    ddp_bytes = base["inter_node_bytes"]
    rows = []
    for name, run in runs.items():
        f = run["final"]
        clock = np.cumsum([s["step_ms"] for s in run["steps"]]) / 1e3
        loss = smooth([s["loss"] for s in run["steps"]])
        hit = np.nonzero(loss <= target)[0]
        rows.append({"contender": name, "held_out": f["test_loss"],
                     "vs_ddp": f["test_loss"] / base["test_loss"],
                     "wall_s": f["train_seconds"],
                     "to_target_s": float(clock[hit[0]]) if hit.size else None,
                     "inter_node_MB": f["inter_node_bytes"] / 1e6,
                     "fewer_bytes": ddp_bytes / f["inter_node_bytes"]
                     if f["inter_node_bytes"] else None,
                     "compute_share": min(1.0, steps * t_compute / f["train_seconds"]),
                     "peak_sync_MB": f.get("outer_peak_bytes", 0) / 1e6 or None,
                     "quant_error": f.get("outer_quant_error"),
                     "waited_s": f.get("outer_wait_s"),
                     "curve": [clock.tolist(), loss.tolist()]})
    return rows


def markdown(results: list) -> str:
    out = []
    for res in results:
        out += [f"**{res['nodes']} nodes x 2 ranks, {res['link']} links** ({res['steps']} "
                f"steps, the same tokens each; target: the training loss smoothed over 25 steps "
                f"at 1.05 x hierarchical DDP's at its end)", "",
                "| contender | held-out loss | vs DDP | wall-clock s | to target s | "
                "inter-node MB | fewer bytes than DDP | computing | peak sync MB | "
                "waited s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            out.append(f"| {r['contender']} | {r['held_out']:.4f} | {r['vs_ddp']:.3f}x | "
                       f"{r['wall_s']:.1f} | {fmt(r['to_target_s'], '.1f')} | "
                       f"{r['inter_node_MB']:.1f} | {fmt(r['fewer_bytes'], '.1f')}x | "
                       f"{r['compute_share']:.0%} | {fmt(r['peak_sync_MB'], '.2f')} | "
                       f"{fmt(r['waited_s'], '.2f')} |")
        out.append("")
    return "\n".join(out)


def plot(results: list, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for r in res["rows"]:
            ax.plot(*r["curve"], label=r["contender"],
                    linestyle="-" if "DiLoCo" in r["contender"] or "Stream" in
                    r["contender"] else "--")
        ax.set_title(f"{res['nodes']} nodes x 2 ranks, {res['link']}")
        ax.set_xlabel("wall-clock (s)")
        ax.set_ylabel("training loss (smoothed)")
        ax.set_xscale("log")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench slowlinks", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2", help="node counts, comma-separated")
    ap.add_argument("--links", default="1gbit,100mbit", help="tc rates, comma-separated")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--only", default="", help="contenders, comma-separated (default all)")
    ap.add_argument("--data", default="runs/slowlinks/corpus.txt",
                    help="a text file (made from the stdlib's docstrings if absent)")
    ap.add_argument("--limit", type=float, default=1200, help="seconds a run may take")
    ap.add_argument("--warm", type=int, default=0,
                    help="hierarchical DDP trains this many steps first; every contender goes "
                         "on from its checkpoint (DiLoCo's warm start; 0: from scratch)")
    ap.add_argument("--out", default="runs/slowlinks")
    ap.add_argument("--tables", action="store_true",
                    help="only rebuild the table and plot from the runs already in --out")
    args = ap.parse_args(argv)
    if args.warm == 1 or args.warm >= args.steps or args.warm < 0:
        ap.error(f"--warm: 0 (from scratch) or 2 .. {args.steps - 1} steps")
    if args.tables:
        return tables(args)
    from hpcdist import cluster as box
    why = box.available()
    if why:
        print(f"python -m hpcdist.bench slowlinks: the cluster in a box {why}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        print(f"unknown contender {unknown[0]!r}: {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    data = corpus(args.data)
    results = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for link in args.links.split(","):
            runs = {}
            with box.Cluster(nodes, 2, link=link, prefix="hpcs") as c:
                if args.warm:
                    warm_up(c, args, data, os.path.join(args.out, f"{nodes}x2-{link}"))
                for name in ["DDP hierarchical"] + [n for n in names if n != "DDP hierarchical"]:
                    runs[name] = train_once(c, name, args, args.steps, data,
                                            os.path.join(args.out, f"{nodes}x2-{link}"))
                    print(f"{nodes} nodes, {link}: {name}: held-out "
                          f"{runs[name]['final']['test_loss']:.4f}, "
                          f"{runs[name]['final']['train_seconds']:.1f} s", flush=True)
            results.append({"nodes": nodes, "link": link, "steps": args.steps,
                            "rows": summarize(runs, args.steps)})
            write_json(os.path.join(args.out, "slowlinks.json"), results)
    return write_tables(results, args)


def tables(args) -> int:
    """The table and plot again from the run folders under ``--out`` (NxR-LINK/CONTENDER)."""
    results = []
    for cell in sorted(os.listdir(args.out)):
        if not os.path.isdir(os.path.join(args.out, cell)) or "x" not in cell:
            continue
        runs = {name: read_run(folder_of(os.path.join(args.out, cell), name))
                for name in CONTENDERS
                if os.path.exists(os.path.join(folder_of(os.path.join(args.out, cell), name),
                                               "metrics.jsonl"))}
        steps = len(runs["DDP hierarchical"]["steps"])
        nodes, link = cell.split("x2-")
        results.append({"nodes": int(nodes), "link": link, "steps": steps,
                        "rows": summarize(runs, steps)})
    write_json(os.path.join(args.out, "slowlinks.json"), results)
    return write_tables(results, args)


def write_tables(results: list, args) -> int:
    text = markdown(results)
    with open(os.path.join(args.out, "slowlinks.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(args.out, "slowlinks.png"))
    print(text)
    print(f"wrote {args.out}/slowlinks.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
