"""Zeroing gradients without a pass over them (optim's ``zero_grad(lazy=True)``): a step marks
each parameter's gradient stale (``forget_grads``), the first write of the next backward
overwrites it instead of adding into it (the engine copies; a weight's GEMM writes with
BLAS's beta = 0; an op that writes a gradient straight into its buffer asks ``stale`` and
says ``written``), and the outermost backward() zeroes what it did not reach as it ends
(``settle_grads``). A pass that zeroed them (a device's, one launch for all) says so
(``zeroed_grads``): the first write may then overwrite as well as add (``fresh``: a GEMM's
epilogue writes a bias's gradient, it cannot add)."""
from __future__ import annotations

from ..device import graphs

_stale: dict = {}        # id -> leaf whose .grad holds the last step's values
_zeroed: dict = {}       # id -> (leaf whose .grad a pass zeroed, nothing written since, the
#                          CUDA graph capture that saw it: a replay without that pass may not)


def forget_grads(params) -> None:
    """Mark each of ``params``' gradients as the last step's: the next write overwrites it."""
    for p in params:
        if p.grad is not None:
            _stale[id(p)] = p


def zeroed_grads(params) -> None:
    """Mark each of ``params``' gradients as just zeroed: its next write may overwrite it."""
    token = graphs.capture_token()
    for p in params:
        if p.grad is not None:
            _zeroed[id(p)] = (p, token)


def settle_grads() -> None:
    """Zero the gradients ``forget_grads`` marked that nothing wrote since (unused ones)."""
    for p in _stale.values():
        p.grad[...] = 0
    _stale.clear()
    _zeroed.clear()


def stale(t) -> bool:
    """Whether ``t.grad`` holds the last step's values (forget_grads; nothing wrote it since)."""
    return id(t) in _stale


def fresh(t) -> bool:
    """Whether ``t.grad``'s next write may overwrite it: it is stale, or zeroed since any write
    (inside the CUDA graph capture running now, if any: its replays zero it again)."""
    zeroed = _zeroed.get(id(t))
    return id(t) in _stale or (zeroed is not None and zeroed[1] == graphs.capture_token())


def written(t) -> None:
    """``t.grad`` holds this step's values now (an op wrote or added into it directly)."""
    _stale.pop(id(t), None)
    _zeroed.pop(id(t), None)


def overwrite(t) -> bool:
    """Whether the engine's first write into ``t.grad`` this step overwrites it (it was
    stale; it is not any more)."""
    _zeroed.pop(id(t), None)
    return _stale.pop(id(t), None) is not None
