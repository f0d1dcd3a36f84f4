"""hpcdist beside its peers: ``python -m hpcdist.bench peers``.

Allreduce time, 8 B to 64 MiB in 4x steps, at N = 2 and 4 ranks, of hpcdist, MPI's built-in
(``MPI_Allreduce`` of the library mpi4py runs on) and torch.distributed over gloo — in three
separate blocks, each timed between its own library's barriers (MPICH's busy-polling barrier
slows gloo 3x when mixed in), median of the iterations; the ratios hpcdist / MPI and hpcdist /
gloo; and a PNG. PyTorch is optional: without it the gloo column is skipped, saying so.

Not here yet (issue 12): the training-step comparison against PyTorch DDP.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json


def sizes(lo: int, hi: int):
    n = lo
    while n <= hi:
        yield n
        n *= 4


def _median_time(fn, barrier, iters: int) -> float:
    samples = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def worker(args) -> int:
    from mpi4py import MPI

    from hpcdist.comm import Communicator
    comm = Communicator()
    mpi = comm.mpi
    results = {}
    # block 1: hpcdist; block 2: MPI's built-in (each with MPI's barrier)
    for n in sizes(8, args.max_bytes):
        x = np.ones(max(1, n // 4), dtype=np.float32)
        iters = max(5, min(200, (1 << 22) // n))
        comm.allreduce(x)
        results.setdefault(n, {})["hpcdist"] = _median_time(lambda: comm.allreduce(x),
                                                            mpi.Barrier, iters)
    for n in sizes(8, args.max_bytes):
        x = np.ones(max(1, n // 4), dtype=np.float32)
        out = np.empty_like(x)
        iters = max(5, min(200, (1 << 22) // n))
        results[n]["mpi"] = _median_time(lambda: mpi.Allreduce(x, out, MPI.SUM), mpi.Barrier,
                                         iters)
    # block 3: gloo, with its own barrier
    try:
        import torch
        import torch.distributed as dist
        port = mpi.bcast(29500 + os.getpid() % 2000 if comm.rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.rank, world_size=comm.size)
        for n in sizes(8, args.max_bytes):
            t = torch.ones(max(1, n // 4), dtype=torch.float32)
            iters = max(5, min(200, (1 << 22) // n))
            dist.all_reduce(t)
            results[n]["gloo"] = _median_time(lambda: dist.all_reduce(t), dist.barrier, iters)
        dist.destroy_process_group()
    except ImportError:
        pass
    if comm.rank == 0:
        for n, r in results.items():
            emit({"ranks": comm.size, "bytes": n, **{k: v * 1e6 for k, v in r.items()}})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.bench peers", description=__doc__)
    ap.add_argument("--sizes", default="2,4", help="world sizes")
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--out", default="runs/bench_peers.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        rows += relaunch("peers", n, ["--max-bytes", str(args.max_bytes)])
    has_gloo = any("gloo" in r for r in rows)
    if not has_gloo:
        print("PyTorch is not installed: the gloo column is skipped "
              "(pip install torch==2.13.0 to add it)")
    for r in rows:
        r["x_mpi"] = r["hpcdist"] / r["mpi"]
        r["x_gloo"] = r["hpcdist"] / r["gloo"] if has_gloo else None
    print("allreduce, median us per call (float32), three separate blocks each timed between "
          "its own library's barriers")
    print(table(rows, [("ranks", "ranks", "d"), ("bytes", "bytes", ",d"),
                       ("hpcdist us", "hpcdist", ".1f"), ("MPI us", "mpi", ".1f"),
                       ("gloo us", "gloo", ".1f"), ("x MPI", "x_mpi", ".2f"),
                       ("x gloo", "x_gloo", ".2f")]))
    write_json(args.out, {"rows": rows})
    try:
        from hpcdist.bench.plot import _pyplot
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in sorted({r["ranks"] for r in rows}):
            mine = [r for r in rows if r["ranks"] == n]
            for key, style in (("hpcdist", "-o"), ("mpi", "--s"), ("gloo", ":^")):
                if key in mine[0]:
                    ax.loglog([r["bytes"] for r in mine], [r[key] for r in mine], style,
                              label=f"{key}, {n} ranks", markersize=3)
        ax.set_xlabel("bytes")
        ax.set_ylabel("us per allreduce (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        png = os.path.splitext(args.out)[0] + ".png"
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"wrote {args.out} and {png}")
    except SystemExit:
        print(f"wrote {args.out} (no PNG: matplotlib missing)")
    return 0
