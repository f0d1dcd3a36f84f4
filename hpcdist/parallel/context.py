"""Context parallelism (``--cp N``): every sequence split over N ranks, through attention too.

Layout (causal load balance): a sequence of T positions is cut into 2N chunks as even as
possible; rank i of the context-parallel group holds chunks i and 2N-1-i, so under the causal
mask every rank scores the same number of (query, key) pairs to within one chunk's rounding
(``work``). Everything but attention is per token: the model takes this rank's tokens and
positions (``take``), and its loss is this rank's share of the sequence's mean (``loss``), so
averaging gradients over DP x CP gives exactly the one-process gradient.

The rest of this design: docs/context-parallel.md, "hpcdist/parallel/context.py"."""
from __future__ import annotations

import math

import numpy as np

from ..device import backend
from ..comm import p2p
from ..comm.arith import bounds_of
from ..autograd.tensor import Tensor
from ..nn.attention import before_core
from ..nn.family import replace, resolve
from ..nn.module import Module
from .sequence import cut_dropout, cut_embeddings, sequence_of
from .ring_attention import ring_attention
from .ulysses import ulysses_attention

IMPLS = ("ring", "ulysses")


def chunk_bounds(T: int, n: int) -> list[tuple[int, int]]:
    """The 2n chunks of T positions, as even as possible (the first ones one longer)."""
    sizes = [len(c) for c in np.array_split(np.arange(T), 2 * n)]
    ends = np.cumsum([0] + sizes)
    return [(int(ends[c]), int(ends[c + 1])) for c in range(2 * n)]


def positions(T: int, n: int, r: int) -> np.ndarray:
    """The global positions rank r of n holds: chunks r and 2n-1-r, in order."""
    b = chunk_bounds(T, n)
    return np.concatenate([np.arange(*b[r]), np.arange(*b[2 * n - 1 - r])])


def work(T: int, n: int) -> list[int]:
    """(query, key) pairs each rank scores under the causal mask (the load balance)."""
    out = []
    for r in range(n):
        p = positions(T, n, r)
        out.append(int((p + 1).sum()))          # position t attends to t + 1 positions
    return out


