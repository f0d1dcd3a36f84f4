"""Process mesh: the world as a DP x TP x PP grid, with a sub-communicator along each axis.

Rank layout (Megatron's order): tensor-parallel index fastest, then data-parallel, then
pipeline stage — ``rank = (pp * DP + dp) * TP + tp`` — so a tensor-parallel group is made of
neighbouring ranks, which on a cluster share a node and its fast links: with the launchers'
block placement (a node's ranks consecutive) and TP dividing the ranks per node, every
tensor-parallel group stays inside a node and the data-parallel and pipeline groups span the
nodes ("TP within a node, PP across nodes"). Another layout is allowed; ``tp_within_node``
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


def mesh_coords(rank: int, dp: int, tp: int, pp: int) -> MeshCoord:
    """This rank's (dp, tp, pp) coordinates. Pure logic, no MPI."""
    return MeshCoord(dp=(rank // tp) % dp, tp=rank % tp, pp=rank // (tp * dp))


def mesh_rank(coord: MeshCoord, dp: int, tp: int) -> int:
    return (coord.pp * dp + coord.dp) * tp + coord.tp


def validate_mesh(world: int, dp: int, tp: int, pp: int) -> None:
    for name, n in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh size {name} must be a positive integer, got {n!r}")
    if dp * tp * pp != world:
        raise ValueError(f"mesh dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} does not "
                         f"match the world size {world}; choose sizes whose product is {world}")


class ProcessMesh:
    """Sub-communicators of ``comm`` along each axis of a DP x TP x PP grid.

    ``dp_comm`` joins the ranks that hold the same model part (same tp, pp) — gradients are
    averaged over it; ``tp_comm`` the ranks that split one layer; ``pp_comm`` the stages of one
    pipeline. Construction is collective over ``comm``.
    """

    def __init__(self, comm, dp: int = 1, tp: int = 1, pp: int = 1):
        validate_mesh(comm.size, dp, tp, pp)
        self.world, self.dp, self.tp, self.pp = comm, dp, tp, pp
        self.coord = mesh_coords(comm.rank, dp, tp, pp)
        c = self.coord
        # Ranks share a color when they agree on the other two axes; key orders them on this one.
        self.dp_comm = comm.split(color=c.pp * tp + c.tp, key=c.dp)
        self.tp_comm = comm.split(color=c.pp * dp + c.dp, key=c.tp)
        self.pp_comm = comm.split(color=c.dp * tp + c.tp, key=c.pp)
        # every tensor-parallel group on one node? (agreed: each rank sees only its group)
        spans = comm.allreduce(np.array([self.tp_comm.nodes], dtype=np.int64), op="max")
        self.tp_within_node = int(spans[0]) == 1

    def __repr__(self):
        return (f"ProcessMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, "
                f"rank={self.world.rank}, coord={self.coord})")

    def close(self) -> None:
        for sub in (self.dp_comm, self.tp_comm, self.pp_comm):
            sub.close()
