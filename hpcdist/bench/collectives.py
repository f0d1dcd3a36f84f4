"""Collectives benchmark: ``mpiexec -n N python -m hpcdist.bench collectives``.

For allreduce, reduce-scatter, allgather, broadcast, all-to-all and sendrecv, sizes 8 B .. 64 MiB in 4x
steps (OSU / nccl-tests style): warm-up, then ours and the MPI built-in alternate for 5 rounds
of timed iterations, each round between barriers; a rank's time is its median round (mean per
call), then the mean and the max over ranks. Columns: time, algbw = size/time, busbw =
algbw x the nccl-tests factor (allreduce 2(n-1)/n, reduce-scatter and allgather (n-1)/n,
all-to-all (n-1)/n, bcast and sendrecv 1), the same MPI built-in on the same buffers in the same run, the time
ratio ours/MPI, and the alpha-beta model's prediction from a measured ping-pong.
``--algorithms`` adds allreduce, broadcast and all-to-all timed per algorithm — every record
in the table (comm/table.py) that serves them: the data behind the "auto" thresholds;
``--overlap`` measures how much of an iallreduce hides behind computation.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from mpi4py import MPI

from hpcdist.comm import Communicator, shard_bounds
from hpcdist.comm.model import busbw_factor, fit_alpha_beta, predict
from hpcdist.comm.registry import serving
from hpcdist.comm.select import choose
from ..host.cli import Parser

KINDS = ("allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "sendrecv")
MiB = 1 << 20


def sizes(lo: int, hi: int):
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= 4
    return out + [hi]


ROUNDS = 5      # ours and MPI's alternate this many times; each reports its median round


def iterations(nbytes: int) -> int:
    """Calls per round: short calls take microseconds, and one preemption of a rank on a
    shared node is ~100 us, so they need many calls per round to average it away."""
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= MiB:
        return 20
    return 5 if nbytes <= 16 * MiB else 3


def _round(mpi, fn, iters: int) -> float:
    """This rank's mean seconds per call over one round that starts at a barrier."""
    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _over_ranks(mpi, t: float):
    return mpi.allreduce(t, op=MPI.SUM) / mpi.Get_size(), mpi.allreduce(t, op=MPI.MAX)


def timed(mpi, fn, iters: int, warmup: int = 2):
    """Mean seconds per call on this rank, then (mean over ranks, max over ranks)."""
    for _ in range(warmup):
        fn()
    return _over_ranks(mpi, _round(mpi, fn, iters))


def timed_pair(mpi, fn, ref, iters: int, rounds: int = ROUNDS, warmup: int = 2):
    """``fn`` and ``ref`` side by side: ``rounds`` alternating rounds of ``iters`` calls each;
    per rank the median round of each, then (mean over ranks, max over ranks) of each. The
    alternation puts both under the same drift of a shared machine."""
    for _ in range(warmup):
        fn()
        ref()
    mine, theirs = [], []
    for _ in range(rounds):
        mine.append(_round(mpi, fn, iters))
        theirs.append(_round(mpi, ref, iters))
    return _over_ranks(mpi, float(np.median(mine))), _over_ranks(mpi, float(np.median(theirs)))


