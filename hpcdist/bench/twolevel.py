"""Allreduce on two-level links: ``python -m hpcdist.cluster run --nodes N --ranks-per-node L
--link 1gbit -- python -m hpcdist.bench twolevel``.

On ranks spread over nodes (a real cluster, or the cluster in a box), per size: hpcdist's
flat ring, its hierarchical allreduce (comm/hierarchical.py), what "auto" picks, MPI's
built-in and torch.distributed over gloo (where torch is installed), alternating on the same
buffers in rounds (median round per rank, then the mean over ranks); the bytes each rank sent
across nodes per call (hpcdist's, counted at the wire); the per-level alpha-beta fits
(``comm.model.fit_links``) and the HPCDIST_LINKS line that tells "auto" about them.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from hpcdist.bench.common import table, write_json
from ..host.cli import Parser


def _gloo(comm):
    """torch.distributed over gloo on the same ranks (None without torch)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:29533", rank=comm.rank,
                                world_size=comm.size)
    return torch, dist


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench twolevel", description=__doc__)
    ap.add_argument("--sizes", default="4096,65536,1048576,4194304,16777216",
                    help="bytes, comma-separated (float32 buffers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    from mpi4py import MPI
    from hpcdist.bench.collectives import timed
    from hpcdist.comm import Communicator, select
    from hpcdist.comm.model import fit_links
    comm = Communicator()
    topo = comm.topology
    links = fit_links(comm, big=4 << 20)
    gloo = _gloo(comm)
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(nbytes // 4, dtype=np.float32)
        out = np.empty_like(x)
        iters = max(2, min(50, (8 << 20) // max(nbytes, 1)))
        runs = {"flat ring": lambda: comm.allreduce(x, out=out, algorithm="ring"),
                "hierarchical": lambda: comm.allreduce(x, out=out, algorithm="hierarchical"),
                "auto": lambda: comm.allreduce(x, out=out),
                "MPI built-in": lambda: comm.mpi.Allreduce(x, out, op=MPI.SUM)}
        if gloo is not None:
            torch, dist = gloo
            t = torch.from_numpy(x.copy())
            runs["torch gloo"] = lambda: dist.all_reduce(t)
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(timed(comm.mpi, fn, iters)[0])
        inter = {}
        for name in ("flat ring", "hierarchical", "auto"):
            before = comm.bytes_inter_node
            runs[name]()
            inter[name] = comm.mpi.allreduce(comm.bytes_inter_node - before, op=MPI.MAX)
        row = {"bytes": nbytes, "nodes": topo.nodes, "per_node": topo.per_node}
        row.update({f"{k} ms": float(np.median(v)) * 1e3 for k, v in times.items()})
        row.update({f"{k} inter-node B/rank (max)": v for k, v in inter.items()})
        row["auto picks"] = select.choose("allreduce", nbytes, comm.size, topology=topo)
        rows.append(row)
    if comm.rank == 0:
        spec = ",".join(f"{k}={a * 1e6:.1f}:{1 / b / 1e9 if b else 1e3:.3f}"
                        for k, (a, b) in links.items())
        print(f"{topo.nodes} nodes x {topo.per_node} ranks; links measured (ping-pong): "
              + "; ".join(f"{k}: alpha {a * 1e6:.1f} us, {1 / b / 1e9 if b else 0:.3f} GB/s"
                          for k, (a, b) in links.items())
              + f"\n  tell auto: HPCDIST_LINKS={spec}")
        cols = [("bytes", "bytes", "d")] + [(c, c, ".2f") for c in rows[0] if c.endswith(" ms")] \
            + [("auto picks", "auto picks", "s")]
        print(table(rows, cols))
        cols = [("bytes", "bytes", "d")] + [(c.replace(" inter-node B/rank (max)", " B across"),
                                             c, "d") for c in rows[0] if "inter-node" in c]
        print("bytes one rank sent across nodes per call (the most of any rank):")
        print(table(rows, cols))
        write_json(os.path.join(args.out, f"bench_twolevel_{topo.nodes}x{topo.per_node}.json"),
                   {"links": {k: list(v) for k, v in links.items()}, "rows": rows})
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
