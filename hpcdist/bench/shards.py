"""Start-up on a large token corpus: ``python -m hpcdist.bench shards [--gb 1] [--ranks 4]``.

Writes one llm.c shard of ``--gb`` GB of random uint16 tokens (vocabulary 512) in a
temporary folder, trains ``--steps`` steps on ``--ranks`` ranks from it, and reports the
seconds from launch to the first step's end and each rank's peak RSS (getrusage): with
memory-mapped shards and the per-batch shuffle, neither grows with the corpus.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcdist.bench.common import end_job, start_job
from ..host.cli import Parser

VOCAB = 512     # the corpus's size is what is measured; a small vocabulary keeps the logits small

PROBE = """
import json, resource, runpy, sys, time
sys.argv = ["hpcdist.train"] + sys.argv[1:]
try:
    runpy.run_module("hpcdist.train", run_name="__main__")
except SystemExit:
    pass
from mpi4py import MPI
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RSS", MPI.COMM_WORLD.Get_rank(), rss, flush=True)
"""


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench shards", description=__doc__)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from hpcdist.data import shards
    with tempfile.TemporaryDirectory() as tmp:
        n = int(args.gb * 1e9 / 2)
        t0 = time.perf_counter()
        path = os.path.join(tmp, "train_000000.bin")
        header = np.zeros(shards.HEADER_INTS, dtype="<i4")
        header[:3] = shards.MAGIC, shards.VERSION, n
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            f.write(header.tobytes())
            for lo in range(0, n, 1 << 26):
                f.write(rng.integers(0, VOCAB, min(1 << 26, n - lo), dtype="<u2").tobytes())
        made = time.perf_counter() - t0
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.ranks),
               sys.executable, "-c", PROBE, "--task", "text", "--data", path, "--vocab-size",
               str(VOCAB), "--block-size", "256", "--batch-size", "4", "--n-layer", "2",
               "--n-embd", "64", "--steps", str(args.steps), "--log-every", "1",
               "--eval-batch", "16", "--out-dir", os.path.join(tmp, "out")]
        t0 = time.perf_counter()
        proc = start_job(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = None
        for line in proc.stdout:
            if first is None and line.startswith("step "):
                first = time.perf_counter() - t0
            if line.startswith("RSS"):
                print(line.strip())
        proc.wait()
        end_job(proc)
        total = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stderr.read()[-2000:], file=sys.stderr)
            return proc.returncode
        result = {"gb": args.gb, "tokens": n, "ranks": args.ranks, "write_s": made,
                  "first_step_s": first, "total_s": total}
        print(json.dumps(result))
    return 0
