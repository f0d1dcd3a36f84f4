"""Frozen: a base weight that is not trained (LoRA's base: nn/lora.py; QLoRA's 4-bit one:
nn/nf4.py)."""
from __future__ import annotations

from ..autograd.tensor import Tensor


class Frozen(Tensor):
    """Data only, never a gradient: not a Parameter, so nothing that trains (optimizer,
    DDP's buckets, ZeRO's shards, the gradient norm, checkpoints) finds it."""

    __slots__ = ()

    def __init__(self, data):
        super().__init__(data, requires_grad=False)
