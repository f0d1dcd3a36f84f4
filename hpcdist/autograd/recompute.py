"""Activation checkpointing: keep a block's inputs, recompute its activations in backward.

``checkpoint(fn, *inputs)`` runs ``fn`` without building a graph, so none of its internal
activations stay alive; the result is one node whose backward re-runs ``fn`` with the graph on
(dropout replays the same random numbers: the generator's state is saved and restored) and
backpropagates through that fresh graph. Parameters inside ``fn`` get their gradients, and
fire their hooks, during that inner backward.
"""
from __future__ import annotations

import contextlib

from ..device import backend
from . import tensor as _tensor
from .tensor import Tensor


@contextlib.contextmanager
def _grad_mode(enabled: bool):
    prev = _tensor._grad_enabled
    _tensor._grad_enabled = enabled
    try:
        yield
    finally:
        _tensor._grad_enabled = prev


_RECOMPUTING = [0]           # > 0 while a checkpointed block runs again in backward


def recomputing() -> bool:
    """True while ``checkpoint`` re-runs a block in backward (ZeRO-3 keeps the block's
    parameters gathered from its recomputation to the end of its backward)."""
    return _RECOMPUTING[0] > 0


def checkpoint(fn, *inputs: Tensor) -> Tensor:
    """``fn(*inputs)`` with its activations recomputed in backward instead of stored."""
    if not _tensor.is_grad_enabled():
        return fn(*inputs)
    rng_state = backend.rng_state()
    with _grad_mode(False):
        out = fn(*inputs)

    def backward(g):
        # Detached stand-ins for the inputs: the inner backward stops at them.
        stand_ins = [Tensor._make(x.data, (), None) for x in inputs]
        for s, x in zip(stand_ins, inputs):
            s.requires_grad = x.requires_grad
        after = backend.rng_state()
        backend.set_rng_state(rng_state)           # same dropout masks as the forward
        _RECOMPUTING[0] += 1
        try:
            with _grad_mode(True):
                redo = fn(*stand_ins)
        finally:
            _RECOMPUTING[0] -= 1
        backend.set_rng_state(after)
        redo.backward(g)
        return tuple(s.grad if x.requires_grad else None for s, x in zip(stand_ins, inputs))

    result = Tensor._make(out.data, tuple(inputs), backward)
    if not result.requires_grad:
        # The inputs are plain data, but fn's parameters still train: keep the node.
        result.requires_grad, result._parents, result._backward = True, tuple(inputs), backward
    return result


def graph_bytes(root: Tensor) -> int:
    """Bytes of activations the graph behind ``root`` keeps alive (non-leaf outputs).

    What activation checkpointing saves: with it, only each block's input stays.
    """
    seen, stack, total = set(), [root], 0
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node._backward is not None:
            total += node.data.nbytes
        stack.extend(node._parents)
    return total
