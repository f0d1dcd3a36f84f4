"""Zeroing gradients without a pass over them (optim's ``zero_grad(lazy=True)``): a step marks
each parameter's gradient stale (``forget_grads``), the first write of the next backward
overwrites it instead of adding into it (the engine copies; a weight's GEMM writes with
BLAS's beta = 0; an op that writes a gradient straight into its buffer asks ``stale`` and
says ``written``), and the outermost backward() zeroes what it did not reach as it ends
(``settle_grads``)."""
from __future__ import annotations

_stale: dict = {}        # id -> leaf whose .grad holds the last step's values


def forget_grads(params) -> None:
    """Mark each of ``params``' gradients as the last step's: the next write overwrites it."""
    for p in params:
        if p.grad is not None:
            _stale[id(p)] = p


def settle_grads() -> None:
    """Zero the gradients ``forget_grads`` marked that nothing wrote since (unused ones)."""
    for p in _stale.values():
        p.grad[...] = 0
    _stale.clear()


def stale(t) -> bool:
    """Whether ``t.grad`` holds the last step's values (forget_grads; nothing wrote it since)."""
    return id(t) in _stale


def written(t) -> None:
    """``t.grad`` holds this step's values now (an op wrote it directly)."""
    _stale.pop(id(t), None)


def overwrite(t) -> bool:
    """Whether the engine's first write into ``t.grad`` this step overwrites it (it was
    stale; it is not any more)."""
    return _stale.pop(id(t), None) is not None
