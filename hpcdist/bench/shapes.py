"""The GPT step at the shapes people train, against PyTorch eager (``bench autograd --shapes``).

For each shape and thread count: the median step (forward, backward, AdamW) of hpcdist and of
its PyTorch twin from the same weights on the same batch, taking turns in rounds; the step's
peak activation bytes with the CPU kernels and with the NumPy twins (``--memory``); and with
``--profile`` where the step's time goes, hpcdist and PyTorch side by side. The table goes to
runs/bench_shapes.json (docs/autograd.md, "At the shapes people train")."""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
import tracemalloc

import numpy as np

from hpcdist import nn
from hpcdist.host import threads as host_threads

# AdamW's learning rate: both sides train one batch over and over; at 1e-3 GPT 12x768 diverged
# in float32 on both, each its own way (losses 4.19 and 3.62 after 110 steps), so the two
# timed different arithmetic; at 1e-4 every shape trains, the losses alike
LR = 1e-4

DEFAULT = "4x128:128:2048:16,6x384:256:4096:4,12x768:256:4096:2"

# Where a step's time goes. hpcdist: cProfile's own time per function, the first (part, file,
# function) that matches (attention's GEMMs are NumPy calls inside it, so they count there);
# PyTorch: the profiler's self time per op, the first part with a matching name.
HD_PARTS = (("GEMMs", "backend.py", "_gemm"), ("GEMMs", "cpu_gemm.py", "gemm_rows"),
            ("attention", "cpu_gemm.py", "attention"), ("attention", "cpu_attention.py", ""),
            ("attention", "kernels/attention.py", ""), ("optimizer", "cpu_jit.py", "adamw"),
            ("optimizer", "kernels/adamw.py", ""), ("optimizer", "optim.py", ""),
            ("fused kernels", "cpu_jit.py", ""), ("fused kernels", "elementwise.py", ""),
            ("fused kernels", "rows.py", ""))
TORCH_PARTS = (("GEMMs", ("aten::mm", "aten::addmm")),
               ("attention", ("aten::bmm", "softmax", "masked_fill")),
               ("optimizer", ("lerp", "addcdiv", "addcmul", "sqrt", "Optimizer", "_foreach")),
               ("fused kernels", ("gelu", "layer_norm", "log_softmax", "nll_loss")))


