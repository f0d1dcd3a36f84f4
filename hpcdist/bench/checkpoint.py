"""Layout-free checkpoints against a plain per-rank save: ``python -m hpcdist.bench checkpoint``.

On N ranks, for plain data parallelism and ZeRO-1: the time to save a layout-free checkpoint
(every tensor named, pieces written once, manifest, checksums, atomic renames) and to load it
back into the same layout and into another one, against the plain way — every rank writes its
flat arrays (parameters and optimizer state) to its own .npz and reads them back — and the
bytes each puts on disk. Medians of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser


def worker(args) -> int:
    from hpcdist import checkpoint, data
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.parallel.strategy import build_strategy
    from hpcdist.parallel.state import restore_checkpoint, save_checkpoint
    comm = Communicator()
    root = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    train_set, _ = data.make_task("sort", length=6, num_digits=10)

    def build(zero):
        cfg = TrainConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, zero=zero,
                          save_dir=os.path.join(root, f"z{zero}"))
        model, strategy = build_strategy(cfg, comm, train_set)
        strategy.opt.state.update({k: np.zeros_like(strategy.opt.flat.data)
                               for k in ("exp_avg", "exp_avg_sq")})
        sampler = data.DistributedSampler(len(train_set), 64, strategy.batch_comm.rank,
                                          strategy.batch_comm.size)
        return cfg, strategy, sampler

    def timed(fn):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        comm.barrier()
        return time.perf_counter() - t0

    for zero, other in ((0, 1), (1, 0)):
        cfg, strategy, sampler = build(zero)
        ocfg, ostep, osampler = build(other)
        lo, hi, arrays, _ = strategy.flat_state()
        plain = os.path.join(root, f"plain{zero}")
        os.makedirs(plain, exist_ok=True)
        mine = os.path.join(plain, f"rank_{comm.rank:05d}.npz")
        rows = {"save": [], "load": [], "load_other": [], "plain_save": [], "plain_load": []}
        for i in range(args.repeat):
            rows["save"].append(timed(lambda: save_checkpoint(cfg, i + 1, comm, strategy, sampler)))
            reader = checkpoint.Reader(checkpoint.step_dir(cfg.save_dir, i + 1))
            rows["load"].append(timed(lambda: restore_checkpoint(
                checkpoint.Reader(reader.folder), cfg, comm, strategy, sampler)))
            rows["load_other"].append(timed(lambda: restore_checkpoint(
                checkpoint.Reader(reader.folder), ocfg, comm, ostep, osampler)))
            rows["plain_save"].append(timed(lambda: np.savez(mine, **{
                k: v for k, v in arrays.items()})))
            rows["plain_load"].append(timed(lambda: dict(np.load(mine))))
        size = sum(os.path.getsize(os.path.join(reader.folder, f)) for f in
                   os.listdir(reader.folder))
        plain_size = sum(os.path.getsize(os.path.join(plain, f)) for f in os.listdir(plain))
        if comm.rank == 0:
            emit({"layout": f"{'ZeRO-1' if zero else 'DDP'} -> {'ZeRO-1' if other else 'DDP'}",
                  "ranks": comm.size,
                  "params": int(sum(p.size for p in strategy.model.parameters())),
                  **{k: float(np.median(v)) * 1e3 for k, v in rows.items()},
                  "bytes": size, "plain_bytes": plain_size})
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench checkpoint", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_checkpoint.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("checkpoint", args.ranks, argv)
    print(f"checkpoints | {args.ranks} ranks | GPT {args.n_layer}x{args.n_embd}, "
          f"{rows[0]['params']:,} parameters, fp32 with Adam state | median of {args.repeat}")
    for r in rows:
        r["save_x"] = r["save"] / r["plain_save"]
        r["load_x"] = r["load"] / r["plain_load"]
        r["mib"], r["plain_mib"] = r["bytes"] / 2 ** 20, r["plain_bytes"] / 2 ** 20
    print(table(rows, [("saved as -> loaded as", "layout", "s"), ("save ms", "save", ".1f"),
                       ("plain save", "plain_save", ".1f"), ("x", "save_x", ".2f"),
                       ("load ms", "load", ".1f"), ("plain load", "plain_load", ".1f"),
                       ("x", "load_x", ".2f"), ("other layout", "load_other", ".1f"),
                       ("MiB", "mib", ".2f"), ("plain MiB", "plain_mib", ".2f")]))
    write_json(args.out, {"ranks": args.ranks, "rows": rows})
    print(f"wrote {args.out}")
    return 0
