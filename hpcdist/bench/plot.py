"""PNG plots from what runs and benchmarks wrote: ``python -m hpcdist.bench plot FILE...``.

Each input is recognised by its content — the list goes on in docs/observability.md,
"hpcdist/bench/plot.py"."""
from __future__ import annotations

import argparse
import json
import os
import sys

from hpcdist.bench.common import pyplot
from ..host.cli import Parser


def read(path: str):
    """(kind, content) of one input file."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise SystemExit(f"{path}: neither JSON nor JSON lines") from None
        if records and any("loss" in r and "step" in r for r in records):
            return "metrics", records
        raise SystemExit(f"{path}: JSON lines without step/loss records")
    if isinstance(doc, dict) and "traceEvents" in doc:
        return "trace", doc
    if isinstance(doc, dict) and "rows" in doc and "alpha_s" in doc and "ranks" not in doc:
        return "comm_log", doc
    if isinstance(doc, dict) and "rows" in doc and "ranks" in doc and \
            any("busbw_GBs" in r for r in doc["rows"]):
        return "collectives", doc
    if isinstance(doc, dict) and "rows" in doc and any("scheme" in r for r in doc["rows"]):
        return "compression", doc
    raise SystemExit(f"{path}: not a file this tool knows (see --help)")


def _label(path: str) -> str:
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def plot_metrics(plt, runs, path):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lr_ax = ax.twinx()
    titles = []
    for name, records in runs:
        steps = [r for r in records if "loss" in r and "step" in r]
        line, = ax.semilogy([r["step"] for r in steps], [r["loss"] for r in steps], "o-", ms=3,
                            label=f"{name} loss")
        lr_ax.plot([r["step"] for r in steps], [r["lr"] for r in steps], ":",
                   color=line.get_color(), alpha=0.6)
        final = [r for r in records if r.get("event") == "final"]
        if final:
            titles.append(f"{name}: {final[-1]['accuracy'] * 100:.2f}% held-out, "
                          f"{final[-1]['world']} ranks")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    lr_ax.set_ylabel("learning rate (dotted)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title("; ".join(titles) or "training loss", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_collectives(plt, docs, path):
    kinds = list(dict.fromkeys(r["collective"] for d in docs for r in d["rows"]
                               if "busbw_GBs" in r))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.8), sharey=True,
                             squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for d in docs:
            rs = [r for r in d["rows"] if r["collective"] == kind]
            line, = ax.loglog([r["bytes"] for r in rs], [r["busbw_GBs"] for r in rs], "o-",
                              ms=3, label=f"hpcdist, {d['ranks']} ranks")
            ax.loglog([r["bytes"] for r in rs], [r["mpi_busbw_GBs"] for r in rs], "s--", ms=3,
                      color=line.get_color(), alpha=0.6, label=f"MPI built-in, {d['ranks']} ranks")
        ax.set_title(kind)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("collectives: bus bandwidth vs message size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comm_log(plt, doc, path):
    rows = doc["rows"]
    kinds = list(dict.fromkeys(r["collective"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind in kinds:
        rs = sorted((r for r in rows if r["collective"] == kind and r["bytes"] > 0),
                    key=lambda r: r["bytes"])
        if not rs:
            continue
        pts = ax.loglog([r["bytes"] for r in rs], [r["time_us"] for r in rs], "o", label=kind)
        model = [(r["bytes"], r["model_us"]) for r in rs if r.get("model_us")]
        if model:
            ax.loglog(*zip(*model), "x", color=pts[0].get_color(), ms=8)
    ax.set_xlabel("bytes per call")
    ax.set_ylabel("time per call (us): o measured, x alpha-beta model")
    ax.set_title(f"communication log (alpha {doc['alpha_s'] * 1e6:.1f} us, "
                 f"1/beta {1 / doc['beta_s_per_byte'] / 1e9 if doc['beta_s_per_byte'] else 0:.2f}"
                 " GB/s)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "gradient sync": "#c44e52",
           "optimizer step": "#55a868", "checkpoint": "#8172b3", "evaluate": "#937860"}


def plot_trace(plt, doc, path, steps: int = 3):
    events = doc["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
    step_spans = sorted((e for e in spans if e["name"] == "step" and e["pid"] == 0),
                        key=lambda e: e["ts"])
    if step_spans:                   # a window of the first steps (after step 1's warm-up)
        first = step_spans[min(1, len(step_spans) - 1)]
        last = step_spans[min(len(step_spans) - 1, step_spans.index(first) + steps - 1)]
        t0, t1 = first["ts"], last["ts"] + last["dur"]
    else:
        t0, t1 = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * len(tracks)))
    seen = set()
    for row, (pid, tid) in enumerate(tracks):
        for e in spans:
            if (e["pid"], e["tid"]) != (pid, tid) or e["name"] == "step":
                continue
            if e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            colour = COLOURS.get(e["name"], "#222222" if e.get("cat") == "comm" else "#aaaaaa")
            label = e["name"] if e.get("cat") != "comm" else "collectives"
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (row - 0.38, 0.76),
                           color=colour, label=None if label in seen else label)
            seen.add(label)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"rank {p} {names.get((p, t), t)}"[:40] for p, t in tracks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(f"timeline, {len({p for p, _ in tracks})} ranks", fontsize=9)
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(tracks) < 6 else -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compression(plt, doc, path):
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        ax.semilogx(r["bytes_per_step"], r["accuracy"], "o")
        ax.annotate(r["scheme"], (r["bytes_per_step"], r["accuracy"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("bytes sent per step per rank")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"gradient compression, {doc.get('ranks', '?')} ranks, "
                 f"{doc.get('steps', '?')} steps", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench plot",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("files", nargs="+", help="metrics.jsonl, benchmark JSON, comm_log.json, trace")
    ap.add_argument("--out", default="runs/plots", help="folder for the PNGs")
    ap.add_argument("--steps", type=int, default=3, help="steps shown in timeline.png")
    args = ap.parse_args(argv)
    groups, skipped = {}, []
    for path in args.files:              # a missing or unknown file costs its plot only
        if not os.path.isfile(path):
            skipped.append(f"{path}: no such file")
            continue
        try:
            kind, content = read(path)
        except SystemExit as e:
            skipped.append(str(e))
            continue
        groups.setdefault(kind, []).append((path, content))
    for why in skipped:
        print(f"skipped {why}", file=sys.stderr)
    if not groups:
        raise SystemExit("nothing to plot: " + "; ".join(skipped))
    plt = pyplot()
    os.makedirs(args.out, exist_ok=True)
    written = []

    def out(name):
        written.append(os.path.join(args.out, name))
        return written[-1]
    if "metrics" in groups:
        plot_metrics(plt, [(_label(p), c) for p, c in groups["metrics"]], out("loss.png"))
    if "collectives" in groups:
        plot_collectives(plt, [c for _, c in groups["collectives"]], out("busbw.png"))
    for i, (_, doc) in enumerate(groups.get("comm_log", [])):
        plot_comm_log(plt, doc, out(f"comm_log{i or ''}.png"))
    for i, (_, doc) in enumerate(groups.get("trace", [])):
        plot_trace(plt, doc, out(f"timeline{i or ''}.png"), args.steps)
        from hpcdist.bench import schedule
        stages = schedule.events_from_trace(doc)
        if stages:
            schedule.draw(plt, stages, out(f"pipeline{i or ''}.png"),
                          f"pipeline, one step of a real run (measured bubble "
                          f"{schedule.bubble_of(stages) * 100:.1f}%)", unit="ms")
    for i, (_, doc) in enumerate(groups.get("compression", [])):
        plot_compression(plt, doc, out(f"compression{i or ''}.png"))
    for w in written:
        print(f"wrote {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
