"""How one model's sequences are cut, shared by the parallel modules swapped into it.

Context parallelism gives each rank of its group a slice of every sequence's positions
(parallel/context.py); sequence parallelism then splits those rows over the tensor-parallel
group between its regions (parallel/tp). The modules that cut need the length of the batch in
hand: the model's first module says it (``Cut`` around the embeddings calls ``begin``), and so
does a pipeline stage that starts mid-model (parallel/pipeline.py, from its micro-batch).
"""
from __future__ import annotations

import numpy as np

from ..device import backend
from ..autograd import ops
from ..nn.layers import Dropout
from ..nn.module import Module
from ..comm.arith import shard_bounds as sequence_bounds   # as tp.mappings cuts rows


class Sequence:
    """``cp``: the ContextParallel group, or None; ``sp``: the tensor-parallel communicator
    under sequence parallelism, or None; ``T``: the length of the sequences in hand."""

    def __init__(self):
        self.cp, self.sp, self.T = None, None, None

    def begin(self, T: int) -> None:
        self.T = T
        if self.cp is not None:
            self.cp.begin(T)

    @property
    def rows(self) -> int:
        """Positions this rank's tensor-parallel group holds (all T, or its CP slice)."""
        return self.T if self.cp is None else len(self.cp.positions())

    def tokens(self, idx):
        """This rank's columns of (B, T) tokens (its context-parallel slice)."""
        return idx if self.cp is None else idx[:, self.cp.index(backend.array_module(idx))]

    def context_rows(self, pos):
        """This rank's context-parallel slice of positions ``pos`` (all rows of its tensor-
        parallel group: what attention sees; rotary embeddings rotate by them)."""
        return pos if self.cp is None else pos[self.cp.index(backend.array_module(pos))]

    def positions(self, pos):
        """This rank's positions of ``pos``: its context-parallel slice, then its
        sequence-parallel rows of that."""
        if self.cp is not None:
            pos = pos[self.cp.index(backend.array_module(pos))]
        if self.sp is not None:
            lo, hi = sequence_bounds(len(pos), self.sp.size, self.sp.rank)
            pos = pos[lo:hi]
        return pos


class Cut(Module):
    """``module`` (an embedding) on this rank's part of its input: ``part`` "tokens" (B, T)
    or "positions" (T,). Its parameters keep their names (they are this module's own
    attributes; ``module`` is held, not a child)."""

    def __init__(self, module, seq: Sequence, part: str):
        self._inner = (module,)
        for name, value in module._children():
            setattr(self, name, value)
        self.shard_spec, self.placements = module.shard_spec, module.placements
        self.seq, self.part = seq, part

    def forward(self, x):
        self.seq.begin(x.shape[-1])
        return self._inner[0](self.seq.tokens(x) if self.part == "tokens"
                              else self.seq.positions(x))

    def attend(self, x):
        return self._inner[0].attend(x)

    def train(self, mode: bool = True):
        self._inner[0].train(mode)
        return super().train(mode)


def sequence_of(model) -> Sequence:
    """The Sequence the model's cut modules share (a new one, the model's from now on, where
    nothing is cut yet)."""
    if model.seq is None:
        model.seq = Sequence()
    return model.seq


def cut_embeddings(model, seq: Sequence) -> None:
    """Put the position table (learned positions; rotary ones are cut through
    ``DecoderLM.positions``) and, under context parallelism, the token table behind ``Cut``
    once: every cut since reads ``seq``."""
    table = model.part("positions")
    if table is not None and not isinstance(table, Cut):
        model.set_part("positions", Cut(table, seq, "positions"))
    tokens = model.part("tokens")
    if seq.cp is not None and not isinstance(tokens, Cut):
        model.set_part("tokens", Cut(tokens, seq, "tokens"))


class SequenceDropout(Module):
    """Dropout on activations of this rank's rows (B, rows, C) of the sequence: each element
    kept or dropped as in the one-process draw over all (B, T, C), at its global position,
    and the stream advanced past the whole draw (so context parallelism equals one process
    with dropout, and the ranks' streams stay in step)."""

    def __init__(self, p: float, seq: Sequence):
        self.p, self.seq = p, seq

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        rows = self.seq.positions(np.arange(self.seq.T))
        B, mine, C = x.shape
        if mine != len(rows):
            raise ValueError(f"sequence dropout: {mine} rows in hand, this rank holds "
                             f"{len(rows)} of {self.seq.T}")
        rng = backend.rng()
        keep = rng.keep_mask_at((B, self.seq.T, C), {1: rows}, self.p,
                                backend.array_module(x.data))
        rng.advance(B * self.seq.T * C)
        return ops.dropout(x, self.p, True, keep)


def cut_dropout(model, seq: Sequence) -> None:
    """The activations' Dropout modules (after the embeddings, each block's attention
    projection and MLP) drawn at the rows' global positions: ``SequenceDropout``."""
    owners = [(model, model.PARTS["drop"])] + [o for b in model.blocks for o in b.dropouts()]
    for owner, name in owners:
        drop = getattr(owner, name, None)
        if type(drop) is Dropout:
            setattr(owner, name, SequenceDropout(drop.p, seq))
