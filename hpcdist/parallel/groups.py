"""Replica groups: the world cut into G groups of K ranks (a node each by default), a layout
run inside every group, and what crosses between them.

Two strategies are built this way: hybrid sharding (``--zero N --shard-group node``: ZeRO
inside each group, its averaged gradient shards all-reduced across the groups, PyTorch FSDP's
HYBRID_SHARD, DeepSpeed's hpZ) and DiLoCo (parallel/diloco.py: the groups train apart and
average a pseudo-gradient every H steps). Both talk across groups over ``cross``: the ranks
that hold the same place in their groups (so the same shard, or the same tensor-parallel
slice), one per group — on a cluster, one rank per node on each slow link.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device import backend
from .base import Strategy, delegate
from .mixed_precision import averaging


@dataclass
class Groups:
    index: int          # this rank's group
    count: int          # how many groups
    inner: object       # the Communicator of this rank's group
    cross: object       # the ranks at this rank's place in every group, in group order


def replica_groups(comm, size: int) -> Groups:
    """Cut ``comm`` into groups of ``size`` consecutive ranks (0: the ranks of each node, by
    the communicator's node map). Collective over ``comm``."""
    if size == 0:
        nodes = sorted(set(comm.node_of))
        index, count = nodes.index(comm.node_of[comm.rank]), len(nodes)
        sizes = {comm.node_of.count(n) for n in nodes}
        if len(sizes) > 1:
            raise ValueError(f"the nodes hold different numbers of ranks ({sorted(sizes)}): "
                             "one replica group per node needs as many on each; give the "
                             "group size (--group-size / --shard-size K)")
    else:
        if comm.size % size:
            raise ValueError(f"groups of {size} ranks do not divide the world of {comm.size}")
        index, count = comm.rank // size, comm.size // size
    inner = comm.split(color=index)
    cross = comm.split(color=inner.rank, key=index)
    return Groups(index, count, inner, cross)


class Counted:
    """Several communicators' byte counts read as one (train.py reads ``strategy.comm``)."""

    def __init__(self, *comms):
        self.comms = [c for c in comms if c is not None]

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.comms)

    @property
    def bytes_inter_node(self) -> int:
        return sum(c.bytes_inter_node for c in self.comms)


def world_batches(comm, groups: Groups, inner):
    """The ranks of ``comm`` that read different batches and hold the same model part as
    this rank (the inner layout's batch group, over every group), ordered group by group."""
    batch = inner.batch_comm
    color = np.array([groups.inner.rank], dtype=np.int64)   # the inner batch group's rank 0
    batch.bcast(color, root=0)
    return comm.split(color=int(color[0]), key=groups.index * batch.size + batch.rank)


def reseed(cfg, batch_comm) -> None:
    """Each replica its own dropout stream, as the layout without groups would draw it."""
    backend.seed(cfg.seed + 1000 * batch_comm.rank)


ACROSS = ("begin", "zero_grad", "micro_context", "scale_loss", "multiplier", "forward_backward",
          "eval_context", "optimizer", "compression", "memory", "peak_memory", "full_parameters",
          "describe")


@delegate("inner", ACROSS + ("sync", "apply", "flat_state", "loaded", "own_state",
                             "load_own_state", "add_optimizer_state", "summary"))
class AcrossGroups(Strategy):
    """A layout (``inner``) run in each replica group, the groups joined over ``cross``:
    batches, losses and checkpoints are the whole world's. Subclasses add what crosses."""

    norm_is_global = False      # a step's gradient norm is the group's (run/report.py)

    def __init__(self, inner, comm, groups: Groups, batches):
        self.inner, self.groups, self.cross = inner, groups, groups.cross
        self.model, self.mesh, self.scaler = inner.model, inner.mesh, inner.scaler
        self._batches = batches
        self.dp_comm = batches                    # the losses' mean: every replica's
        self.comm = Counted(inner.comm, groups.cross)

    @property
    def batch_comm(self):
        return self._batches

    def holds_state(self) -> bool:
        return self.groups.index == 0 and self.inner.holds_state()   # group 0 writes

    def close(self) -> None:
        """Free the communicators the groups made (collective; train() calls it last): a
        process that trains many times would run out of MPI's communicator ids."""
        if hasattr(self.inner, "close"):
            self.inner.close()
        elif self.inner.mesh is not None:
            self.inner.mesh.close()
        for c in {id(c): c for c in (self._batches, self.cross, self.groups.inner)}.values():
            c.close()


class Replicated(AcrossGroups):
    """Hybrid sharding: ``inner`` is ZeRO over the group; after its reduce-scatter, each
    averaged gradient shard is all-reduced (averaged) across the groups, so every group steps
    with the whole world's gradient."""

    def sync(self) -> None:
        self.inner.sync()
        if self.cross.size > 1:
            g = self.inner.grad_shard
            self.cross.allreduce(g, averaging(g, self.cross.size), out=g)

    def describe(self) -> list[str]:
        inner = self.inner.describe()
        return [f"{inner[0]} hybrid: sharded over {self.groups.inner.size} ranks, replicated "
                f"over {self.groups.count} groups"] + inner[1:]
