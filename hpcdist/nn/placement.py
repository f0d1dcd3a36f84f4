"""Where every parameter lies on each mesh axis, declared where the parameter is made.

A module declares, for each parameter it owns, what the parameter is applied to
(``placements``: name -> a kind below). That word and the run's layout fix the parameter's
placement on every mesh axis (PyTorch DTensor's Shard / Replicate / Partial). The gradient
sums, the global norm's counting, ZeRO's ownership and which rank writes what into a
checkpoint read the placements (``resolve``); nothing infers them from a flag. A parameter no
module declares is refused when the model is built (``check_declared``), and under tensor
parallelism a one-batch probe checks that every declaration is true (parallel/tp/probe.py):
a replicated parameter fed a sharded activation is refused in one line naming it."""
from __future__ import annotations

from dataclasses import dataclass

# The kinds. HIDDEN: the residual stream, every position's whole hidden vector (norms over
# it, row-parallel biases added after the reduction, position tables, a MoE router and
# experts that TP does not cut): replicated over TP, the gradient whole without sequence
# parallelism and partial with it (each rank sees only its rows). HEADS: this rank's
# attention heads (a per-head q/k norm: Qwen3): partial over TP, SP or not. SHARDED: the
# parameter is this rank's shard of the logical tensor (the TP layers; their ``shard_spec``
# says on which dimension and in what pieces). SPLIT: applied to an activation tensor
# parallelism splits, whole on every rank, its gradient this rank's share: partial over TP,
# SP or not, as HEADS (a LoRA adapter's A on a column-parallel layer, which sees only this
# rank's output columns' gradient; its B on a row-parallel one, fed this rank's partial
# product: nn/lora.py).
HIDDEN, HEADS, SHARDED, SPLIT = "hidden", "heads", "sharded", "split"
KINDS = (HIDDEN, HEADS, SHARDED, SPLIT)


@dataclass(frozen=True)
class Placement:
    """How a parameter lies on one mesh axis: ``kind`` "shard" (each rank a part, cut on
    ``dim``), "replicate" (a copy on every rank, the gradient whole) or "partial" (a copy
    whose gradient is this rank's share, to be summed over the axis)."""
    kind: str
    dim: int | None = None

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else self.kind.capitalize() + "()"

    @property
    def sharded(self) -> bool:
        return self.kind == "shard"

    @property
    def partial(self) -> bool:
        return self.kind == "partial"


REPLICATE, PARTIAL = Placement("replicate"), Placement("partial")


def shard_on(dim: int) -> Placement:
    """Sharded on ``dim`` (not nn.module.Shard, which records how a TP layer cut a tensor)."""
    return Placement("shard", dim)


@dataclass(frozen=True)
class Layout:
    """What placements depend on: the mesh's sizes and whether sequence parallelism splits
    the residual stream between the tensor-parallel regions."""
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1


def placement(kind: str, layout: Layout, spec=None, expert: bool = False) -> dict:
    """The placement on every axis (axis -> Placement) of a parameter declared ``kind`` in
    ``layout``; ``spec``: its tensor-parallel cut (nn.module.Shard) where SHARDED;
    ``expert``: it is an expert that expert parallelism places on one rank of its group."""
    if kind not in KINDS:
        raise ValueError(f"unknown placement kind {kind!r}: one of {', '.join(KINDS)}")
    if kind == SHARDED:
        tp = shard_on(spec.axis if spec is not None else 0)
    elif layout.tp == 1:
        tp = REPLICATE
    elif kind in (HEADS, SPLIT):
        tp = PARTIAL                                # other heads (columns) on the other ranks
    else:
        tp = PARTIAL if layout.sequence_parallel else REPLICATE
    return {"dp": PARTIAL if layout.dp > 1 else REPLICATE,       # each replica its batches
            "cp": PARTIAL if layout.cp > 1 else REPLICATE,       # each rank its positions
            "tp": tp,
            "ep": shard_on(0) if expert else PARTIAL if layout.ep > 1 else REPLICATE,
            "pp": shard_on(0) if layout.pp > 1 else REPLICATE}     # each stage its layers


def undeclared(model, kinds: dict | None = None) -> list:
    """The names of ``model``'s parameters that no module declares a kind for (``kinds``:
    ``model.declared_kinds()``, where the caller has it)."""
    kinds = model.declared_kinds() if kinds is None else kinds
    return [name for name, p in model.named_parameters() if kinds.get(id(p)) not in KINDS]


def check_declared(model, kinds: dict | None = None) -> None:
    """Refuse a model with a parameter whose placement no module declares (one line)."""
    missing = undeclared(model, kinds)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"parameter {missing[0]}{more} declares no placement: the module "
                         "that makes it must say what it is applied to in its "
                         "`placements` (nn/placement.py: hidden, heads or sharded)")


def resolve(model, layout: Layout, experts=frozenset()) -> list:
    """(name, parameter, {axis: Placement}) for each of ``model``'s parameters, in
    ``named_specs`` order; ``experts``: ids of the parameters expert parallelism placed on
    this rank alone. A parameter no module declares is refused (``check_declared``)."""
    kinds = model.declared_kinds()
    check_declared(model, kinds)
    return [(name, p, placement(kinds[id(p)], layout, spec, id(p) in experts))
            for name, p, spec in model.named_specs()]
