"""The pipeline picture: ``python -m hpcdist.bench schedule --schedule 1f1b --pp 4
--micro-batches 8`` draws a schedule from the verifier's simulation — stages down, time across,
F/B/I/W blocks labelled with micro-batch ids, the bubble left blank (the figure of the GPipe
and PipeDream papers). ``python -m hpcdist.bench plot TRACE`` draws the same from a real run's
Chrome trace (``--trace`` with ``--pp``): ``pipeline.png``.
"""
from __future__ import annotations

import sys
from ..host.cli import Parser

COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#2d6a3e"}


def draw(plt, stages: list, path: str, title: str, unit: str = "time") -> None:
    """``stages[s]`` = [(kind, mb, chunk, start, end), ...]; one row per stage."""
    P = len(stages)
    end = max((e[4] for st in stages for e in st), default=1.0)
    fig, ax = plt.subplots(figsize=(min(18, 3 + 0.9 * sum(len(s) for s in stages) / P),
                                    0.8 + 0.55 * P))
    seen = set()
    for s, events in enumerate(stages):
        for kind, mb, chunk, t0, t1 in events:
            shade = 1.0 - 0.35 * chunk / max(1, 1 + max(e[2] for e in events))
            ax.broken_barh([(t0, t1 - t0)], (s - 0.4, 0.8), color=COLOURS.get(kind, "#999"),
                           alpha=shade, edgecolor="white", linewidth=0.6,
                           label=None if kind in seen else kind)
            seen.add(kind)
            label = f"{mb}" if max(e[2] for e in events) == 0 else f"{mb}.{chunk}"
            ax.text((t0 + t1) / 2, s, label, ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"stage {s}" for s in range(P)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper right", bbox_to_anchor=(1.0, 1.35 if P < 4 else 1.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def events_from_trace(doc: dict, step: int | None = None):
    """Per rank, the pipeline actions of one step of a Chrome trace (times in ms from the
    step's first action); None when the trace has no pipeline actions."""
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"] == "step" and e["pid"] == 0),
                   key=lambda e: e["ts"])
    acts = [e for e in spans if e.get("cat") == "pipeline" and e["args"].get("kind") != "COMM"]
    if not acts:
        return None
    if steps:
        chosen = steps[min(len(steps) - 1, 1 if step is None else step)]
        t0, t1 = chosen["ts"], chosen["ts"] + chosen["dur"]
        acts = [e for e in acts if t0 <= e["ts"] <= t1]
    ranks = sorted({e["pid"] for e in acts})
    start = min(e["ts"] for e in acts)
    return [[(e["args"]["kind"], e["args"]["mb"], e["args"].get("chunk", 0),
              (e["ts"] - start) / 1e3, (e["ts"] + e["dur"] - start) / 1e3)
             for e in sorted(acts, key=lambda e: e["ts"]) if e["pid"] == r] for r in ranks]


def bubble_of(stages) -> float:
    """Idle share of stage-time between the first action and the last, over all stages."""
    t0 = min(e[3] for st in stages for e in st)
    t1 = max(e[4] for st in stages for e in st)
    busy = sum(e[4] - e[3] for st in stages for e in st)
    return 1.0 - busy / (len(stages) * (t1 - t0))


def parse_costs(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in ("F", "B", "I", "W", "send") or not value:
            raise SystemExit(f"--costs: expected F=..,B=..,I=..,W=..,send=.., got {part!r}")
        out[name] = float(value)
    return out


def main(argv=None) -> int:
    from hpcdist.bench.common import pyplot
    from hpcdist.parallel import schedules as S
    ap = Parser(prog="python -m hpcdist.bench schedule",
                description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="1f1b", choices=list(S.REGISTRY))
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--costs", default="F=1,B=2,I=1,W=1,send=0",
                    help="op times for the simulation (B = I + W)")
    ap.add_argument("--out", default="runs/schedule.png")
    args = ap.parse_args(argv)
    P, m, v = args.pp, args.micro_batches, args.virtual_stages
    try:
        sched = S.make(args.schedule, P, m, v)
        verdict = S.verify(sched, P, m, v, parse_costs(args.costs),
                           stash_limit=S.promised_stash(args.schedule, P, m, v))
    except S.ScheduleError as e:
        raise SystemExit(f"python -m hpcdist.bench schedule: {e}") from None
    import os
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    title = (f"{args.schedule}, {P} stages, {m} micro-batches" + (f", {v} chunks" if v > 1 else "")
             + f" (simulated: bubble {verdict.bubble * 100:.1f}%, peak stash "
             f"{max(verdict.peak_stash)})")
    draw(pyplot(), verdict.events, args.out, title)
    print(f"{title}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