class ContextParallel:
    """The context-parallel group ``comm`` and how attention crosses it (``impl``)."""

    def __init__(self, comm, impl: str = "ring"):
        if impl not in IMPLS:
            raise ValueError(f"context-parallel impl must be one of {IMPLS}, got {impl!r}")
        self.comm, self.impl = comm, impl
        self.n, self.rank = comm.size, comm.rank
        self.T = None                           # the full sequence length of the batch in hand
        self._pos: dict = {}                    # (T, rank) -> host positions
        self._memo: dict = {}                   # device indices and masks, made once per T

    def __repr__(self):
        return f"ContextParallel(n={self.n}, rank={self.rank}, impl={self.impl})"

    # ---- the token order ---------------------------------------------------------------------
    def begin(self, T: int) -> None:
        """The batch in hand has sequences of T positions (every model entry point says so)."""
        if T < 2 * self.n:
            raise ValueError(f"--cp {self.n} needs sequences of at least {2 * self.n} "
                             f"positions (2 chunks a rank), got {T}")
        self.T = T

    def positions(self, r: int | None = None):
        """Global positions of rank r's tokens (host int64), for the current T."""
        r = self.rank if r is None else r
        key = (self.T, r)
        if key not in self._pos:
            self._pos[key] = positions(self.T, self.n, r)
        return self._pos[key]

    def index(self, xp, r: int | None = None):
        """``positions(r)`` as an index array on ``xp``'s device (made once per T)."""
        r = self.rank if r is None else r
        key = ("index", self.T, r, xp)
        if key not in self._memo:
            self._memo[key] = xp.asarray(self.positions(r))
        return self._memo[key]

    def visible(self, src: int, xp):
        """What this rank's queries see of rank ``src``'s keys under the causal mask, worked
        out once per T in O(T) (every layer and step asks): (the rows and the columns it
        touches — as slices where contiguous, the balanced order's always are — or None
        where nothing is; None where all of that is visible, else the positions of those rows
        and columns on the device, for ``mask``)."""
        key = ("visible", self.T, src, xp)
        if key not in self._memo:
            pq, pk = self.positions(), self.positions(src)
            rows = np.flatnonzero(pq >= pk.min())           # a query that sees some key
            cols = np.flatnonzero(pk <= pq.max())           # a key some query sees
            edges = None
            if len(rows) and pq[rows].min() < pk[cols].max():     # not all of it visible
                edges = (xp.asarray(pq[rows])[:, None], xp.asarray(pk[cols])[None, :])
            self._memo[key] = (_as_slice(rows), _as_slice(cols), edges)
        return self._memo[key]

    def even(self) -> bool:
        """Whether every rank holds as many positions as every other (for the current T)."""
        return len({len(self.positions(r)) for r in range(self.n)}) == 1

    def local_length(self, T: int) -> int:
        self.begin(T)
        return len(self.positions())

    def take(self, idx):
        """This rank's columns of (B, T) tokens, and their positions (on idx's device)."""
        self.begin(idx.shape[1])
        pos = self.index(backend.array_module(idx))
        return idx[:, pos], pos

    # ---- the model's hooks -----------------------------------------------------------------
    def attention(self, qkv: Tensor, shape, p: float = 0.0) -> Tensor:
        """Attention of this rank's rows of qkv over ``shape``'s heads (an AttentionShape);
        ``p``: dropout on the probabilities, drawn as one process draws it."""
        if self.impl == "ring":
            return ring_attention(self, qkv, shape, p)
        return ulysses_attention(self, qkv, shape, p)

    def attention_draw(self, B: int, H: int, p: float):
        """The one-process dropout draw over the probabilities (B, H, T, T) of the layer in
        hand: (its counter, its shape), the stream advanced past it; None without dropout."""
        if not p:
            return None
        return backend.rng().advance(B * H * self.T * self.T), (B, H, self.T, self.T)

    def loss(self, local_mean: Tensor, targets, ignore_index: int) -> Tensor:
        """This rank's share of the sequence-mean loss, times N: the group's average is the
        one-process mean (the scored positions counted on the whole targets, no message)."""
        every = max(int((targets != ignore_index).sum()), 1)
        mine = max(int((self.local_targets(targets) != ignore_index).sum()), 1)
        return local_mean * (mine * self.n / every)

    def local_targets(self, targets):
        return targets[:, self.index(backend.array_module(targets))]

    def finish(self, logits: Tensor, local_mean, targets, ignore_index: int, training: bool):
        """The model's (logits, loss), or logits: in training this rank's logits and its share
        of the loss (``loss``); in evaluation the whole sequence's logits in position order on
        every rank and the sequence-mean loss (collective over the group)."""
        if training:
            return logits if targets is None else \
                (logits, self.loss(local_mean, targets, ignore_index))
        xp = backend.array_module(logits.data)
        B, rest = logits.shape[0], tuple(logits.shape[2:])
        counts = [B * len(self.positions(r)) * math.prod(rest) for r in range(self.n)]
        flat = self.comm.allgather(xp.ascontiguousarray(logits.data).reshape(-1), counts=counts)
        full = xp.empty((B, self.T) + rest, dtype=logits.dtype)
        for r, (lo, hi) in enumerate(bounds_of(counts)):
            full[:, self.index(xp, r)] = flat[lo:hi].reshape((B, -1) + rest)
        if targets is None:
            return Tensor(full)
        share = float(self.loss(local_mean, targets, ignore_index).data) / self.n
        total = self.comm.allreduce(np.array([share]))
        return Tensor(full), Tensor(xp.asarray(total[0]))


