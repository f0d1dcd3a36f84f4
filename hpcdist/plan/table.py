"""What the planner prints of the layouts it ranked: the table of the fastest meshes, the best
layout's step taken apart, why nothing fits, and numbers in the units a person reads them in
(a small model's "120.6 k parameters" and "13 us" rather than "0.0 B" and "0.00 s")."""
from __future__ import annotations

import math
import re

from .facts import GB
from .search import best_per_mesh


# (row key, header, width): the narrow table a person reads, then what --wide adds
NARROW = [("tp", "TP", 3), ("pp", "PP", 3), ("dp", "DP", 4), ("cp", "CP", 3), ("ep", "EP", 3),
          ("zero", "ZeRO", 4), ("shard", "shard", 5), ("micro_batch", "mb", 3), ("micro_batches", "m", 4),
          ("schedule", "schedule", 14), ("recompute", "recompute", 9), ("sp", "SP", 3),
          ("memory_gb", "GB/GPU", 7), ("step_s", "step", 8), ("mfu", "MFU", 6),
          ("bubble", "bubble", 6)]
WIDE = NARROW + [("cp_impl", "CP impl", 7), ("split", "PP split", 10),
                 ("tflops_per_gpu", "TFLOP/s/GPU", 11), ("comm_share", "comm share", 10)]


def _cell(value, width: int, key: str) -> str:
    if isinstance(value, bool):
        value = "yes" if value else "no"
    if isinstance(value, float):
        text = f"{value * 100:.1f}%" if key in ("mfu", "bubble", "comm_share") else \
            f"{value:.1f}" if key == "memory_gb" else f"{value:.2f}"
    else:
        text = str(value)
    if key == "step_s":
        text = seconds(value)
    return f"{text:>{width}s}"


def report(fits: list, top: int, wide: bool = False) -> None:
    """The fastest meshes, each with its best settings, and what the best one's step is."""
    meshes = best_per_mesh(fits)
    columns = WIDE if wide else NARROW
    print(f"the {min(top, len(meshes))} fastest meshes (DP x CP x TP x PP), each with its best "
          f"settings (mb: micro-batch, m: micro-batches; --wide: every column; --json: every "
          f"layout, ranked):")
    print(" ".join(f"{h:>{w}s}" for _, h, w in columns))
    for e in meshes[:top]:
        r = e.row()
        print(" ".join(_cell(r[k], w, k) for k, _, w in columns))
    best = fits[0]
    p, L = best.parts, best.layout
    print(f"best: TP {L.tp} x PP {L.pp} x DP {L.dp}" + (f" x CP {L.cp} ({L.cp_impl})"
                                                        if L.cp > 1 else "") +
          (f" (EP {L.ep} of DP: the all-to-alls {p['ep']:.2f} s inside the pipeline)"
           if L.ep > 1 else "") +
          f": {seconds(best.step_s)} per step = pipeline {seconds(p['pipeline'])} (bubble "
          f"{best.bubble * 100:.1f}%, TP collectives {seconds(p['tp'])} and CP messages "
          f"{seconds(p['cp'])} inside it) + DP gradient reduction {seconds(p['dp'])} + "
          f"optimizer {seconds(p['optimizer'])}; {best.memory['total'] / GB:.1f} GB per GPU")


def count(n: float) -> str:
    """A parameter count a person reads: 7.2 B, 124.4 M, 85.3 k, 512."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)}"


def seconds(t: float) -> str:
    """A duration a person reads: 1.23 s, 45.6 ms, 789 us (0 s when nothing is spent)."""
    if t >= 1 or t == 0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.3g} us"


def nothing_fits(refused: list, show: int = 5) -> str:
    """Why nothing fits: the nearest misses first (the least memory over), then the other
    reasons, one line each."""
    def over(why):
        m = re.search(r"\(([\d.]+) GB over\)", why)
        return float(m.group(1)) if m else math.inf
    ranked = sorted(refused, key=lambda r: over(r[1]))
    lines, seen = [], set()
    for layout, why in ranked:     # one line a mesh for memory, one a reason for the rest
        key = why if math.isinf(over(why)) else \
            tuple(layout.get(k) for k in ("tp", "pp", "dp", "cp", "split"))
        if key in seen:
            continue
        seen.add(key)
        mesh = ", ".join(f"{k} {layout[k]}" for k in ("tp", "pp", "dp", "cp", "zero",
                                                        "micro_batch", "recompute")
                         if k in layout)
        lines.append(f"  {mesh}: {why}")
        if len(lines) == show:
            break
    return "nothing fits; the nearest misses first:\n" + "\n".join(lines)
