"""Context parallelism (``--cp N``): every sequence split over N ranks, through attention too.

Layout (causal load balance): a sequence of T positions is cut into 2N chunks as even as
possible; rank i of the context-parallel group holds chunks i and 2N-1-i, so under the causal
mask every rank scores the same number of (query, key) pairs to within one chunk's rounding
(``work``). Everything but attention is per token: the model takes this rank's tokens and
positions (``take``), and its loss is this rank's share of the sequence's mean (``loss``), so
averaging gradients over DP x CP gives exactly the one-process gradient.

The rest of this design: docs/context-parallel.md, "hpcdist/parallel/context.py"."""
from __future__ import annotations

import functools
import math

import numpy as np

from ..device import backend
from ..autograd import ops
from ..host import timeline
from ..comm import p2p
from ..comm.arith import bounds_of
from ..autograd.tensor import Tensor
from ..nn.module import Module
from .sequence import cut_embeddings, sequence_of
from .ulysses import ulysses_attention

IMPLS = ("ring", "ulysses")
TAG_KV, TAG_KV_BACK, TAG_DKV = 101, 102, 103


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
    def attention(self, qkv: Tensor, n_head: int) -> Tensor:
        if self.n == 1:
            return ops.fused_attention(qkv, n_head)
        if self.impl == "ring":
            return ring_attention(self, qkv, n_head)
        return ulysses_attention(self, qkv, n_head)

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
    slice of it (in place of ``nn.gpt.SelfAttention``)."""

    def __init__(self, cp: ContextParallel, n_head: int):
        self.cp, self.n_head = cp, n_head

    def forward(self, qkv: Tensor, cache: dict | None = None) -> Tensor:
        if cache is not None:
            raise ValueError("sampling with a KV cache runs without context parallelism")
        return self.cp.attention(qkv, self.n_head)


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
    ``model`` (an ``nn.GPT``, tensor-parallel already or not), in place; returns it."""
    cp = ContextParallel(comm, impl)
    seq = sequence_of(model)
    seq.cp = cp
    cut_embeddings(model, seq)
    for block in model.blocks:
        block.attn.core = ContextParallelAttention(cp, block.attn.core.n_head)
    model.lm_loss = ContextParallelLoss(cp, model.lm_loss)
    return model.train(model.training)


# ---- ring attention ------------------------------------------------------------------------
def _split_qkv(qkv, n_head: int):
    """(B, T, 3C) -> q, k, v each (B, H, T, hs), contiguous, in a float type fit to sum in."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    a = qkv.reshape(B, T, 3, n_head, hs).transpose(2, 0, 3, 1, 4)
    if a.dtype.itemsize < 4:
        a = a.astype(np.float32)
    xp = backend.array_module(qkv)
    return xp.ascontiguousarray(a[0]), xp.ascontiguousarray(a[1]), xp.ascontiguousarray(a[2])


def _as_slice(ix: np.ndarray):
    if len(ix) and ix[-1] - ix[0] + 1 == len(ix):
        return slice(int(ix[0]), int(ix[-1]) + 1)
    return ix if len(ix) else None


def _scores(qs, ks, scale):
    """q k^T * scale, (B, H, Tq, Tk): the one block-sized array the forward makes (in place
    from here on: a block's transient memory is one or two score-sized arrays)."""
    s = qs @ ks.transpose(0, 1, 3, 2)
    s *= scale
    return s


def _mask(edges, dtype, seen: float, unseen: float):
    """(Tq, Tk) of ``dtype``: ``seen`` where a query may look, ``unseen`` where it may not
    (made on the device from the positions, for the block in hand only)."""
    xp = backend.array_module(edges[0])
    return xp.where(edges[0] >= edges[1], seen, unseen).astype(dtype)


def _block_forward(q, k, v, seen, scale, out, lse) -> None:
    """Merge the attention of q over one K/V block into (out, lse), in place (``seen``:
    ``ContextParallel.visible`` of the block)."""
    rows, cols, edges = seen
    if rows is None:
        return
    xp = backend.array_module(q)
    s = _scores(q[:, :, rows], k[:, :, cols], scale)
    if edges is not None:                # -inf where a query may not look
        s += _mask(edges, s.dtype, 0.0, -np.inf)
    m = s.max(axis=-1)
    s -= m[..., None]
    p = xp.exp(s, out=s)
    total = p.sum(axis=-1)
    ob = p @ v[:, :, cols]
    del s, p
    ob /= total[..., None]
    lb = m + xp.log(total)
    la = lse[:, :, rows]
    new = xp.maximum(la, lb)
    new += xp.log(xp.exp(la - new) + xp.exp(lb - new))
    out[:, :, rows] = out[:, :, rows] * xp.exp(la - new)[..., None] + \
        ob * xp.exp(lb - new)[..., None]
    lse[:, :, rows] = new


def _block_backward(q, k, v, seen, scale, dout, lse, D, dq):
    """dq += this block's part (in place); returns (dk, dv) of the block."""
    xp = backend.array_module(q)
    dkv = xp.zeros((2,) + tuple(k.shape), dtype=k.dtype)
    rows, cols, edges = seen
    if rows is None:
        return dkv
    qs, ks, vs, dos = q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]
    p = _scores(qs, ks, scale)
    p -= lse[:, :, rows][..., None]
    xp.exp(p, out=p)                     # the probabilities, from the saved log-sum-exp
    if edges is not None:
        p *= _mask(edges, p.dtype, 1.0, 0.0)
    dkv[1][:, :, cols] = p.transpose(0, 1, 3, 2) @ dos
    ds = dos @ vs.transpose(0, 1, 3, 2)
    ds -= D[:, :, rows][..., None]
    ds *= p
    del p
    ds *= scale
    dq[:, :, rows] += ds @ ks
    dkv[0][:, :, cols] = ds.transpose(0, 1, 3, 2) @ qs
    return dkv


