"""Layout-free checkpoints against a plain per-rank save: ``python -m hpcdist.bench checkpoint``.

On N ranks, for plain data parallelism and ZeRO-1: the time to save a layout-free checkpoint
(every tensor named, pieces written once, manifest, checksums, atomic renames) and to load it
back into the same layout and into another one, against the plain way — every rank writes its
flat arrays (parameters and optimizer state) to its own .npz and reads them back — and the
bytes each puts on disk. Medians of ``--repeat`` runs. ``--async-save``: the step's stall of
an --async-save checkpoint against a synchronous one (``stall_worker``).
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


def _timed(comm, fn) -> float:
    """Seconds of ``fn()`` on every rank, between two barriers."""
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    comm.barrier()
    return time.perf_counter() - t0


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
        return _timed(comm, fn)

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


def stall_worker(args) -> int:
    """--async-save against a synchronous save, in the steps of a training run: the step's
    time, the save's time in the step (synchronous: all of it; async: the copy to host
    memory and the stage folder's agreement), and the steps run while the background write
    goes on (the thread's CPU is the rank's: on few cores the steps slow while it writes)."""
    from hpcdist import data
    from hpcdist.checkpoint.background import Background
    from hpcdist.comm import Communicator
    from hpcdist.parallel.state import save_checkpoint
    from hpcdist.parallel.strategy import build_strategy
    from hpcdist.run.config import TrainConfig
    from hpcdist.run.loop import train_step
    comm = Communicator()
    root = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    train_set, _ = data.make_task("sort", length=6, num_digits=10)
    cfg = TrainConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4,
                      batch_size=args.batch, save_dir=root, zero=args.zero)
    _, strategy = build_strategy(cfg, comm, train_set)
    sampler = data.DistributedSampler(len(train_set), cfg.batch_size,
                                      strategy.batch_comm.rank, strategy.batch_comm.size)
    at, bg = [0], Background()

    def step():
        at[0] += 1
        return _timed(comm, lambda: train_step(cfg, strategy, train_set, sampler, at[0], 1e-4,
                                               before_update=bg.wait_copied))

    def timed(fn):
        return _timed(comm, fn)
    for _ in range(3):
        step()
    plain = [step() for _ in range(args.repeat * 3)]
    sync = [timed(lambda: save_checkpoint(cfg, at[0], comm, strategy, sampler))
            for _ in range(args.repeat)]
    stall, during, behind = [], [], []
    for _ in range(args.repeat):
        stall.append(timed(lambda: save_checkpoint(cfg, at[0], comm, strategy, sampler,
                                                   background=bg)))
        t0 = time.perf_counter()
        while not bg.ready(comm):             # the steps that run while it writes
            during.append(step())
        behind.append(time.perf_counter() - t0)
        bg.finish(comm)
        step()
    if comm.rank == 0:
        emit({"layout": f"ZeRO-{args.zero}" if args.zero else "DDP", "ranks": comm.size,
              "params": int(sum(p.size for p in strategy.model.parameters())),
              "step": float(np.median(plain)) * 1e3, "sync": float(np.median(sync)) * 1e3,
              "stall": float(np.median(stall)) * 1e3,
              "during": float(np.median(during)) * 1e3 if during else 0.0,
              "steps_during": len(during) / args.repeat,
              "written": float(np.median(behind)) * 1e3})
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench checkpoint", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_checkpoint.json")
    ap.add_argument("--async-save", dest="async_save", action="store_true",
                    help="the step's stall of --async-save against a synchronous save, in the "
                         "steps of a training run (--batch sequences a rank, --zero)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return stall_worker(args) if args.async_save else worker(args)
    if args.async_save:
        return _stall_report(args, argv)
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


def _stall_report(args, argv) -> int:
    rows = relaunch("checkpoint", args.ranks, argv)
    r = rows[0]
    r["of_step"], r["of_sync"] = r["sync"] / r["step"], r["stall"] / r["sync"]
    print(f"checkpoints in the step | {args.ranks} ranks | GPT {args.n_layer}x{args.n_embd}, "
          f"{r['params']:,} parameters, fp32 with Adam state, {r['layout']} | median of "
          f"{args.repeat}")
    print(table(rows, [("step ms", "step", ".1f"), ("sync save ms", "sync", ".1f"),
                       ("sync / step", "of_step", ".2f"), ("async stall ms", "stall", ".1f"),
                       ("stall / sync", "of_sync", ".3f"), ("written in ms", "written", ".1f"),
                       ("steps meanwhile", "steps_during", ".1f"),
                       ("their ms", "during", ".1f")]))
    write_json(args.out.replace(".json", "_async.json"), {"ranks": args.ranks, "rows": rows})
    return 0
