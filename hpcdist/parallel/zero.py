"""ZeRO stages 1-3 (Rajbhandari et al., 2020) over the flat parameter layout.

The parameters are laid out as one flat vector of L elements (model order) and split over the
P ranks by the shard layout (comm/layout.py): rank r owns [lo, hi). Every stage keeps only
this rank's shard of the optimizer state — fp32 master weights and the Adam moments — and
runs the same update rule (optim.py) on it.

- Stage 1: full compute parameters and a full gradient buffer; after backward the gradient is
  reduce-scattered (each rank gets its shard, averaged), the shard is updated, and an
  allgather rebuilds the full compute parameters.
- Stage 2: no full gradient buffer. As soon as a bucket's gradients are final (gradient
  hooks), they are packed and reduce-scattered onto the global shards — each rank receives
  the part of the bucket that falls in its shard — and the parameters' gradients are dropped.
- Stage 3: parameters are sharded too. A transformer block's parameters are gathered just
  before its forward and freed right after; the next block's gather is started early in the
  progress thread. In backward, an identity node at the block's output gathers them again
  (and starts the gather of the block before it); an identity node at the block's input —
  whose backward runs only after every node of the block — reduce-scatters the block's
  gradients and frees its parameters. Parameters outside the blocks (embeddings, final norm)
  stay gathered for the whole step.

Per step and rank: stages 1-2 send (P-1)/P x 2 Psi elements (reduce-scatter + allgather), as
DDP does; stage 3 (P-1)/P x 3 Psi (two gathers and a reduce-scatter)."""
from __future__ import annotations

import contextlib

import numpy as np

from .. import backend
from ..comm.layout import bounds_of, padded_length, shard_bounds, shard_counts
from ..optim import FlatParams, decay_ranges_in
from .base import Norm, Strategy
from .ddp import plan_buckets
from .mixed_precision import LossScaler
from .shards import Group, ShardParams, identity_hook, pieces_of_range


