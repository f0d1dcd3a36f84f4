"""Building blocks of ZeRO: the optimizer's view of a shard, the pieces of a flat range that
each rank owns, groups of parameters moved together, and an identity node that calls back when
backward reaches it."""
from __future__ import annotations

from ..comm.arith import shard_bounds
from ..optim import FlatParams, intersect
from ..autograd.tensor import Tensor


class ShardParams(FlatParams):
    """The optimizer's view of this rank's shard: flat ``data`` and ``grad``, decay ranges."""

    def __init__(self, data, grad, decay_ranges):   # noqa: no super(): nothing to pack
        self.data, self.grad, self.decay_ranges = data, grad, decay_ranges
        self.size, self.params, self.offsets = data.size, [], []


def pieces_of_range(a: int, b: int, world: int, length: int):
    """Each rank's part of the flat range [a, b), relative to a (empty where none)."""
    out = []
    for c in range(world):
        lo, hi = shard_bounds(length, world, c)
        s, e = intersect(a, b, lo, hi)
        out.append((s - a, e - a) if s < e else (0, 0))
    return out


def identity_hook(x: Tensor, on_backward) -> Tensor:
    """x itself, plus a callback when backward reaches this point — also where x needs no
    gradient (the first block's input under LoRA, whose base table is frozen): the node is
    kept so the callback still comes after the block's own backward."""
    from ..autograd.tensor import is_grad_enabled

    def backward(g):
        on_backward()
        return (g if x.requires_grad else None,)
    out = Tensor._make(x.data, (x,), backward)
    if not out.requires_grad and is_grad_enabled():
        out.requires_grad, out._parents, out._backward = True, (x,), backward
    return out
