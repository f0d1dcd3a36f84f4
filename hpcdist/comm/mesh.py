"""Process mesh: the world as a grid of named axes, and a sub-communicator for any set of them.

One rank grid in Megatron's order, outermost first: ``AXES = (pp, dp, ep, cp, tp)`` — the
tensor-parallel index fastest, so a tensor-parallel group is made of neighbouring ranks, which
on a cluster share a node and its fast links (with block placement and TP dividing the ranks
per node); a context-parallel group, whose ring carries K/V blocks every layer, comes next
closest; pipeline stages outermost ("TP within a node, PP across nodes"). ``ep`` (experts) is
size 1 until a model has experts. ``tp_within_node`` says whether the node rule holds.

A group is asked for by naming its axes: the ranks that agree on every other axis, ordered by
their coordinates on the named ones (outermost first). ``Grid`` is the pure arithmetic (no
MPI): adding an axis is adding its name to ``AXES``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AXES = ("pp", "dp", "ep", "cp", "tp")          # outermost first


@dataclass(frozen=True)
class MeshCoord:
    dp: int
    tp: int
    pp: int
    cp: int = 0
    ep: int = 0


class Grid:
    """Ranks laid out over ``AXES`` (sizes by name; an axis not given has size 1)."""

    def __init__(self, **sizes: int):
        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axis {', '.join(unknown)}: the axes are "
                             f"{', '.join(AXES)}")
        for name, n in sizes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh size {name} must be a positive integer, got {n!r}")
        self.sizes = {a: sizes.get(a, 1) for a in AXES}
        self.size = int(np.prod(list(self.sizes.values())))

    def coords(self, rank: int) -> dict:
        """axis -> this rank's index along it (the innermost axis varies fastest)."""
        out = {}
        for a in reversed(AXES):
            rank, out[a] = divmod(rank, self.sizes[a])
        return out

    def rank(self, coords: dict) -> int:
        r = 0
        for a in AXES:
            r = r * self.sizes[a] + coords.get(a, 0)
        return r

    def _index(self, coords: dict, axes) -> int:
        """The mixed-radix number of ``coords`` on ``axes`` (taken in AXES order)."""
        i = 0
        for a in AXES:
            if a in axes:
                i = i * self.sizes[a] + coords[a]
        return i

    def color_key(self, rank: int, axes) -> tuple[int, int]:
        """(which group of ``axes`` the rank is in, its place in that group)."""
        self._check(axes)
        c = self.coords(rank)
        return self._index(c, [a for a in AXES if a not in axes]), self._index(c, axes)

    def group(self, rank: int, axes) -> list[int]:
        """The ranks of ``rank``'s group over ``axes``, in group order."""
        color = self.color_key(rank, axes)[0]
        keyed = (self.color_key(r, axes) + (r,) for r in range(self.size))
        return [r for _, _, r in sorted(k for k in keyed if k[0] == color)]

    def groups(self, axes) -> list[list[int]]:
        """Every group over ``axes``, each in group order, the groups by color."""
        out: dict = {}
        for r in range(self.size):
            color, key = self.color_key(r, axes)
            out.setdefault(color, []).append((key, r))
        return [[r for _, r in sorted(out[c])] for c in sorted(out)]

    def _check(self, axes) -> None:
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown[0]!r}: the axes are {', '.join(AXES)}")


def mesh_coords(rank: int, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> MeshCoord:
    """This rank's coordinates on the grid. Pure logic, no MPI."""
    return MeshCoord(**Grid(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep).coords(rank))


def mesh_rank(coord: MeshCoord, dp: int, tp: int, cp: int = 1, ep: int = 1) -> int:
    return Grid(dp=dp, tp=tp, cp=cp, ep=ep, pp=coord.pp + 1).rank(vars(coord))


def validate_mesh(world: int, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> None:
    grid = Grid(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    if grid.size != world:
        raise ValueError(f"mesh dp x ep x cp x tp x pp = {dp} x {ep} x {cp} x {tp} x {pp} = "
                         f"{grid.size} does not match the world size {world}; choose sizes "
                         f"whose product is {world}")


class ProcessMesh:
    """Sub-communicators of ``comm`` over the grid (construction is collective over ``comm``).

    ``group(*axes)`` is the one way to make one; the named ones are the strategies':
    ``dp_comm`` (dp, ep, cp: the ranks that hold the same model part — gradients are averaged
    over it, ZeRO shards over it), ``batch_comm`` (dp, ep: those of them that read different
    batches; a context-parallel group reads one batch and splits each sequence), ``cp_comm``
    (the ranks that split one sequence), ``tp_comm`` (one layer), ``pp_comm`` (the stages of
    a pipeline); with ep > 1 ``ep_comm`` (one MoE layer's experts) and ``expert_dp_comm``
    (dp, cp: the ranks holding the same experts).
    """

    def __init__(self, comm, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 *, backend: str = "mpi"):
        validate_mesh(comm.size, dp, tp, pp, cp, ep)
        self.world, self.grid = comm, Grid(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        self.backend = backend          # "nccl": every group is an NCCL communicator
        self.dp, self.tp, self.pp, self.cp, self.ep = dp, tp, pp, cp, ep
        self.coord = MeshCoord(**self.grid.coords(comm.rank))
        self._groups: dict = {}
        # expert parallelism folds over data parallelism: the ranks of an EP group read
        # batches of their own and average the dense gradients with the rest of DP
        folded = ("dp", "ep") if ep > 1 else ("dp",)
        self.dp_comm = self.group(*folded, "cp")
        self.batch_comm = self.group(*folded) if cp > 1 else self.dp_comm   # the same ranks
        self.ep_comm = self.group("ep") if ep > 1 else None      # an MoE layer's experts
        self.expert_dp_comm = self.group("dp", "cp") if ep > 1 else None   # the same expert
        self.cp_comm = self.group("cp")
        self.tp_comm = self.group("tp")
        self.pp_comm = self.group("pp")
        # every tensor-parallel group on one node? (agreed: each rank sees only its group)
        spans = comm.allreduce(np.array([self.tp_comm.nodes], dtype=np.int64), op="max")
        self.tp_within_node = int(spans[0]) == 1

    def group(self, *axes: str):
        """The communicator over ``axes``: this rank and those that agree with it on every
        other axis (collective over the world the first time a set of axes is asked for; one
        communicator per set, so each role's traffic stays its own)."""
        self.grid._check(axes)
        axes = tuple(a for a in AXES if a in axes)
        if axes not in self._groups:
            color, key = self.grid.color_key(self.world.rank, axes)
            sub = self.world.split(color=color, key=key)
            if self.backend == "nccl":                 # device arrays over NCCL, host over sub
                from .nccl import NcclCommunicator
                sub = NcclCommunicator(host=sub, label="+".join(axes))
            self._groups[axes] = sub
        return self._groups[axes]

    def __repr__(self):
        sizes = ", ".join(f"{a}={n}" for a, n in self.grid.sizes.items())
        return f"ProcessMesh({sizes}, rank={self.world.rank}, coord={self.coord})"

    def close(self) -> None:
        for sub in self._groups.values():
            sub.close()
        self._groups.clear()