class Zero(Strategy):
    """ZeRO stage 1, 2 or 3 for ``model`` over ``comm``: the optimizer and the gradient sync.

    Args:
        model: the model (a GPT for stage 3: its ``blocks`` are the gather units).
        comm: a Communicator.
        stage: 1, 2 or 3.
        make_optimizer: callable(FlatParams-like) -> optim.Optimizer for the shard.
        compute_dtype: dtype of parameters and gradients in forward/backward (fp16/bf16 for
            mixed precision); the master shard keeps the model's initial dtype.
        scaler: a mixed_precision.LossScaler (disabled for fp32).
        bucket_mb, first_bucket_mb: stage 2 bucket caps.
    """

    def __init__(self, model, comm, stage: int, make_optimizer, compute_dtype=None,
                 scaler=None, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 norm=None, grad_sum=None, mesh=None):
        """``norm`` (base.Norm): how the global gradient norm is summed (default: over
        ``comm``); ``grad_sum``: gradients summed over another group after the average
        (sequence parallelism); ``mesh``: the process mesh of a model-parallel layout."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.model, self.comm, self.stage, self.mesh = model, comm, stage, mesh
        self.norm, self.grad_sum = norm or Norm([comm]), grad_sum
        self.data_comm = comm
        self.scaler = scaler or LossScaler(enabled=False)
        self.params = params = model.parameters()
        xp = backend.array_module(params[0].data)
        master_dtype = params[0].data.dtype
        self.compute_dtype = np.dtype(compute_dtype) if compute_dtype is not None else master_dtype
        spans = bounds_of(p.size for p in params)       # each parameter's flat [lo, hi)
        self.offsets = [lo for lo, _ in spans]
        self._offset = {id(p): o for p, o in zip(params, self.offsets)}
        self._shape = {id(p): p.shape for p in params}
        self.L, P, r = (spans[-1][1] if spans else 0), comm.size, comm.rank
        self.lo, self.hi = shard_bounds(self.L, P, r)
        self.padding = padded_length(self.L, P) - self.L

        full = xp.empty(self.L, dtype=master_dtype)           # rank 0's weights everywhere
        for p, o in zip(params, self.offsets):
            full[o:o + p.size] = p.data.reshape(-1)
        comm.bcast(full, root=0)
        decay = [span for p, span in zip(params, spans) if p.ndim >= 2]
        # Without mixed precision the master shard *is* this rank's part of the parameters
        # (a view), so nothing is stored twice; with it, a separate fp32 copy.
        self.mixed = self.compute_dtype != master_dtype
        self._peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}

        self._place(full, bucket_mb, first_bucket_mb)
        if stage >= 2:
            self.grad_shard = xp.zeros(self.hi - self.lo, dtype=self.compute_dtype)
        self.opt = make_optimizer(ShardParams(self.master, None,
                                              decay_ranges_in(decay, self.lo, self.hi)))
        del full
        if stage >= 2:
            self._group_of = {id(p): g for g in self.groups for p in g.params}
            for p in params:
                p.register_grad_hook(self._grad_ready)


    def _place(self, full, bucket_mb: float, first_bucket_mb: float) -> None:
        """Where the stage keeps parameters and gradients: full compute parameters and this
        rank's master shard (stages 1-2; stage 2 with its gradient buckets), or only the
        shards, the parameters gathered per block when used (stage 3)."""
        params, stage = self.params, self.stage
        if stage < 3:
            for p, o in zip(params, self.offsets):
                p.data = full[o:o + p.size].reshape(p.shape).astype(self.compute_dtype)
            self.compute = FlatParams(params)                   # full compute parameters
            self.master = full[self.lo:self.hi].copy() if self.mixed else \
                self.compute.data[self.lo:self.hi]
            if stage == 1:
                # reduce-scattered in place: the shard is a view of the full gradient
                self.grad_shard = self.compute.grad[self.lo:self.hi]
            else:
                self.compute.grad = None
                for p in params:
                    p.grad = None
                self.groups = [Group(i, [(lo, hi)], [params[j] for j in members])
                               for i, (lo, hi, members) in enumerate(
                                   plan_buckets([p.size for p in params],
                                                self.compute_dtype.itemsize, bucket_mb,
                                                first_bucket_mb))]
        else:
            self.compute = None
            self.master = full[self.lo:self.hi].copy()
            self.compute_shard = self.master.astype(self.compute_dtype) if self.mixed \
                else self.master
            self.groups = self._stage3_groups()
            for p in params:
                p.grad = None
                self._free(p)
            self._wrap_blocks()

    # ---- stage 3: gather units --------------------------------------------------------------
    def _stage3_groups(self):
        blocks = getattr(self.model, "blocks", None)
        if blocks is None:
            raise ValueError("ZeRO stage 3 gathers parameters block by block: the model needs "
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

    def _group(self, index, idx):
        ranges = []
        for i in idx:                           # merge neighbouring parameters into ranges
            a, b = self.offsets[i], self.offsets[i] + self.params[i].size
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)
            else:
                ranges.append((a, b))
        return Group(index, ranges, [self.params[i] for i in idx])

    def _counts(self, a: int, b: int) -> list:
        """How many elements of the flat range [a, b) each rank's shard holds."""
        return [e - s for s, e in pieces_of_range(a, b, self.comm.size, self.L)]

    def _prefetch(self, group) -> None:
        """Start gathering the group's full ranges (non-blocking allgathers of the pieces
        every rank holds)."""
        if group is not None and group.buffers is None and group.handle is None:
            handles = []
            for a, b in group.ranges:
                s, e = max(a, self.lo), min(b, self.hi)
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

    def _wrap_blocks(self):
        blocks = list(self.model.blocks)
        for i, block in enumerate(blocks):
            group = self.groups[i]
            prev = self.groups[i - 1] if i > 0 else None
            nxt = self.groups[i + 1] if i + 1 < len(blocks) else None
            inner = block.forward

            def forward(x, inner=inner, group=group, prev=prev, nxt=nxt):
                self._materialize(group)
                self._prefetch(nxt)                       # overlaps this block's compute
                x_in = identity_hook(x, lambda: self._after_block_backward(group))
                out = inner(x_in)
                self._release(group)
                return identity_hook(out, lambda: self._before_block_backward(group, prev))
            block.forward = forward

    def _before_block_backward(self, group, prev) -> None:
        self._materialize(group)
        self._prefetch(prev)

    def _after_block_backward(self, group) -> None:
        self._launch(group)                               # its gradients are all final
        self._release(group)

    # ---- gradients --------------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        group = self._group_of[id(p)]
        group.pending -= 1
        if self.stage == 2 and group.pending == 0:
            self._launch(group)

    def _launch(self, group) -> None:
        """Pack the group's gradients, drop them, and reduce-scatter onto the shards."""
        if group.launched:
            return
        xp = backend.array_module(self.grad_shard)
        packed = []
        for a, b in group.ranges:
            buf = xp.zeros(b - a, dtype=self.compute_dtype)
            for p in group.params:
                o = self._offset[id(p)]
                if a <= o < b and p.grad is not None:
                    buf[o - a:o - a + p.size] = p.grad.reshape(-1)
            packed.append(buf)
        self._track()
        for p in group.params:
            p.grad = None
        group.handle = []
        for (a, b), buf in zip(group.ranges, packed):   # this rank's part of each, averaged
            s, e = max(a, self.lo), min(b, self.hi)
            group.handle.append((s, e, self.comm.ireduce_scatter(buf, "avg",
                                                                 counts=self._counts(a, b))))
        group.launched = True

    # ---- the step interface (the same as the DDP path's in train.py) -------------------------
    def zero_grad(self) -> None:
        if self.stage == 1:
            self.compute.grad[...] = 0                    # the shard is a view of it
        else:
            self.grad_shard[...] = 0
        if self.stage == 3:
            self._materialize(self.persistent)            # embeddings etc. for this step

    @contextlib.contextmanager
    def micro_context(self, last: bool):
        """Stage 1 accumulates micro-batches in its full gradient and reduces once (in sync);
        stages 2 and 3 keep no full gradient, so every micro-batch is reduced as it ends."""
        yield
        if self.stage >= 2 and not last:
            self._flush()

    @contextlib.contextmanager
    def eval_context(self):
        """Stage 3: parameters outside the blocks gathered for a forward outside a step."""
        gathered = self.stage == 3 and self.persistent.buffers is None
        if gathered:
            self._materialize(self.persistent)
        try:
            yield
        finally:
            if gathered:
                self._release(self.persistent)

    def sync(self) -> None:
        """After backward: every rank's gradient shard holds the averaged gradient."""
        if self.stage == 1:                   # afterwards only the shard is meaningful
            if self.comm.size > 1:
                self.grad_shard[...] = self.comm.reduce_scatter(self.compute.grad, "avg")
            self._track()
        else:
            self._flush()
        if self.grad_sum is not None:
            self.grad_sum(self.grad_shard, self.lo)

    def _flush(self) -> None:
        """Send what backward did not (the persistent group, unused parameters), wait for every
        reduce-scatter, add the received parts into the gradient shard, reset the groups."""
        for g in self.groups:
            if not g.launched and (self.stage == 2 or g is self.persistent):
                self._launch(g)
        for g in self.groups:
            if g.handle is not None:
                for s, e, handle in g.handle:
                    part = handle.wait()
                    if s < e:
                        self.grad_shard[s - self.lo:e - self.lo] += part
                g.handle = None
            g.pending, g.launched = len(g.params), False
        self._track()

    def apply(self, lr: float, grad_clip: float = 0.0):
        """Unscale, agree on overflow, clip by the global norm, update, rebuild parameters.

        Returns (applied, grad_norm)."""
        xp = backend.array_module(self.master)
        g = self.grad_shard.astype(self.master.dtype)
        if self.scaler.enabled:
            g *= 1.0 / self.scaler.scale
        sums = self.norm.reduce(np.array([self.norm.sum_sq(g, self.lo),
                                          0.0 if bool(xp.isfinite(g).all()) else 1.0]))
        norm, overflow = float(np.sqrt(sums[0])), sums[1] > 0
        if not self.scaler.update(bool(overflow)):
            self._end_step()
            return False, None
        if grad_clip and norm > grad_clip:
            g *= grad_clip / (norm + 1e-6)
        self.opt.flat.grad = g
        self.opt.step(lr)
        self.opt.flat.grad = None
        self._rebuild_parameters()
        self._end_step()
        return True, norm

    def _rebuild_parameters(self) -> None:
        """Stages 1-2: allgather every rank's updated shard into the full parameters, in
        place; stage 3: refresh this rank's compute shard."""
        if self.stage < 3:
            if self.mixed:
                self.compute.data[self.lo:self.hi] = self.master.astype(self.compute_dtype)
            if self.comm.size > 1:                        # in place, into the full params
                self.comm.allgather(self.compute.data[self.lo:self.hi],
                                    counts=shard_counts(self.L, self.comm.size),
                                    out=self.compute.data)
        elif self.mixed:
            self.compute_shard[...] = self.master.astype(self.compute_dtype)

    def _end_step(self) -> None:
        self._track()
        if self.stage == 3:
            self._release(self.persistent)

    # ---- memory accounting ------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes of parameters, gradients and optimizer state alive now (array nbytes)."""
        if self.stage < 3:
            params = self.compute.data.nbytes
        else:
            params = self.compute_shard.nbytes + sum(
                buf.nbytes for g in self.groups if g.buffers for buf in g.buffers)
        if self.stage == 1:
            grads = self.compute.grad.nbytes                  # the shard is a view of it
        else:
            grads = self.grad_shard.nbytes + sum(p.grad.nbytes for p in self.params
                                                 if p.grad is not None)
        opt = sum(v.nbytes for v in self.opt.state.values() if hasattr(v, "nbytes"))
        if self.mixed:                                        # the fp32 master copy
            opt += self.master.nbytes
        return {"params": params, "grads": grads, "optimizer": opt,
                "total": params + grads + opt}

    def _track(self) -> None:
        now = self.memory()
        for k, v in now.items():
            self._peak[k] = max(self._peak[k], v)

    def peak_memory(self) -> dict:
        return dict(self._peak)

    # ---- checkpoints ------------------------------------------------------------------------
    def full_parameters(self):
        """The full master weights, gathered (tests and checkpoints compare them)."""
        return self.comm.allgather(self.master, total=self.L)


    def flat_state(self):
        arrays = {"param": self.master}
        arrays.update({f"opt.{k}": v for k, v in self.opt.state.items()})
        return self.lo, self.hi, arrays, self.opt.step_count

    def optimizer(self):
        return self.opt

    def loaded(self, step_count: int) -> None:
        self.opt.step_count = step_count
        self._rebuild_parameters()

    def describe(self) -> list[str]:
        return [f"ZeRO stage {self.stage}",
                f"ZeRO stage {self.stage}: rank {self.comm.rank} holds elements [{self.lo}, "
                f"{self.hi}) of {self.L:,}; padding to equal shards would add {self.padding} "
                "(the last shards are shorter instead)"]