def _kv_block(cp: ContextParallel, kv, r: int):
    """(shape, dtype) of rank r's K|V block: its own number of positions."""
    return kv.shape[:-2] + (len(cp.positions(r)),) + kv.shape[-1:], kv.dtype


def ring_attention(cp: ContextParallel, qkv: Tensor, n_head: int) -> Tensor:
    """Causal attention of this rank's tokens over the whole sequence: (B, T_r, 3C) ->
    (B, T_r, C), K/V travelling round the group (rank i sends to i + 1)."""
    xp = backend.array_module(qkv.data)
    comm, n, i = cp.comm, cp.n, cp.rank
    B, Tl, C3 = qkv.shape
    q, k, v = _split_qkv(qkv.data, n_head)
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = xp.zeros_like(q)
    lse = xp.full(q.shape[:3], -np.inf, dtype=q.dtype)
    kv = xp.stack([k, v])
    block = functools.partial(_kv_block, cp, kv)
    for s in range(n):
        nxt = None
        if s < n - 1:                     # the next block is on its way while this one computes
            nxt = (comm.isend(kv, (i + 1) % n, TAG_KV),
                   comm.irecv((i - 1) % n, TAG_KV, *block((i - s - 1) % n)))
        with timeline.span("cp block", cat="cp", step=s):
            _block_forward(q, kv[0], kv[1], cp.visible((i - s) % n, xp), scale, out,
                           lse)
        if nxt is not None:               # receives first: a send completes once received
            with timeline.span("cp wait", cat="cp", step=s):
                kv = nxt[1].wait()
                nxt[0].wait()
    y = out.transpose(0, 2, 1, 3).reshape(B, Tl, C3 // 3).astype(qkv.dtype)

    def backward(g):
        dout = xp.ascontiguousarray(g.reshape(B, Tl, n_head, -1).transpose(0, 2, 1, 3)
                                    ).astype(q.dtype)
        D = (dout * out).sum(axis=-1)
        dq = xp.zeros_like(q)
        blk = xp.stack([k, v])
        acc = xp.zeros_like(blk)              # the dK/dV of the block in hand, accumulating
        incoming = sent = None
        for s in range(n):                    # rank i holds block i + s; sends go to i - 1
            nxt = None
            if s < n - 1:
                nxt = (comm.isend(blk, (i - 1) % n, TAG_KV_BACK),
                       comm.irecv((i + 1) % n, TAG_KV_BACK, *block((i + s + 1) % n)))
            with timeline.span("cp block", cat="cp", step=s):
                part = _block_backward(q, blk[0], blk[1], cp.visible((i + s) % n, xp),
                                       scale, dout, lse, D, dq)
            if incoming is not None:          # receives first: a send completes once received
                with timeline.span("cp wait", cat="cp", step=s):
                    acc = incoming.wait()
                    sent.wait()
            acc = acc + part
            sent = comm.isend(acc, (i - 1) % n, TAG_DKV)
            incoming = comm.irecv((i + 1) % n, TAG_DKV, *block((i + s + 1) % n))
            if nxt is not None:
                with timeline.span("cp wait", cat="cp", step=s):
                    blk = nxt[1].wait()
                    nxt[0].wait()
        with timeline.span("cp wait", cat="cp", step=n):
            dkv = incoming.wait()             # this rank's own block, from every query
            sent.wait()
        d = xp.stack([dq, dkv[0], dkv[1]])    # (3, B, H, T_r, hs)
        return (d.transpose(1, 3, 0, 2, 4).reshape(B, Tl, C3).astype(qkv.dtype),)
    return Tensor._make(y, (qkv,), backward)


def bytes_per_layer(impl: str, n: int, B: int, T: int, C: int, itemsize: int,
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
    from ..comm import algorithm, select
    lengths = [len(positions(T, n, r)) for r in range(n)]
    fwd = 0
    for width in (3 * C, C):                        # qkv to heads; y back to tokens
        if len(set(lengths)) == 1:                  # equal pieces: "auto" chooses
            each = B * T * width // n               # elements a rank holds
            name = select.choose("alltoall", each * itemsize, n, short=False)
            fwd += n * algorithm.get(name).wire_bytes("alltoall", each, n, itemsize)
        else:                                       # the v-form: pairwise, every piece once
            fwd += (n - 1) * B * T * width // n * itemsize
    return fwd * (2 if backward else 1)