def bench_one(comm, kind: str, nbytes: int):
    """(ours, mpi) timings for one collective at one size: each (mean, max) over ranks."""
    P, r, mpi = comm.size, comm.rank, comm.mpi
    n = max(nbytes // 4, 1)
    x = np.ones(n, dtype=np.float32)
    out = np.empty_like(x)
    iters = iterations(nbytes)
    if kind == "allreduce":
        ours = lambda: comm.allreduce(x, out=out)                      # noqa: E731
        ref = lambda: mpi.Allreduce(x, out, op=MPI.SUM)               # noqa: E731
    elif kind == "reduce_scatter":
        counts = [hi - lo for lo, hi in (shard_bounds(n, P, q) for q in range(P))]
        shard = np.empty(counts[r], dtype=np.float32)
        ours = lambda: comm.reduce_scatter(x)                          # noqa: E731
        ref = lambda: mpi.Reduce_scatter(x, shard, counts, op=MPI.SUM)  # noqa: E731
    elif kind == "allgather":
        lo, hi = shard_bounds(n, P, r)
        mine = x[lo:hi].copy()
        counts = [b - a for a, b in (shard_bounds(n, P, q) for q in range(P))]
        displs = [shard_bounds(n, P, q)[0] for q in range(P)]
        ours = lambda: comm.allgather(mine, total=n)                   # noqa: E731
        ref = lambda: mpi.Allgatherv(mine, [out, counts, displs, MPI.FLOAT])  # noqa: E731
    elif kind == "bcast":
        ours = lambda: comm.bcast(x, root=0)                           # noqa: E731
        ref = lambda: mpi.Bcast(x, root=0)                             # noqa: E731
    elif kind == "alltoall":                   # P equal pieces of the buffer (rounded up)
        x = np.ones(-(-n // P) * P, dtype=np.float32)
        got = np.empty_like(x)
        ours = lambda: comm.alltoall(x)                                # noqa: E731
        ref = lambda: mpi.Alltoall(x, got)                             # noqa: E731
    else:  # sendrecv around the ring
        right, left = (r + 1) % P, (r - 1) % P
        ours = lambda: comm.sendrecv(x, dest=right, source=left)      # noqa: E731
        ref = lambda: mpi.Sendrecv(x, right, 9, out, left, 9)          # noqa: E731
    return timed_pair(mpi, ours, ref, iters)


def overlap(comm, nbytes: int = 16 * MiB):
    """Share of an iallreduce hidden behind computation: (t_comm + t_comp - t_both) / min."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    a = np.random.default_rng(0).standard_normal((384, 384))

    def compute():
        y = a
        for _ in range(12):
            y = np.tanh(y @ a)
        return y
    mpi = comm.mpi
    t_comm = timed(mpi, lambda: comm.allreduce(x), 3)[1]
    t_comp = timed(mpi, compute, 3)[1]
    t_both = timed(mpi, lambda: (lambda h: (compute(), h.wait()))(comm.iallreduce(x)), 3)[1]
    hidden = (t_comm + t_comp - t_both) / min(t_comm, t_comp)
    return t_comm, t_comp, t_both, hidden


def by_algorithm(comm, nbytes_list, say) -> list:
    """Each algorithm of the table that serves allreduce, bcast or alltoall, timed at every
    size, beside what "auto" picks (a registered algorithm shows up here by itself)."""
    P, rows = comm.size, []
    calls = {"allreduce": lambda x, y, nm: comm.allreduce(x, out=y, algorithm=nm),
             "bcast": lambda x, y, nm: comm.bcast(x, root=0, algorithm=nm),
             "alltoall": lambda x, y, nm: comm.alltoall(x, algorithm=nm)}
    for kind, call in calls.items():
        names = [a.name for a in serving(kind) if kind in a.runs]
        say(f"\n{kind} time (us) by algorithm")
        say(f"{'bytes':>10s} " + " ".join(f"{nm:>19s}" for nm in names) + f" {'auto picks':>19s}")
        for nbytes in nbytes_list:
            x = np.ones(-(-max(nbytes // 4, 1) // P) * P, dtype=np.float32)
            y = np.empty_like(x)
            ts = [timed(comm.mpi, lambda nm=nm: call(x, y, nm), iterations(nbytes))[0]
                  for nm in names]
            rows.append({"collective": f"{kind}_by_algorithm", "ranks": P, "bytes": nbytes,
                         **{f"{nm}_us": tt * 1e6 for nm, tt in zip(names, ts)}})
            say(f"{nbytes:10d} " + " ".join(f"{tt * 1e6:19.1f}" for tt in ts)
                + f" {choose(kind, x.nbytes, P, short=False):>19s}")
    return rows


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench collectives", description=__doc__)
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=64 * MiB)
    ap.add_argument("--collectives", default=",".join(KINDS))
    ap.add_argument("--algorithms", action="store_true",
                    help="also time each allreduce, bcast and alltoall algorithm")
    ap.add_argument("--overlap", action="store_true", help="also measure iallreduce overlap")
    ap.add_argument("--out", default="runs", help="folder for CSV, JSON and PNG")
    args = ap.parse_args(argv)
    comm = Communicator()
    P, main_rank = comm.size, comm.rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    a, b = fit_alpha_beta(comm.mpi)
    say(f"collectives benchmark | {P} ranks | {MPI.Get_library_version().splitlines()[0]} | "
        f"ping-pong alpha {a * 1e6:.1f} us, 1/beta {1 / b / 1e9 if b else float('inf'):.2f} GB/s")
    rows = []
    for kind in args.collectives.split(","):
        if kind not in KINDS:
            raise SystemExit(f"unknown collective {kind!r}: choose from {', '.join(KINDS)}")
        say(f"\n{kind}" + (" (auto algorithm per size)" if kind == "allreduce" else ""))
        say(f"{'bytes':>10s} {'time us':>10s} {'max us':>10s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}"
            f" {'MPI us':>10s} {'MPI busbw':>10s} {'ours/MPI':>9s} {'model us':>10s}")
        for nbytes in sizes(args.min_bytes, args.max_bytes):
            (t, tmax), (tm, _) = bench_one(comm, kind, nbytes)
            f = busbw_factor(kind, P)
            row = {"collective": kind, "ranks": P, "bytes": nbytes, "time_us": t * 1e6,
                   "max_us": tmax * 1e6, "algbw_GBs": nbytes / t / 1e9,
                   "busbw_GBs": nbytes / t / 1e9 * f, "mpi_time_us": tm * 1e6,
                   "mpi_busbw_GBs": nbytes / tm / 1e9 * f, "ratio": t / tm,
                   "model_us": predict(kind, nbytes, P, a, b) * 1e6}
            rows.append(row)
            say(f"{nbytes:10d} {row['time_us']:10.1f} {row['max_us']:10.1f} {row['algbw_GBs']:11.3f} "
                f"{row['busbw_GBs']:11.3f} {row['mpi_time_us']:10.1f} {row['mpi_busbw_GBs']:10.3f} "
                f"{row['ratio']:9.2f} {row['model_us']:10.1f}")
    if args.algorithms and P > 1:
        rows += by_algorithm(comm, sizes(args.min_bytes, args.max_bytes), say)
    if args.overlap and P > 1:
        tc, tp, tb, hidden = overlap(comm)
        rows.append({"collective": "overlap", "ranks": P, "comm_s": tc, "compute_s": tp,
                     "both_s": tb, "hidden": hidden})
        say(f"\noverlap (16 MiB iallreduce + matmul work): comm {tc * 1e3:.1f} ms, compute "
            f"{tp * 1e3:.1f} ms, both {tb * 1e3:.1f} ms -> {hidden * 100:.0f}% of the shorter hidden")
    comm.close()
    if main_rank:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"bench_collectives_n{P}")
        with open(base + ".json", "w") as f:
            json.dump({"ranks": P, "alpha_s": a, "beta_s_per_byte": b, "rows": rows}, f, indent=1)
        main_rows = [r for r in rows if r["collective"] in KINDS]
        with open(base + ".csv", "w") as f:
            keys = list(main_rows[0])
            f.write(",".join(keys) + "\n")
            for r in main_rows:
                f.write(",".join(str(r[k]) for k in keys) + "\n")
        png = None
        try:
            from hpcdist.bench.common import pyplot
            from hpcdist.bench.plot import plot_collectives
            plot_collectives(pyplot(), [{"ranks": P, "rows": main_rows}], base + ".png")
            png = base + ".png"
        except SystemExit:                     # no matplotlib: the CSV and JSON are written
            pass
        say(f"\nwrote {base}.csv, {base}.json" + (f", {png}" if png else ""))
    return 0
