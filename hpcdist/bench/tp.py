"""Tensor parallelism, measured against its formulas: ``python -m hpcdist.bench tp``.

The rest of this design: docs/tensor-parallel.md, "hpcdist/bench/tp.py"."""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser


def saved_bytes(loss, exclude_ids) -> int:
    """Bytes of the distinct arrays that the graph below ``loss`` keeps alive until backward:
    every node's output (the graph holds its nodes) and every array a backward closure holds
    (views count their base once); ``exclude_ids``: parameters."""
    import numpy as np
    seen, total, stack, visited = set(), 0, [loss], set()

    def count(arr):
        nonlocal total
        base = arr
        while isinstance(getattr(base, "base", None), np.ndarray):
            base = base.base
        if id(base) in seen or id(base) in exclude_ids:
            return
        seen.add(id(base))
        total += base.nbytes
    while stack:
        t = stack.pop()
        if id(t) in visited:
            continue
        visited.add(id(t))
        if isinstance(getattr(t, "data", None), np.ndarray) and t is not loss:
            count(t.data)
        for cell in (getattr(getattr(t, "_backward", None), "__closure__", None) or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if isinstance(v, np.ndarray):
                count(v)
        stack.extend(getattr(t, "_parents", ()))
    return total


def formula_elements(b, s, h, a, t, sp):
    if t == 1:
        return 16 * s * b * h + a * s * s * b
    if sp:
        return (16 * s * b * h + a * s * s * b) / t
    return 4 * s * b * h + (12 * s * b * h + a * s * s * b) / t


def worker(args) -> int:
    import numpy as np
    from hpcdist.device import backend
    from hpcdist import nn
    from hpcdist.comm import Communicator
    from hpcdist.comm.mesh import ProcessMesh
    from hpcdist.run.config import TrainConfig
    from hpcdist.parallel.tp import apply_tensor_parallel, mappings
    from hpcdist.train import train
    comm = Communicator()
    b, s, h, a = args.batch, args.seq, args.n_embd, args.n_head
    backend.set_default_float("float32")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 16, size=(b, s))
    for t in [x for x in (1, 2, 4) if comm.size % x == 0 and not args.skip_layers]:
        mesh = ProcessMesh(comm, dp=comm.size // t, tp=t)
        for sp in ([False, True] if t > 1 else [False]):
            per = {}
            for layers in (1, 2):
                nn.manual_seed(0)
                full = nn.GPT(nn.GPTConfig(vocab_size=16, block_size=s, n_layer=layers,
                                           n_head=a, n_embd=h))
                model = apply_tensor_parallel(full, mesh.tp_comm, sp) if t > 1 else full
                params = {id(p.data) for p in model.parameters()}
                for k in mappings.traffic:
                    mappings.traffic[k] = 0
                _, loss = model(idx, idx)
                held = saved_bytes(loss, params)
                loss.backward()
                per[layers] = (dict(mappings.traffic), held)
            traffic = {k: per[2][0][k] - per[1][0][k] for k in per[2][0]}
            act = per[2][1] - per[1][1]
            bsh = b * s * h
            want = {"allreduce": 4 * bsh, "reduce_scatter": 0, "allgather": 0} if not sp else \
                {"allreduce": 0, "reduce_scatter": 4 * bsh, "allgather": 4 * bsh}
            if t == 1:
                want = {k: 0 for k in want}
            formula = formula_elements(b, s, h, a, t, sp) * 4      # fp32 bytes
            if comm.rank == 0:
                emit({"part": "layer", "tp": t, "sp": sp,
                      **{f"{k}_elems": v for k, v in traffic.items()},
                      **{f"{k}_formula": v for k, v in want.items()},
                      "comm_ratio": (sum(traffic.values()) / sum(want.values()))
                      if sum(want.values()) else None,
                      "act_bytes": act, "act_formula": formula, "act_ratio": act / formula})
        mesh.close()
    out = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    for t in [x for x in (1, 2, 4) if comm.size % x == 0]:
        replicas = comm.size // t                  # the same global batch for every layout
        cfg = TrainConfig(steps=args.steps, tp=t, log_every=10 ** 9, warmup=10,
                          batch_size=args.global_batch // replicas,
                          out_dir=os.path.join(out, f"tp{t}"))
        final = train(cfg, comm, log=lambda *x: None)
        if comm.rank == 0:
            emit({"part": "step", "tp": t, "dp": comm.size // t,
                  "step_ms": final["step_ms_median"], "accuracy": final["accuracy"] * 100})
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench tp", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="b, for parts (a) and (b)")
    ap.add_argument("--seq", type=int, default=32, help="s")
    ap.add_argument("--n-embd", type=int, default=64, help="h")
    ap.add_argument("--n-head", type=int, default=4, help="a")
    ap.add_argument("--steps", type=int, default=60, help="training steps for part (c)")
    ap.add_argument("--global-batch", type=int, default=256, help="part (c)'s global batch")
    ap.add_argument("--out", default="runs/bench_tp.json")
    ap.add_argument("--skip-layers", action="store_true", help="only part (c)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows = relaunch("tp", args.ranks, argv)
    layer = [r for r in rows if r["part"] == "layer"]
    steps = [r for r in rows if r["part"] == "step"]
    print(f"tensor parallelism | {args.ranks} ranks | per layer: b {args.batch} s {args.seq} "
          f"h {args.n_embd} a {args.n_head}, fp32")
    print("(a) elements into tensor-parallel collectives per layer and step; "
          "(b) activation bytes held for backward per layer")
    for r in layer:
        r["layout"] = f"tp {r['tp']}" + (" + sp" if r["sp"] else "")
    print(table(layer, [("layout", "layout", "s"), ("allreduce", "allreduce_elems", ",d"),
                        ("formula", "allreduce_formula", ",d"),
                        ("reduce-scat", "reduce_scatter_elems", ",d"),
                        ("allgather", "allgather_elems", ",d"),
                        ("formula", "allgather_formula", ",d"), ("ratio", "comm_ratio", ".2f"),
                        ("act bytes", "act_bytes", ",d"), ("Korthikanti", "act_formula", ",.0f"),
                        ("ratio", "act_ratio", ".2f")]))
    print("(c) step time, default task")
    base = next((r["step_ms"] for r in steps if r["tp"] == 1), None)
    for r in steps:
        r["vs_dp"] = r["step_ms"] / base if base else None
    print(table(steps, [("tp", "tp", "d"), ("dp", "dp", "d"), ("step ms", "step_ms", ".1f"),
                        ("x pure DP", "vs_dp", ".2f"), ("held-out %", "accuracy", ".2f")]))
    write_json(args.out, {"ranks": args.ranks, "rows": rows})
    print(f"wrote {args.out}")
    return 0
