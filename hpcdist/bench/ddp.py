"""DDP scaling and overlap: ``python -m hpcdist.bench ddp``.

At 1, 2, 4 and 8 ranks (weak scaling: the per-rank batch is fixed), a GPT big enough for
several gradient buckets trains for a few steps with overlap on and off. Reported: median step
time for each, the time of the gradient averaging alone (every bucket, blocking), the share of
it hidden behind backward ((t_off - t_on) / t_comm), and weak-scaling efficiency t(1)/t(N).
Then the bytes of activations the autograd graph holds, with and without activation
checkpointing (``recompute.graph_bytes``).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser

MODEL = dict(n_layer=4, n_head=4, n_embd=128)


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.train import build, prepare, train
    comm = Communicator()
    out = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    times = {}
    for overlap in (True, False):
        cfg = TrainConfig(**MODEL, steps=args.steps, batch_size=args.batch, overlap=overlap,
                          bucket_mb=args.bucket_mb, first_bucket_mb=args.bucket_mb / 2,
                          log_every=10 ** 9, out_dir=os.path.join(out, str(overlap)))
        times[overlap] = train(cfg, comm, log=lambda *a: None)["step_ms_median"]
    # the averaging alone: every bucket of a real gradient, blocking, in launch order
    cfg = TrainConfig(**MODEL, batch_size=args.batch, bucket_mb=args.bucket_mb,
                      first_bucket_mb=args.bucket_mb / 2, out_dir=out)
    _, strategy = build(cfg, comm, prepare(cfg, comm)[0])
    ddp = strategy.ddp
    samples = []
    for _ in range(max(args.steps // 2, 3)):
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        for b in ddp.buckets:
            comm.allreduce(ddp.flat.grad[b.lo:b.hi], op="avg", out=ddp.flat.grad[b.lo:b.hi])
        samples.append(time.perf_counter() - t0)
    t_comm = float(np.median(samples)) * 1e3
    if comm.rank == 0:
        emit({"ranks": comm.size, "params": int(ddp.flat.size), "buckets": len(ddp.buckets),
              "step_overlap_ms": times[True], "step_no_overlap_ms": times[False],
              "comm_ms": t_comm})
    return 0


def activation_memory(batch: int) -> list:
    from hpcdist import nn
    from hpcdist.autograd.recompute import graph_bytes
    from hpcdist.train import TrainConfig
    d = TrainConfig()
    rows = []
    for label, shape, block in (("default GPT 2x64", dict(n_layer=d.n_layer, n_head=d.n_head,
                                                          n_embd=d.n_embd), 11),
                                ("bench GPT 4x128", MODEL, 11),
                                ("GPT 4x128, T=64", MODEL, 64)):
        held = {}
        for on in (False, True):
            nn.manual_seed(0)
            m = nn.GPT(nn.GPTConfig(block_size=block, vocab_size=10, checkpoint_activations=on,
                                    **shape))
            idx = np.zeros((batch, block), dtype=np.int64)
            _, loss = m(idx, idx)
            held[on] = graph_bytes(loss)
        rows.append({"model": label, "batch": batch, "plain_MiB": held[False] / 2 ** 20,
                     "checkpointed_MiB": held[True] / 2 ** 20, "ratio": held[False] / held[True]})
    return rows


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench ddp", description=__doc__)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--out", default="runs/bench_ddp.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = [r for n in args.sizes for r in relaunch("ddp", n, argv)]
    base = rows[0]["step_overlap_ms"]
    for r in rows:
        saved = r["step_no_overlap_ms"] - r["step_overlap_ms"]
        # capped: on a short noisy run the difference can exceed the communication itself
        r["hidden_pct"] = 100 * min(max(saved, 0.0), r["comm_ms"]) / r["comm_ms"] \
            if r["comm_ms"] > 0.01 else None
        r["weak_eff_pct"] = 100 * base / r["step_overlap_ms"]
    print(f"DDP weak scaling | GPT {MODEL['n_layer']}x{MODEL['n_embd']} ({rows[0]['params']:,} "
          f"parameters, {rows[0]['buckets']} buckets of <= {args.bucket_mb} MB) | batch "
          f"{args.batch} per rank | median of {args.steps} steps")
    print(table(rows, [("ranks", "ranks", "d"), ("overlap ms", "step_overlap_ms", ".1f"),
                       ("no overlap ms", "step_no_overlap_ms", ".1f"),
                       ("comm ms", "comm_ms", ".1f"), ("hidden %", "hidden_pct", ".0f"),
                       ("weak eff %", "weak_eff_pct", ".0f")]))
    mem = activation_memory(args.batch)
    print("\nactivations held by the autograd graph after forward")
    print(table(mem, [("model", "model", "s"), ("batch", "batch", "d"),
                      ("plain MiB", "plain_MiB", ".2f"),
                      ("checkpointed MiB", "checkpointed_MiB", ".2f"), ("ratio", "ratio", ".1f")]))
    write_json(args.out, {"scaling": rows, "activation_memory": mem})
    print(f"wrote {args.out}")
    return 0
