"""ZeRO-3: the parameters sharded too, gathered block by block (zero.py has what the
stages share)."""
from __future__ import annotations

import contextlib

from ..device import backend
from ..optim import intersect
from ..autograd.recompute import recomputing
from .buckets import Bucket
from .shards import identity_hook
from .zero import Zero, Zero1, Zero2
from .capabilities import Zero3Shape


class Zero3(Zero, Zero3Shape):
    """Parameters sharded too. A transformer block's parameters are gathered just before its
    forward and freed right after (a hook on the block's call); the next block's gather starts
    early, in the progress thread. In backward, an identity node at the block's output
    gathers them again (and starts the gather of the block before it); an identity node at
    its input — whose backward runs only after every node of the block — reduce-scatters the
    block's gradients and frees its parameters. Parameters outside the blocks (embeddings,
    final norm) stay gathered for the whole step."""

    level = 3

    def _place(self, full, bucket_mb: float, first_bucket_mb: float) -> None:
        self.compute = None
        self.master = full[self.lo:self.hi].copy()
        self.compute_shard = self.master.astype(self.compute_dtype) if self.mixed \
            else self.master
        self.grad_shard = backend.array_module(full).zeros(self.hi - self.lo,
                                                           dtype=self.compute_dtype)
        self.groups = self._units()
        for p in self.params:
            p.grad = None
            self._free(p)
        blocks = list(self.model.blocks)
        for i, block in enumerate(blocks):
            block.wrap_call(self._around(self.groups[i], self.groups[i - 1] if i else None,
                                         self.groups[i + 1] if i + 1 < len(blocks) else None))

    # ---- gather units -----------------------------------------------------------------------
    def _units(self) -> list:
        """A group per block, and one for the parameters outside the blocks (persistent)."""
        blocks = getattr(self.model, "blocks", None)
        if blocks is None:
            raise ValueError("ZeRO-3 gathers parameters block by block: the model needs "
                             "a `blocks` list (nn.GPT has one)")
        where = {id(p): i for i, p in enumerate(self.params)}
        groups, in_blocks = [], set()
        for block in blocks:
            idx = sorted(where[id(p)] for p in block.parameters())
            groups.append(self._group(len(groups), idx))
            in_blocks.update(idx)
        rest = [i for i in range(len(self.params)) if i not in in_blocks]
        self.persistent = self._group(len(groups), rest)
        return groups + [self.persistent]

    def _group(self, index, idx) -> Bucket:
        ranges = []
        for i in idx:                           # merge neighbouring parameters into ranges
            a, b = self.offsets[i], self.offsets[i] + self.params[i].size
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        return Bucket(index, ranges, [self.params[i] for i in idx])

    def _prefetch(self, group) -> None:
        """Start gathering the group's full ranges (non-blocking allgathers of the pieces
        every rank holds)."""
        if group is not None and group.buffers is None and group.handle is None:
            handles = []
            for a, b in group.ranges:
                s, e = intersect(a, b, self.lo, self.hi)
                mine = self.compute_shard[max(s - self.lo, 0):max(e - self.lo, 0)]
                handles.append(self.comm.iallgather(mine, counts=self._counts(a, b)))
            group.handle = handles

    def _materialize(self, group) -> None:
        """Make the group's parameters usable (wait for a prefetch, or gather now)."""
        if group.buffers is None:
            self._prefetch(group)
            group.buffers = [h.wait() for h in group.handle]
            group.handle = None
        for p in group.params:
            o = self._offset[id(p)]
            for (a, b), buf in zip(group.ranges, group.buffers):
                if a <= o < b:
                    p.data = buf[o - a:o - a + p.size].reshape(self._shape[id(p)])
        self._track()

    def _free(self, p) -> None:
        """A freed parameter keeps its shape and dtype but no memory: a read-only,
        zero-stride view of one element (writing to it fails loudly)."""
        xp = backend.array_module(self.compute_shard)
        p.data = xp.broadcast_to(xp.zeros((), dtype=self.compute_dtype), self._shape[id(p)])

    def _release(self, group) -> None:
        group.buffers = None
        for p in group.params:
            self._free(p)

    def _around(self, group, prev, nxt):
        """The block's call: gather, prefetch the next, run, free; the backward hooks. A
        block recomputed in backward (activation checkpointing) prefetches the block before
        it instead and stays gathered until its backward is done: two gathers per block per
        micro-batch, with or without recomputation."""
        def call(forward, x, *rest, **kwargs):     # (rest: the rows' positions, a cache)
            again = recomputing()
            self._materialize(group)
            self._prefetch(prev if again else nxt)   # overlaps this block's compute
            x_in = identity_hook(x, lambda: self._after_block_backward(group))
            out = forward(x_in, *rest, **kwargs)
            if not again:
                self._release(group)
            return identity_hook(out, lambda: self._before_block_backward(group, prev))
        return call

    def _before_block_backward(self, group, prev) -> None:
        self._materialize(group)
        self._prefetch(prev)

    def _after_block_backward(self, group) -> None:
        self._launch(group)                               # its gradients are all final
        self._release(group)

    # ---- gradients --------------------------------------------------------------------------
    def _launch(self, group) -> None:
        if not group.launched:
            group.reducing = self._reduce_scatter(group.ranges, group.params)
            group.launched = True

    def _reduce(self) -> None:
        """Send the persistent group's gradients, wait for every reduce-scatter, add the
        parts into the gradient shard, reset the groups."""
        self._launch(self.persistent)
        for g in self.groups:
            if g.launched:
                self._add_parts(g.reducing)
                g.reducing = None
            g.pending, g.launched = len(g.params), False
        self._track()

    _between_micro_batches = _reduce

    # ---- the step ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.grad_shard[...] = 0
        self._materialize(self.persistent)                # embeddings etc. for this step

    @contextlib.contextmanager
    def eval_context(self):
        """Parameters outside the blocks gathered for a forward outside a step."""
        gathered = self.persistent.buffers is None
        if gathered:
            self._materialize(self.persistent)
        try:
            yield
        finally:
            if gathered:
                self._release(self.persistent)

    def _rebuild_parameters(self, stepped: bool = False) -> None:
        if self.mixed and not (stepped and self.opt.copy_into is not None):
            self.compute_shard[...] = self.master.astype(self.compute_dtype)

    def _compute_shard(self):
        return self.compute_shard

    def _end_step(self) -> None:
        self._track()
        self._release(self.persistent)

    def _held(self) -> tuple:
        params = self.compute_shard.nbytes + sum(
            buf.nbytes for g in self.groups if g.buffers for buf in g.buffers)
        return params, self.grad_shard.nbytes + sum(p.grad.nbytes for p in self.params
                                                    if p.grad is not None)


LEVELS = {1: Zero1, 2: Zero2, 3: Zero3}
