"""A run's axis sizes (pure arithmetic: no MPI, nothing of hpcdist imported), computed once
for the mesh (comm/mesh.py), the strategies, the checkpoints' layout record, the checks
before step 1, the memory check and recovery."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A run's axis sizes, computed once from the world size and the model-parallel sizes
    (pure: no MPI). ``model``: the ranks one copy of the model is cut over (tp x pp x cp);
    ``replicas``: the copies, each reading its own batches (data parallelism with expert
    parallelism folded in: what the global batch and ZeRO count); ``dp``: the mesh's data
    axis without EP (``replicas`` / ep). Strategies, checkpoints, recovery and the memory
    check read these; a recovery makes a new Layout for the survivors."""
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, cfg, world: int) -> "Layout":
        return cls(world, cfg.tp, cfg.pp, cfg.cp, cfg.ep)

    @property
    def model(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        return self.world // self.model

    @property
    def dp(self) -> int:
        return self.replicas // self.ep

    @property
    def plain(self) -> bool:
        """Plain data parallelism: no mesh needed."""
        return self.model == 1 and self.ep == 1
