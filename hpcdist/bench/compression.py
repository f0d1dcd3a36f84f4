"""Gradient compression on the default task: ``python -m hpcdist.bench compression``.

Dense, fp16 and Top-K (DGC) at two densities, each trained for the same steps at 4 ranks from
the same start: held-out accuracy, bytes this rank sent per step, median step time, and the
mean cosine similarity of the averaged (compressed) gradient to the dense average of the same
step's gradients (measured with one extra dense allreduce, not counted in the bytes).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser


def worker(args) -> int:
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.train import train
    comm = Communicator()
    schemes = [("dense", "none", None), ("fp16", "fp16", None)] + \
        [(f"topk {d:g}", "topk", d) for d in args.densities]
    out = tempfile.mkdtemp() if comm.rank == 0 else ""
    out = comm.mpi.bcast(out, root=0)
    for label, scheme, density in schemes:
        cfg = TrainConfig(steps=args.steps, compress=scheme, density=density or 0.01,
                          optimizer=args.optimizer, lr=args.lr, min_lr=args.lr / 10,
                          compress_momentum=args.dgc_momentum,
                          density_warmup=args.density_warmup,
                          weight_decay=0.0 if args.optimizer == "sgd" else 0.1,
                          log_every=10 ** 9, out_dir=os.path.join(out, label.replace(" ", "_")))
        probe = CosineProbe()
        final = train(cfg, comm, log=lambda *a: None, on_build=probe.attach)
        if comm.rank == 0:
            emit({"scheme": label, "accuracy": final["accuracy"] * 100,
                  "bytes_per_step": final["bytes_per_step"], "step_ms": final["step_ms_median"],
                  "cosine": float(np.mean(probe.cosines)) if probe.cosines else None})
    return 0


class CosineProbe:
    """Each step's cosine similarity between the averaged (compressed) gradient and the dense
    average of the same gradient: an extra dense allreduce per bucket, left out of the byte
    count (``comm.uncounted``)."""

    def __init__(self):
        self.cosines: list = []
        self._dense: dict = {}

    def attach(self, strategy) -> None:
        ddp = strategy.ddp
        ddp.on_launch.append(self._launch)
        ddp.on_synced.append(self._synced)
        self._comm = ddp.comm

    def _launch(self, bucket, grad) -> None:
        with self._comm.uncounted():
            self._dense[bucket.index] = self._comm.allreduce(grad, op="avg")

    def _synced(self, ddp) -> None:
        dot = n1 = n2 = 0.0
        for b in ddp.buckets:
            got, ref = ddp.flat.grad[b.lo:b.hi], self._dense[b.index]
            dot += float((got * ref).sum())
            n1 += float((got * got).sum())
            n2 += float((ref * ref).sum())
        self.cosines.append(dot / max((n1 * n2) ** 0.5, 1e-30))
        self._dense.clear()


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench compression", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--densities", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.01, 0.001])
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dgc-momentum", type=float, default=0.0,
                    help="DGC momentum correction (0: plain error feedback; use with sgd)")
    ap.add_argument("--density-warmup", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_compression.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("compression", args.ranks, argv)
    print(f"gradient compression | default task | {args.ranks} ranks | {args.steps} steps | "
          f"{args.optimizer} lr {args.lr:g} | DGC momentum {args.dgc_momentum:g}")
    dense = rows[0]
    for r in rows:
        r["ratio"] = dense["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
        r["acc_drop"] = dense["accuracy"] - r["accuracy"]
        r["kib_per_step"] = r["bytes_per_step"] / 1024
    print(table(rows, [("scheme", "scheme", "s"), ("held-out %", "accuracy", ".2f"),
                       ("drop pts", "acc_drop", ".2f"), ("KiB/step", "kib_per_step", ",.1f"),
                       ("x fewer", "ratio", ".0f"), ("step ms", "step_ms", ".1f"),
                       ("cosine", "cosine", ".3f")]))
    write_json(args.out, {"ranks": args.ranks, "steps": args.steps, "rows": rows})
    print(f"wrote {args.out}")
    return 0
