"""NCCL calls and bytes per training step, layout by layout:
``python -m hpcdist.bench nccl [--ranks 8] [--device standin|gpu]``.

Every layout trains a few steps with ``--backend nccl`` (on the NCCL stand-in
where no GPU is, on the real NCCL on a GPU per rank); the NCCL communicators count their own
calls and the bytes each rank sends (``comm.nccl.counts()``: ring-equivalent bytes for
the collectives, the payload for point-to-point). What a row says: how many NCCL calls one
step makes on each mesh group, and how many bytes a rank sends in them, averaged over the
ranks — what a GPU run then times. Set-up (the first broadcast of the parameters) is left
out: the counts are taken over steps 2 and on.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser

# name -> TrainConfig fields; a layout runs where the world size is a multiple of its ranks
LAYOUTS = {
    "ddp": {},
    "zero1": {"zero": 1},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "tp2 sp": {"tp": 2, "sequence_parallel": True},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b"},
    "pp2 zb-h1": {"pp": 2, "schedule": "zb-h1"},
    "cp2 ring": {"cp": 2},
    "cp2 ulysses": {"cp": 2, "cp_impl": "ulysses"},
    "tp2 pp2": {"tp": 2, "pp": 2},
    "tp2 pp2 cp2 sp": {"tp": 2, "pp": 2, "cp": 2, "sequence_parallel": True},
}


def ranks_of(fields: dict) -> int:
    return fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)


def snapshot() -> dict:
    from hpcdist.comm import nccl
    return {(g, k): tuple(v) for g, kinds in nccl.counts().items() for k, v in kinds.items()}


def measure(args, comm, name: str, fields: dict) -> list:
    """Rows of (group, kind, calls per step, bytes per step and rank) for one layout."""
    import numpy as np
    from hpcdist import data as D
    from hpcdist.parallel.strategy import build_strategy
    from hpcdist.run.config import TrainConfig
    from hpcdist.run.loop import train_step
    cfg = TrainConfig(task="sort", n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd, batch_size=args.batch,
                      steps=args.steps + 1, device=args.device, backend="nccl", warmup=0,
                      log_every=10 ** 9, out_dir=tempfile.gettempdir(), **fields)
    train_set, _ = D.datasets_of(cfg)
    _, strategy = build_strategy(cfg, comm, train_set)
    sampler = D.DistributedSampler(len(train_set), cfg.batch_size, strategy.batch_comm.rank,
                                   strategy.batch_comm.size)
    train_step(cfg, strategy, train_set, sampler, 1, 1e-3)        # first step: set-up aside
    before = snapshot()
    for s in range(2, args.steps + 2):
        train_step(cfg, strategy, train_set, sampler, s, 1e-3)
    after = snapshot()
    keys = sorted(k for k in after if after[k][0] > before.get(k, (0, 0))[0])
    mine = np.array([[after[k][i] - before.get(k, (0, 0))[i] for i in (0, 1)] for k in keys],
                    dtype=np.float64).reshape(-1)
    # ranks differ in groups (a pipeline's stages); gather each rank's rows to rank 0
    every = comm.mpi.gather({k: mine[2 * j:2 * j + 2] for j, k in enumerate(keys)}, root=0)
    if comm.rank != 0:
        return []
    rows = []
    for key in sorted({k for d in every for k in d}):
        have = [d[key] for d in every if key in d]
        rows.append({"layout": name, "group": key[0], "kind": key[1],
                     "ranks": len(have),
                     "calls": max(h[0] for h in have) / args.steps,
                     "bytes": sum(h[1] for h in have) / len(have) / args.steps})
    return rows


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.device import backend
    comm = Communicator()
    backend.init(args.device, comm.local_rank)
    for name, fields in LAYOUTS.items():
        if comm.size % ranks_of(fields) or (args.only and name not in args.only):
            continue
        for row in measure(args, comm, name, fields):
            emit(row)
    return 0


def main(argv=None) -> int:
    p = Parser(prog="python -m hpcdist.bench nccl", description=__doc__)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--device", default="standin", choices=("standin", "gpu"),
                   help="standin: the NCCL stand-in on the CPU; gpu: the real NCCL")
    p.add_argument("--steps", type=int, default=2, help="steps counted (after a first one)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--only", nargs="*", default=None, help="layouts to run (default: all)")
    p.add_argument("--json", default=os.path.join("runs", "bench_nccl.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("nccl", args.ranks, argv)
    print(f"NCCL calls per training step at {args.ranks} ranks, {args.device} "
          f"(GPT {args.n_layer}x{args.n_embd}, batch {args.batch}, fp32; bytes: what one rank "
          "sends per step, mean over the ranks in the group)")
    for r in rows:
        r["kib"] = r["bytes"] / 1024
    print(table(rows, [("layout", "layout", "s"), ("group", "group", "s"),
                       ("kind", "kind", "s"), ("calls/step", "calls", ".0f"),
                       ("KiB/step", "kib", ".1f")]))
    write_json(args.json, {"ranks": args.ranks, "device": args.device, "rows": rows})
    print(f"wrote {args.json}")
    return 0