def layers_width(text: str) -> tuple[int, int, int]:
    """"LxC" -> (layers, width, heads of 64, at least one)."""
    L, C = (int(v) for v in text.lower().split("x"))
    return L, C, max(1, C // 64)


def parse(spec: str, arch: str = "gpt"):
    """"LxC:T:V:B,..." -> [(the family's config, batch)] (heads of 64; Llama: a quarter of
    them kv heads, at least one)."""
    out = []
    for item in spec.split(","):
        shape, T, V, B = item.strip().split(":")
        L, C, heads = layers_width(shape)
        extra = dict(n_kv_head=max(1, heads // 4)) if arch == "llama" else {}
        out.append((nn.FAMILIES[arch].config(block_size=int(T), vocab_size=int(V), n_layer=L,
                                         n_head=heads, n_embd=C, **extra), int(B)))
    return out


def set_threads(n: int) -> None:
    """hpcdist on ``n`` threads as a run of ``n`` threads per rank has them (BLAS, numba and
    host/pool.py), and PyTorch on ``n``. The order matters twice. PyTorch is imported first:
    its OpenMP library and numba's share a name (libgomp.so.1), the first loaded serves both,
    and PyTorch's steps ran 8-10% slower on the system's copy numba loads (6x384: 443-458 ms
    against 407-416). numba's threads start before anyone's count is set: starting them sets
    OpenMP's count, and PyTorch set to 1 then ran on 2 (its CPU time 1.9x its wall time)."""
    try:
        import torch
    except ImportError:
        torch = None
    try:
        from hpcdist.device.kernels import cpu
        cpu.jit()
    except ImportError:                                # numba absent: nothing to start
        pass
    host_threads.limit(n)
    if torch is not None:
        torch.set_num_threads(n)


def peak_bytes(contenders, cfg, batch: int, kernels_on: bool) -> int:
    """The most bytes one hpcdist step allocates above what it began with (tracemalloc);
    ``contenders``: bench.autograd.gpt_contenders."""
    before = os.environ.get("HPCDIST_CPU_KERNELS")
    os.environ["HPCDIST_CPU_KERNELS"] = "1" if kernels_on else "0"
    try:
        step = contenders(cfg, batch, LR)["hpcdist"]
        step()                                         # optimizer state made
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        step()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    finally:
        if before is None:
            os.environ.pop("HPCDIST_CPU_KERNELS", None)
        else:
            os.environ["HPCDIST_CPU_KERNELS"] = before
    return peak


def attention_bytes(cfg, batch: int, kernels_on: bool) -> tuple:
    """(bytes one layer's attention keeps from its forward for its backward, the most bytes
    its forward and backward allocate at once) at this shape, float32."""
    from hpcdist.device import kernels
    from hpcdist.device.kernels import cpu
    rng = np.random.default_rng(0)
    C, T = cfg.n_embd, cfg.block_size
    qkv = rng.standard_normal((batch, T, 3 * C)).astype(np.float32)
    dy = rng.standard_normal((batch, T, C)).astype(np.float32)
    scale = 1.0 / (C // cfg.n_head) ** 0.5
    floor = cpu.MIN_SIZE
    cpu.MIN_SIZE = 0 if kernels_on else 1 << 62
    try:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        y, lse, att = kernels.attention_fwd(qkv, cfg.n_head, cfg.n_head, scale)
        kept = lse.nbytes + (att.nbytes if att is not None else 0)
        kernels.attention_bwd(qkv, y, dy, lse, cfg.n_head, cfg.n_head, scale, att)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    finally:
        cpu.MIN_SIZE = floor
    return kept, peak


def hd_profile(step, steps: int = 3) -> dict:
    """{part: share of the step} of hpcdist's step, by cProfile's own time per function."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    parts, total = {}, 0.0
    for (path, _, func), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        total += own
        part = next((p for p, f, fn in HD_PARTS if path.endswith(f) and fn in func),
                    "engine and other")
        parts[part] = parts.get(part, 0.0) + own
    return {k: v / total for k, v in sorted(parts.items())}


def torch_profile(step, steps: int = 3) -> dict:
    """{part: share of the step} of PyTorch's step, by the profiler's self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    parts, total = {}, 0.0
    for ev in prof.key_averages():
        own = ev.self_cpu_time_total
        total += own
        part = next((p for p, names in TORCH_PARTS if any(n in ev.key for n in names)),
                    "engine and other")
        parts[part] = parts.get(part, 0.0) + own
    return {k: v / total for k, v in sorted(parts.items())}


def run(spec: str, thread_counts, steps: int, warmup: int, profile: bool, memory: bool,
        *, gpt_contenders, run_table, out: str = "runs/bench_shapes.json",
        arch: str = "gpt") -> list:
    """The table; ``gpt_contenders`` and ``run_table``: bench.autograd's; ``arch``: the
    family (llama: a quarter of the heads kv heads)."""
    rows = []
    for n in thread_counts:
        set_threads(n)
        for cfg, batch in parse(spec, arch):
            family = "Llama" if arch == "llama" else "GPT"
            name = (f"{family} {cfg.n_layer}x{cfg.n_embd}, T {cfg.block_size}, vocab "
                    f"{cfg.vocab_size}, batch {batch}, {n} thread{'s' * (n > 1)}")
            contenders = gpt_contenders(cfg, batch, LR)
            table = run_table(name, contenders, steps, warmup)
            row = {"arch": arch, "shape": f"{cfg.n_layer}x{cfg.n_embd}", "T": cfg.block_size,
                   "vocab": cfg.vocab_size, "batch": batch, "threads": n,
                   "hpcdist_ms": table["hpcdist"][0] * 1e3}
            if "pytorch" in table:
                row["pytorch_ms"] = table["pytorch"][0] * 1e3
                row["ratio"] = table["hpcdist"][0] / table["pytorch"][0]
                print(f"  hpcdist / pytorch = {row['ratio']:.3f} (target <= 0.95)")
            if "pytorch math" in table:                # (GPT's twin with math attention)
                row["pytorch_math_ms"] = table["pytorch math"][0] * 1e3
                row["ratio_math"] = table["hpcdist"][0] / table["pytorch math"][0]
                print(f"  hpcdist / pytorch with math attention = {row['ratio_math']:.3f}")
            if profile:
                row["profile_hpcdist"] = hd_profile(contenders["hpcdist"])
                if "pytorch" in contenders:
                    row["profile_pytorch"] = torch_profile(contenders["pytorch"])
                for who in ("hpcdist", "pytorch"):
                    shares = row.get("profile_" + who, {})
                    print(f"  where {who}'s step goes: " + ", ".join(
                        f"{k} {v:.0%}" for k, v in shares.items()))
            if memory and n == thread_counts[0]:
                row["peak_bytes_kernels"] = peak_bytes(gpt_contenders, cfg, batch, True)
                row["peak_bytes_twins"] = peak_bytes(gpt_contenders, cfg, batch, False)
                print(f"  peak bytes of a step above its start: CPU kernels "
                      f"{row['peak_bytes_kernels'] / 2**20:.1f} MiB, NumPy twins "
                      f"{row['peak_bytes_twins'] / 2**20:.1f} MiB")
                for on, who in ((True, "kernels"), (False, "twins")):
                    row[f"attention_kept_{who}"], row[f"attention_peak_{who}"] = \
                        attention_bytes(cfg, batch, on)
                print(f"  one layer's attention, kept for backward / peak of fwd+bwd: CPU "
                      f"kernels {row['attention_kept_kernels'] / 2**20:.2f} / "
                      f"{row['attention_peak_kernels'] / 2**20:.1f} MiB, NumPy twins "
                      f"{row['attention_kept_twins'] / 2**20:.2f} / "
                      f"{row['attention_peak_twins'] / 2**20:.1f} MiB ({cfg.n_head} heads)")
            rows.append(row)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, f, indent=1)
    print(f"\nwrote {out}")
    return rows


def median_ratio(rows) -> float:
    return float(np.median([r["ratio"] for r in rows if "ratio" in r]))


def pool_ab(spec: str, n: int, rounds: int, contenders) -> list:
    """hpcdist with host/pool.py on and off in turn beside PyTorch, in one process on ``n``
    threads (``rounds`` of 3 steps each): [(shape, {who: median ms})]. A shared machine's
    drift falls on all three alike. numba's threading layer is chosen once a process: the off
    arm runs BLAS's own threads beside OpenMP's (a run with HPCDIST_CPU_POOL=0 from the start
    has the work queue's), so this A/B leans against "off"."""
    out, before = [], os.environ.get("HPCDIST_CPU_POOL")
    for cfg, batch in parse(spec):
        def mode(pool):
            os.environ["HPCDIST_CPU_POOL"] = "1" if pool else "0"
            set_threads(n)
        mode(True)
        c = contenders(cfg, batch, LR)
        runs = (("pool", c["hpcdist"], True), ("no pool", c["hpcdist"], False),
                ("pytorch", c["pytorch"], None))
        times = {who: [] for who, _, _ in runs}
        for r in range(rounds + 1):                      # the first round warms up
            for who, step, pool in runs:
                if pool is not None:
                    mode(pool)
                for _ in range(3):
                    t0 = time.perf_counter()
                    step()
                    if r:
                        times[who].append(time.perf_counter() - t0)
        med = {who: float(np.median(v)) * 1e3 for who, v in times.items()}
        name = f"{cfg.n_layer}x{cfg.n_embd}:{cfg.block_size}:{cfg.vocab_size}:{batch}"
        print(f"GPT {name}, {n} threads: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items())
              + f" | pool / pytorch {med['pool'] / med['pytorch']:.3f}, no pool / pytorch "
              f"{med['no pool'] / med['pytorch']:.3f}", flush=True)
        out.append((name, med))
    if before is None:                                   # as the caller had it
        os.environ.pop("HPCDIST_CPU_POOL", None)
    else:
        os.environ["HPCDIST_CPU_POOL"] = before
    set_threads(n)
    return out
