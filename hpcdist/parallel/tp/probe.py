"""The check that every parameter's declared placement is true, made once when a tensor-
parallel model is built: one forward and backward pass of a small batch (the same tokens on
every rank of the group), then each parameter's gradient compared across the group.

A parameter declared replicated with a whole gradient must get the same gradient on every
rank: where it differs, the parameter is fed a sharded activation (this rank's heads, its
rows of the sequence) and its gradient is partial — summing nothing would train it silently
wrong. A parameter declared partial must not get the same gradient everywhere: summing a
whole gradient would multiply it by the group's size. Either is refused in one line naming
the parameter and what to declare (nn/placement.py)."""
from __future__ import annotations

import numpy as np

from ...device import backend
from ...nn import placement
from ...nn.moe import moe_layers

# Gradients computed alike on every rank agree to the last bits; a partial one differs from
# its neighbour's by the order of the gradient itself. Between the two: a wide margin.
AGREE = 1e-6


def _fingerprints(grads: list, xp) -> np.ndarray:
    """Per gradient: its sum of squares and its dot with a fixed ramp (two numbers that any
    difference between two ranks' gradients moves)."""
    out = []
    for g in grads:
        if g is None:
            out += [0.0, 0.0]
            continue
        flat = g.reshape(-1).astype("float64")
        ramp = xp.cos(xp.arange(flat.size, dtype="float64"))
        out += [float((flat * flat).sum()), float((flat * ramp).sum())]
    return np.array(out)


def check_placements(model, comm, sequence_parallel: bool) -> None:
    """Refuse ``model`` (cut over ``comm``, the tensor-parallel group) where a parameter's
    gradient contradicts its declared tensor-parallel placement (one line naming it).
    Collective over ``comm``; leaves no gradient, load count or mode changed."""
    if comm.size == 1:
        return
    layout = placement.Layout(tp=comm.size, sequence_parallel=sequence_parallel)
    placed = [(n, p, where["tp"]) for n, p, where in placement.resolve(model, layout)
              if not where["tp"].sharded]
    if not placed:
        return
    cfg = model.config
    T = max(1, min(cfg.block_size, 2 * comm.size))
    rng = np.random.default_rng(12345)                        # the same tokens on every rank
    idx = backend.to_device(rng.integers(0, cfg.vocab_size, (1, T)))
    targets = backend.to_device(rng.integers(0, cfg.vocab_size, (1, T)))
    training = model.training
    model.eval()                                              # (no dropout draws)
    params = model.parameters()
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        _, loss = model(idx, targets)
        loss.backward()
        xp = backend.xp()
        mine = _fingerprints([p.grad for _, p, _ in placed], xp)
        high = comm.allreduce(mine, op="max")
        low = comm.allreduce(mine, op="min")
    finally:
        for p, g in zip(params, before):
            p.grad = g
        for m in moe_layers(model):                           # (the probe's tokens: not a step's)
            m.load[...] = 0
            m.dropped = 0
        model.train(training)
    spread = (high - low).reshape(-1, 2)
    scale = np.maximum(np.abs(high), np.abs(low)).reshape(-1, 2)
    for (name, _, where), d, s in zip(placed, spread, scale):
        differs = bool((d > AGREE * np.maximum(s, 1e-300)).any())
        if where.partial or not s.any():
            if where.partial and s.any() and not differs:
                raise ValueError(
                    f"parameter {name} is declared with a gradient partial over the tensor-"
                    "parallel group, but every rank computes the same whole gradient: "
                    "summing it would multiply it; declare it `hidden` (nn/placement.py)")
            continue
        if differs:
            raise ValueError(
                f"parameter {name} is declared replicated with a whole gradient over the "
                "tensor-parallel group, but its gradient differs between the group's ranks: "
                "it is applied to a sharded activation (this rank's heads or rows); declare "
                "what it is applied to, `heads` for a per-head norm (nn/placement.py)")
