"""ZeRO memory and communication against the paper: ``python -m hpcdist.bench zero``.

Measured, per rank, at N = 1, 2, 4, 8: the bytes of model state (parameters, gradients,
optimizer state: array nbytes) for ZeRO-0 to -3, next to the ZeRO paper's formulas (Rajbhandari
et al. 2020, Table 1; mixed-precision Adam, K = 12):

    ZeRO-0  (2 + 2 + K) Psi        ZeRO-2  2 Psi + (2 + K) Psi / N
    ZeRO-1  4 Psi + K Psi / N      ZeRO-3  (4 + K) Psi / N

The rest of this design: docs/zero.md, "hpcdist/bench/zero.py"."""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser

MODEL = dict(n_layer=4, n_head=4, n_embd=128)

# bytes per parameter (fixed part, part divided by N), per ZeRO level: mixed precision, K = 12
MIXED = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}
FP32 = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}
SEED_LAB_BYTES = 64        # the seed lab's per-parameter count before sharding (see README)


def formula(level: int, psi: float, n: int, precision: str) -> float:
    fixed, shared = (MIXED if precision != "fp32" else FP32)[level]
    return fixed * psi + shared * psi / n


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.train import train
    comm = Communicator()
    out = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    for precision in ("bf16", "fp32"):
        for level in (0, 1, 2, 3):
            cfg = TrainConfig(**MODEL, zero=level, precision=precision, steps=args.steps,
                              batch_size=args.batch, bucket_mb=args.bucket_mb,
                              first_bucket_mb=args.bucket_mb / 2, log_every=10 ** 9,
                              out_dir=os.path.join(out, f"{precision}{level}"))
            final = train(cfg, comm, log=lambda *a: None)
            mem = final["memory_peak"]
            if comm.rank == 0:
                emit({"ranks": comm.size, "precision": precision, "level": level,
                      "psi": int(final["params"].size), "peak": mem["total"],
                      "state": final["memory_state"]["total"],
                      "bytes_per_step": final["bytes_per_step"],
                      "itemsize": 2 if precision != "fp32" else 4,
                      "step_ms": final["step_ms_median"]})
    return 0


def analytic(psi: float, n: int) -> None:
    print(f"ZeRO model-state memory per rank, Psi = {psi:.3g} parameters, N = {n} ranks")
    rows = []
    for level in (0, 1, 2, 3):
        rows.append({"level": level, "mixed_GB": formula(level, psi, n, "fp16") / 1e9,
                     "fp32_GB": formula(level, psi, n, "fp32") / 1e9,
                     "mixed_bpp": formula(level, psi, n, "fp16") / psi})
    print(table(rows, [("level", "level", "d"), ("mixed GB", "mixed_GB", ",.1f"),
                       ("bytes/param", "mixed_bpp", ".2f"), ("fp32 GB", "fp32_GB", ",.1f")]))
    print(f"\nThe seed lab counts {SEED_LAB_BYTES} bytes per parameter before sharding: "
          f"{SEED_LAB_BYTES * psi / 1e9:,.0f} GB per GPU, and {SEED_LAB_BYTES * psi / n / 1e9:,.0f}"
          f" GB with everything sharded over {n} (its total divided by N).")
    print(f"The ZeRO paper counts 16 bytes per parameter (mixed-precision Adam): "
          f"{16 * psi / 1e9:,.0f} GB per GPU before sharding, {16 * psi / n / 1e9:,.0f} GB at "
          f"ZeRO-3. The seed lab's 64 B/param is 4x the paper's 16; its breakdown is not "
          f"stated here, so both are printed. Both divide by N when everything is sharded.")


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench zero", description=__doc__)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--bucket-mb", type=float, default=0.05)
    ap.add_argument("--analytic", type=float, default=None, metavar="PARAMS")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--out", default="runs/bench_zero.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.analytic is not None:
        analytic(args.analytic, args.world)
        return 0
    if args.worker:
        return worker(args)
    rows = [r for n in args.sizes for r in relaunch("zero", n, argv)]
    psi = rows[0]["psi"]
    for r in rows:
        f = formula(r["level"], psi, r["ranks"], r["precision"])
        r["formula_MiB"] = f / 2 ** 20
        r["state_MiB"], r["peak_MiB"] = r["state"] / 2 ** 20, r["peak"] / 2 ** 20
        r["state_ratio"], r["peak_ratio"] = r["state"] / f, r["peak"] / f
        n = r["ranks"]
        expect = (3 if r["level"] == 3 else 2) * psi * (n - 1) / n
        r["elements"] = r["bytes_per_step"] / r["itemsize"] if r["level"] else \
            r["bytes_per_step"] / 4                       # ZeRO-0 reduces in fp32
        r["comm_ratio"] = r["elements"] / expect if expect else None
    for r in rows:
        base = [b for b in rows if b["ranks"] == r["ranks"] and b["precision"] == r["precision"]
                and b["level"] == 0][0]
        r["time_vs_0"] = r["step_ms"] / base["step_ms"]
    print(f"ZeRO | GPT {MODEL['n_layer']}x{MODEL['n_embd']}, Psi = {psi:,} parameters | Adam | "
          f"buckets {args.bucket_mb} MB | per rank")
    for precision, title in (("bf16", "mixed precision (bf16 compute, fp32 master; K = 12)"),
                             ("fp32", "fp32")):
        print(f"\n{title}")
        print(table([r for r in rows if r["precision"] == precision],
                    [("N", "ranks", "d"), ("level", "level", "d"),
                     ("formula MiB", "formula_MiB", ".3f"), ("state MiB", "state_MiB", ".3f"),
                     ("state/formula", "state_ratio", ".3f"), ("peak MiB", "peak_MiB", ".3f"),
                     ("peak/formula", "peak_ratio", ".2f"), ("elements/step", "elements", ",.0f"),
                     ("vs 2|3 Psi(N-1)/N", "comm_ratio", ".3f"),
                     ("time vs ZeRO-0", "time_vs_0", ".2f")]))
    write_json(args.out, {"psi": psi, "rows": rows})
    print(f"wrote {args.out}")
    return 0
