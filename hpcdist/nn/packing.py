"""Packed rows: several documents in one row, each attending only to itself, from position 0.

A packed batch is its token ids (B, T) with each position's document start in the bits above
32 (``encode``): every slice of the batch (micro-batches, stages, shards) keeps its layout,
and a plain row is a packed row of one document from 0. A model with ``packed = True`` reads
a batch through ``Packing``: the tokens, each position's place in its document (a learned
table's positions) and the attention: ``Packing.attend`` gathers the documents' rows into
batches of documents of about one length (rounded up to ``STEP``, padded after their ends),
runs the attention core on them as on whole rows (rotary from 0 in each; no row sees the
padding after it) and puts each row back. No attention FLOP is spent across documents, the
kernels run as they are on every device, under TP and PP. docs/fine-tuning.md has the rest.
"""
from __future__ import annotations

import numpy as np

from ..autograd import ops
from ..autograd.tensor import Tensor
from ..device import backend

SHIFT = 32                 # token ids below 2**32; a document start above
STEP = 16                  # documents are batched at lengths rounded up to this


def encode(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Token ids (B, T) with each position's document start (B, T) in the high bits."""
    return np.asarray(tokens, dtype=np.int64) | (np.asarray(starts, dtype=np.int64) << SHIFT)


def tokens_of(idx):
    """The token ids of a (possibly packed) batch."""
    return idx & ((1 << SHIFT) - 1)


class Packing:
    """A packed batch's layout (see the module doc), made on the host from its ids."""

    def __init__(self, idx):
        starts = backend.to_numpy(idx) >> SHIFT                 # (B, T)
        B, T = starts.shape
        self.shape = (B, T)
        t = np.arange(T)
        self.positions = t[None, :] - starts                      # place in its document
        if (self.positions < 0).any():
            raise ValueError("a packed batch's document start lies after its position")
        first = np.ones((B, T), dtype=bool)
        first[:, 1:] = starts[:, 1:] != starts[:, :-1]
        flat_first = np.flatnonzero(first.reshape(-1))            # each document's first row
        lengths = np.diff(np.append(flat_first, B * T))
        self.documents = len(lengths)
        # documents by the length they are batched at: (L, (n, L) flat rows, pad: B * T)
        self.groups = []
        inverse = np.empty(B * T, dtype=np.int64)
        at = 0
        rounded = np.minimum(-(-lengths // STEP) * STEP, max(T, 1))
        for L in np.unique(rounded):
            which = np.flatnonzero(rounded == L)
            rows = np.full((which.size, int(L)), B * T, dtype=np.int64)
            span = np.arange(int(L))
            real = span[None, :] < lengths[which, None]
            rows[real] = (flat_first[which, None] + span[None, :])[real]
            inverse[rows[real]] = at + np.flatnonzero(real.reshape(-1))
            at += rows.size
            self.groups.append((int(L), rows))
        self.inverse = inverse
        self.flops_share = float(sum(L * L * r.shape[0] for L, r in self.groups)) / \
            max(B * T * T, 1)

    def attend(self, qkv: Tensor, core) -> Tensor:
        """The attention of every document of qkv (B, T, W) alone (module doc): ``core(part,
        positions)`` on parts (n, L, W) -> (n, L, out)."""
        xp = backend.array_module(qkv.data)
        B, T, W = qkv.shape
        flat = ops.concat([qkv.reshape(B * T, W), Tensor(xp.zeros((1, W), qkv.dtype))])
        outs = []
        for L, rows in self.groups:
            part = flat[xp.asarray(rows.reshape(-1))].reshape(rows.shape[0], L, W)
            y = core(part, xp.arange(L))
            outs.append(y.reshape(rows.shape[0] * L, y.shape[-1]))
        every = outs[0] if len(outs) == 1 else ops.concat(outs)
        return every[xp.asarray(self.inverse)].reshape(B, T, every.shape[-1])

    def device_positions(self):
        return backend.xp().asarray(self.positions)
