"""Soak: thousands of randomly chosen collectives, every result checked against MPI's built-ins.

``mpiexec -n N python tests/faults/soak.py --calls 600`` (test_faults.py runs this bounded
version; ``make soak`` runs a long one). Every rank draws the same sequence of calls from one
seed — kind, length, dtype, algorithm, root, blocking or not — and its own data and its own
random delay before each call, so ranks arrive in every order. No call may hang (the watchdog's
deadline ends the job) and every result must equal the built-in collective's.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

from hpcdist.comm import Communicator, shard_bounds
from hpcdist.comm.select import ALLREDUCE_ALGORITHMS, BCAST_ALGORITHMS

KINDS = ("allreduce", "iallreduce", "reduce_scatter", "allgather", "iallgather", "bcast",
         "reduce", "barrier")
DTYPES = (np.float32, np.float64, np.int32, np.int64)
MPI_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def check(got, want, dtype):
    if np.dtype(dtype).kind == "f":      # summation order differs from MPI's: a few ulps of
        eps = np.finfo(dtype).eps        # the largest partial sum (data ~ 100, up to 8 ranks)
        np.testing.assert_allclose(got, want, rtol=0, atol=64 * eps * 800)
    else:
        np.testing.assert_array_equal(got, want)


def one_call(comm, plan, data_rng):
    kind = plan.choice(KINDS)
    n = int(plan.choice([0, 1, comm.size - 1, comm.size + 1, 17, 1000, 70_000]))
    dtype = DTYPES[plan.integers(len(DTYPES))]
    op = str(plan.choice(list(MPI_OPS)))
    root = int(plan.integers(comm.size))
    algorithm = str(plan.choice(["auto", *ALLREDUCE_ALGORITHMS]))
    if data_rng.random() < 0.3:          # this rank arrives late, by up to 2 ms
        time.sleep(data_rng.random() * 2e-3)
    x = (data_rng.standard_normal(n) * 100).astype(dtype)
    mpi = comm.mpi
    if kind in ("allreduce", "iallreduce"):
        got = comm.allreduce(x, op, algorithm) if kind == "allreduce" else \
            comm.iallreduce(x, op, algorithm).wait()
        want = np.empty_like(x)
        mpi.Allreduce(x, want, MPI_OPS[op])
    elif kind == "reduce_scatter":
        got = comm.reduce_scatter(x, "sum")
        full = np.empty_like(x)
        mpi.Allreduce(x, full, MPI.SUM)
        lo, hi = shard_bounds(n, comm.size, comm.rank)
        want = full[lo:hi]
    elif kind in ("allgather", "iallgather"):
        lo, hi = shard_bounds(n, comm.size, comm.rank)
        shard = np.ascontiguousarray(x[lo:hi])
        got = comm.allgather(shard, total=n) if kind == "allgather" else \
            comm.iallgather(shard, total=n).wait()
        counts = [shard_bounds(n, comm.size, r)[1] - shard_bounds(n, comm.size, r)[0]
                  for r in range(comm.size)]
        want = np.empty(n, dtype=dtype)
        mpi.Allgatherv(shard, [want, counts])
    elif kind == "bcast":
        name = str(plan.choice(["auto", *BCAST_ALGORITHMS]))
        want = x.copy()
        mpi.Bcast(want, root=root)
        got = comm.bcast(x, root=root, algorithm=name)
    elif kind == "reduce":
        got = comm.reduce(x, "sum", root=root)
        want = np.empty_like(x)
        mpi.Allreduce(x, want, MPI.SUM)
        if comm.rank != root:
            assert got is None
            return kind
    else:
        comm.barrier()
        return kind
    check(got, want, dtype)
    return kind


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    comm = Communicator()
    plan = np.random.default_rng(args.seed)                     # the same on every rank
    data_rng = np.random.default_rng(args.seed * 1000 + comm.rank + 1)
    counts = {}
    t0 = time.time()
    for _ in range(args.calls):
        kind = one_call(comm, plan, data_rng)
        counts[kind] = counts.get(kind, 0) + 1
    if comm.rank == 0:
        print(f"soak: {args.calls} calls checked against MPI's built-ins on {comm.size} ranks "
              f"in {time.time() - t0:.1f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
              flush=True)


if __name__ == "__main__":
    main()
