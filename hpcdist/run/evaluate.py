"""Held-out evaluation: exact-match accuracy on the digit tasks, next-character on text."""
from __future__ import annotations

import numpy as np

from ..device import backend
from ..nn.moe import moe_layers
from .. import data
from ..autograd.tensor import no_grad


MAX_EXAMPLES = 4096              # windows (text) or examples (digit tasks) at most
EVAL_BATCH_TOKENS = 16384        # an evaluation forward's tokens, beyond the training batch


def bounds(cfg, block_size: int, replicas: int = 1) -> tuple:
    """(sequences per evaluation forward, windows at most) for a run's held-out set: at most
    ``--eval-tokens`` tokens scored (at T 8192 32 windows, not 4,096) and no more windows
    than an eighth of the sequences the run trains on, over its ``replicas`` (so any layout
    of one global batch scores the same windows; ``--eval-tokens 0``: 4,096 windows, whatever
    the run); a forward no larger than the training batch or 16,384 tokens (at long context
    the logits of 512 sequences would not fit)."""
    T = max(1, block_size)
    trained = cfg.steps * cfg.batch_size * cfg.grad_accum * replicas
    windows = MAX_EXAMPLES if not cfg.eval_tokens else \
        max(1, min(MAX_EXAMPLES, cfg.eval_tokens // T, trained // 8))
    return max(1, min(cfg.eval_batch, max(cfg.batch_size, EVAL_BATCH_TOKENS // T))), windows


def evaluate_run(cfg, model, dataset, comm=None):
    """``evaluate`` within the run's bounds (``bounds``): (accuracy, loss, tokens scored)."""
    batch, windows = bounds(cfg, dataset.block_size, comm.size if comm is not None else 1)
    return evaluate(model, dataset, batch, comm, windows)


def evaluate(model, dataset, batch: int, comm=None, max_examples: int = MAX_EXAMPLES):
    """Held-out (accuracy, loss, tokens scored), the examples split over the ranks and the
    counts summed.

    ``comm``: the ranks that split the examples — the data-parallel group (the ranks of one
    tensor-parallel group evaluate the same examples together). The loss is per scored token
    (instruction data scores the answers only: a short answer weighs its tokens, not more).
    Digit tasks: exact match — every scored position's argmax equals its target. With teacher
    forcing this equals greedy decoding getting the whole answer right. Text: next-character
    accuracy over up to ``max_examples`` evenly spaced windows.
    """
    xp = backend.xp()
    if any(m.exchange is not None for m in moe_layers(model)):
        comm = None     # expert parallelism: every rank runs every batch, in step (its
                        # experts serve the others' tokens)
    n = len(dataset)
    every = np.arange(n) if n <= max_examples else \
        np.linspace(0, n - 1, max_examples).astype(int)
    idx = every if comm is None else every[comm.rank::comm.size]
    # every rank of comm runs as many forwards as the fullest (ZeRO-3 gathers and other
    # collectives inside the model pair up call by call): past its own, a throwaway one
    most = len(every) if comm is None else -(-len(every) // comm.size)
    exact = isinstance(dataset, data.DigitTask)
    correct = total = scored_tokens = 0
    loss_sum = 0.0
    was_training = model.training
    model.eval()
    with no_grad():
        for s in range(0, most, batch):
            if s >= len(idx):
                x, y = dataset.batch(every[:1])
                model(xp.asarray(x), xp.asarray(y))
                continue
            x, y = dataset.batch(idx[s:s + batch])
            logits, loss = model(xp.asarray(x), xp.asarray(y))
            pred = backend.to_numpy(logits.data.argmax(axis=-1))
            scored = y != data.IGNORE
            scored_tokens += int(scored.sum())
            hit = (pred == y) | ~scored
            if exact:
                correct += int(hit.all(axis=1).sum())
                total += len(y)
            else:
                correct += int((hit & scored).sum())
                total += int(scored.sum())
            loss_sum += float(loss.data) * int(scored.sum())   # (the batch's mean: its sum)
    model.train(was_training)
    sums = np.array([correct, total, loss_sum, scored_tokens], dtype=np.float64)
    if comm is not None:
        sums = comm.allreduce(sums)
    # the loss per scored token of every example, however they were split into batches
    return sums[0] / max(sums[1], 1), sums[2] / max(sums[3], 1), int(sums[3])
