"""Held-out evaluation: exact-match accuracy on the digit tasks, next-character on text."""
from __future__ import annotations

import numpy as np

from ..device import backend
from ..nn.moe import moe_layers
from .. import data
from ..autograd.tensor import no_grad


def evaluate(model, dataset, batch: int, comm=None, max_examples: int = 4096):
    """Held-out (accuracy, loss), the examples split over the ranks and the counts summed.

    ``comm``: the ranks that split the examples — the data-parallel group (the ranks of one
    tensor-parallel group evaluate the same examples together).
    Digit tasks: exact match — every scored position's argmax equals its target. With teacher
    forcing this equals greedy decoding getting the whole answer right. Text: next-character
    accuracy over up to ``max_examples`` evenly spaced windows.
    """
    xp = backend.xp()
    if any(m.exchange is not None for m in moe_layers(model)):
        comm = None     # expert parallelism: every rank runs every batch, in step (its
                        # experts serve the others' tokens)
    n = len(dataset)
    idx = np.arange(n) if n <= max_examples else np.linspace(0, n - 1, max_examples).astype(int)
    if comm is not None:
        idx = idx[comm.rank::comm.size]
    exact = isinstance(dataset, data.DigitTask)
    correct = total = 0
    loss_sum = 0.0
    was_training = model.training
    model.eval()
    with no_grad():
        for s in range(0, len(idx), batch):
            x, y = dataset.batch(idx[s:s + batch])
            logits, loss = model(xp.asarray(x), xp.asarray(y))
            pred = backend.to_numpy(logits.data.argmax(axis=-1))
            scored = y != data.IGNORE
            hit = (pred == y) | ~scored
            if exact:
                correct += int(hit.all(axis=1).sum())
                total += len(y)
            else:
                correct += int((hit & scored).sum())
                total += int(scored.sum())
            loss_sum += float(loss.data) * len(y)
    model.train(was_training)
    sums = np.array([correct, total, loss_sum, len(idx)], dtype=np.float64)
    if comm is not None:
        sums = comm.allreduce(sums)
    return sums[0] / max(sums[1], 1), sums[2] / max(sums[3], 1)
