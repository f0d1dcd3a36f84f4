"""Process mesh: the world as a DP x CP x TP x PP grid, with a sub-communicator along each axis.

Rank layout (Megatron's order): tensor-parallel index fastest, then context-parallel, then
data-parallel, then pipeline stage — ``rank = ((pp * DP + dp) * CP + cp) * TP + tp`` — so a
tensor-parallel group is made of
neighbouring ranks, which on a cluster share a node and its fast links: with the launchers'
block placement (a node's ranks consecutive) and TP dividing the ranks per node, every
tensor-parallel group stays inside a node and the data-parallel and pipeline groups span the
nodes ("TP within a node, PP across nodes"); a context-parallel group, whose ring carries
K/V blocks every layer, comes next closest. Another layout is allowed; ``tp_within_node``
says whether it holds, and the run's header says so when it does not.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MeshCoord:
    dp: int
    tp: int
    pp: int
    cp: int = 0


def mesh_coords(rank: int, dp: int, tp: int, pp: int, cp: int = 1) -> MeshCoord:
    """This rank's (dp, tp, pp, cp) coordinates. Pure logic, no MPI."""
    return MeshCoord(dp=(rank // (tp * cp)) % dp, tp=rank % tp, pp=rank // (tp * cp * dp),
                     cp=(rank // tp) % cp)


def mesh_rank(coord: MeshCoord, dp: int, tp: int, cp: int = 1) -> int:
    return ((coord.pp * dp + coord.dp) * cp + coord.cp) * tp + coord.tp


def validate_mesh(world: int, dp: int, tp: int, pp: int, cp: int = 1) -> None:
    for name, n in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh size {name} must be a positive integer, got {n!r}")
    if dp * tp * pp * cp != world:
        raise ValueError(f"mesh dp x cp x tp x pp = {dp} x {cp} x {tp} x {pp} = "
                         f"{dp * cp * tp * pp} does not match the world size {world}; choose "
                         f"sizes whose product is {world}")


class ProcessMesh:
    """Sub-communicators of ``comm`` along each axis of a DP x CP x TP x PP grid.

    ``dp_comm`` joins the ranks that hold the same model part (same tp, pp): DP x CP of them —
    gradients are averaged over it, ZeRO shards over it; ``batch_comm`` those of them that read
    different batches (the DP axis: a context-parallel group reads one batch and splits each
    sequence); ``cp_comm`` the ranks that split one sequence; ``tp_comm`` the ranks that split
    one layer; ``pp_comm`` the stages of one pipeline. Construction is collective over ``comm``.
    """

    def __init__(self, comm, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1):
        validate_mesh(comm.size, dp, tp, pp, cp)
        self.world, self.dp, self.tp, self.pp, self.cp = comm, dp, tp, pp, cp
        self.coord = mesh_coords(comm.rank, dp, tp, pp, cp)
        c = self.coord
        # Ranks share a color when they agree on the other axes; key orders them on this one.
        self.dp_comm = comm.split(color=c.pp * tp + c.tp, key=c.dp * cp + c.cp)
        self.batch_comm = comm.split(color=(c.pp * cp + c.cp) * tp + c.tp, key=c.dp) \
            if cp > 1 else self.dp_comm
        self.cp_comm = comm.split(color=(c.pp * dp + c.dp) * tp + c.tp, key=c.cp)
        self.tp_comm = comm.split(color=(c.pp * dp + c.dp) * cp + c.cp, key=c.tp)
        self.pp_comm = comm.split(color=(c.dp * cp + c.cp) * tp + c.tp, key=c.pp)
        # every tensor-parallel group on one node? (agreed: each rank sees only its group)
        spans = comm.allreduce(np.array([self.tp_comm.nodes], dtype=np.int64), op="max")
        self.tp_within_node = int(spans[0]) == 1

    def __repr__(self):
        return (f"ProcessMesh(dp={self.dp}, cp={self.cp}, tp={self.tp}, pp={self.pp}, "
                f"rank={self.world.rank}, coord={self.coord})")

    def close(self) -> None:
        for sub in {id(c): c for c in (self.dp_comm, self.batch_comm, self.cp_comm,
                                        self.tp_comm, self.pp_comm)}.values():
            sub.close()