# ---- the modules swapped into the model ------------------------------------------------------
class ContextParallelAttention(Module):
    """The attention between the projections, over the whole sequence when this rank holds a
    slice of it (in place of ``nn.attention.SelfAttention``: its heads, dropout and rotary
    embeddings, q and k rotated at the rows' global positions; its per-head norms, under
    the same names)."""

    def __init__(self, cp: ContextParallel, core):
        scores = getattr(core, "scores", None)
        if scores is not None and scores != type(scores)():
            raise ValueError(f"context parallelism with {scores}: ring attention and Ulysses "
                             "carry no scale of a family's own, cap, window or sinks yet "
                             "(run without --cp)")
        self.cp, self.shape, self.rotary = cp, core.shape, core.rotary
        self.q_norm, self.k_norm = core.q_norm, core.k_norm
        self.p = core.attn_drop.p                        # dropout on the probabilities

    def forward(self, qkv: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        if cache is not None:
            raise ValueError("sampling with a KV cache runs without context parallelism")
        qkv = before_core(self, qkv, pos)
        return self.cp.attention(qkv, self.shape, self.p if self.training else 0.0)


class ContextParallelLoss(Module):
    """The model's loss on this rank's positions (``inner``: the loss it wraps), finished by
    ``ContextParallel.finish``: this rank's share in training, the whole sequence's in
    evaluation."""

    def __init__(self, cp: ContextParallel, inner):
        self.cp, self.inner = cp, inner

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        if targets is None:
            return self.cp.finish(self.inner(logits), None, None, ignore_index, self.training)
        logits, loss = self.inner(logits, self.cp.local_targets(targets), ignore_index)
        return self.cp.finish(logits, loss, targets, ignore_index, self.training)


def apply_context_parallel(model, comm, impl: str = "ring"):
    """Give each rank of the context-parallel group ``comm`` a slice of every sequence of
    ``model`` (a family's DecoderLM, tensor-parallel already or not), in place; returns it."""
    cp = ContextParallel(comm, impl)
    seq = sequence_of(model)
    seq.cp = cp
    cut_embeddings(model, seq)
    cut_dropout(model, seq)                     # masks drawn at the rows' global positions
    for block in model.blocks:
        replace(block, block.attention,
                ContextParallelAttention(cp, resolve(block, block.attention)[2]))
    model.set_part("loss", ContextParallelLoss(cp, model.part("loss")))
    return model.train(model.training)


def _as_slice(ix: np.ndarray):
    if len(ix) and ix[-1] - ix[0] + 1 == len(ix):
        return slice(int(ix[0]), int(ix[-1]) + 1)
    return ix if len(ix) else None


def bytes_per_layer(impl: str, n: int, B: int, T: int, C: int, itemsize: int, *,
                    backward: bool = True) -> int:
    """Bytes the context-parallel group sends for one layer's attention on B sequences of T
    positions, summed over its ranks (C: the width of this rank's heads). Ring: the payload
    and each point-to-point message's header (p2p.HEADER_LEN int64s); Ulysses: four
    all-to-alls (qkv and y, each way), each sending what its algorithm's record says."""
    if n == 1:
        return 0
    if impl == "ring":
        fwd, fwd_msgs = 2 * (n - 1) * B * T * C, n * (n - 1)
        bwd, bwd_msgs = 2 * (n - 1) * B * T * C + 2 * n * B * T * C, n * (n - 1) + n * n
        header = p2p.HEADER_LEN * 8
        total = fwd * itemsize + fwd_msgs * header
        return total + (bwd * itemsize + bwd_msgs * header if backward else 0)
    from ..comm import registry, select
    lengths = [len(positions(T, n, r)) for r in range(n)]
    fwd = 0
    for width in (3 * C, C):                        # qkv to heads; y back to tokens
        if len(set(lengths)) == 1:                  # equal pieces: "auto" chooses
            each = B * T * width // n               # elements a rank holds
            name = select.choose("alltoall", each * itemsize, n, short=False)
            fwd += n * registry.get(name).wire_bytes("alltoall", each, n, itemsize)
        else:                                       # the v-form: pairwise, every piece once
            fwd += (n - 1) * B * T * width // n * itemsize
    return fwd * (2 if backward else 1)
