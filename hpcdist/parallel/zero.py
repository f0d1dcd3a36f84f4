"""ZeRO-1, -2 and -3 (Rajbhandari et al., 2020) over the flat parameter vector.

The parameters are laid out as one flat vector of L elements (model order) and split over
the P ranks by the shard rule (comm/arith.py): rank r owns [lo, hi). ``Zero`` is what
every level shares: the shard bounds, the master weights and the optimizer on this rank's
shard, the update (unscale, overflow, clip, step), the reduce-scatter of packed gradient
ranges and the memory count. A level (DeepSpeed's "stage"; in hpcdist a stage is only a
pipeline's) is a subclass saying where parameters and gradients live — the list goes on in
docs/zero.md, "hpcdist/parallel/zero.py"."""
from __future__ import annotations

import contextlib

import numpy as np

from ..device import backend
from ..comm.arith import bounds_of, padded_length, shard_bounds, shard_counts
from .. import optim
from ..optim import FlatParams, decay_ranges_in, intersect
from .base import Norm, Strategy
from .buckets import BucketQueue, make_buckets
from .mixed_precision import LossScaler, averaging
from .shards import ShardParams, pieces_of_range
from .capabilities import Zero1Shape, Zero2Shape, ZeroShape


class Zero(ZeroShape, Strategy):
    """What every ZeRO level shares, for ``model`` over ``comm`` (a level's class is made
    with these arguments: ``LEVELS[level](model, comm, make_optimizer, ...)``).

    Args:
        model: the model (a GPT for ZeRO-3: its ``blocks`` are the gather units).
        comm: a Communicator.
        make_optimizer: callable(FlatParams-like) -> optim.Optimizer for the shard.
        compute_dtype: dtype of parameters and gradients in forward/backward (fp16/bf16 for
            mixed precision); the master shard keeps the model's initial dtype.
        scaler: a mixed_precision.LossScaler (disabled for fp32).
        bucket_mb, first_bucket_mb: ZeRO-2 bucket caps.
        norm (base.Norm): how the global gradient norm is summed (default: over ``comm``);
        grad_sum: gradients summed over another group after the average (sequence
            parallelism); mesh: the process mesh of a model-parallel layout.
        overlap: ZeRO-2 starts each bucket's reduce-scatter during backward (False: after).
    """

    level = 0

    def __init__(self, model, comm, make_optimizer, compute_dtype=None,
                 scaler=None, bucket_mb: float = 25.0, *, first_bucket_mb: float = 1.0,
                 norm=None, grad_sum=None, mesh=None, overlap: bool = True):
        self.model, self.comm, self.mesh = model, comm, mesh
        self.overlap = overlap            # ZeRO-2: reduce-scatter buckets as backward fills them
        self.norm, self.grad_sum = norm or Norm([comm]), grad_sum
        # the ranks whose losses make the step's (under EP ``comm`` is narrower: the ranks
        # holding this rank's experts)
        self.dp_comm = mesh.dp_comm if mesh is not None else comm
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
        self.opt = make_optimizer(ShardParams(self.master, None,
                                              decay_ranges_in(decay, self.lo, self.hi)))
        if self.mixed:                 # each step writes this rank's piece of the compute copy
            self.opt.copy_into = self._compute_shard()

    def _compute_shard(self):
        """This rank's [lo, hi) of the compute parameters (the optimizer's step writes it in
        mixed precision), or None where there is no such array."""
        return None

    # ---- what a level says ------------------------------------------------------------------
    def _place(self, full, bucket_mb: float, first_bucket_mb: float) -> None:
        """Where parameters and gradients live (sets ``master``, ``grad_shard``, ...)."""
        raise NotImplementedError

    def _reduce(self) -> None:
        """After the last micro-batch: this rank's averaged gradient in ``grad_shard``."""
        raise NotImplementedError

    def _between_micro_batches(self) -> None:
        """After a micro-batch that is not the step's last."""

    def _rebuild_parameters(self, stepped: bool = False) -> None:
        """After the update (``stepped``: by the optimizer, which wrote ``opt.copy_into``
        where set) or a load: the parameters the model computes with, from the shards."""
        raise NotImplementedError

    def _held(self) -> tuple:
        """(parameter bytes, gradient bytes) alive now."""
        raise NotImplementedError

    # ---- shared -----------------------------------------------------------------------------
    def _counts(self, a: int, b: int) -> list:
        """How many elements of the flat range [a, b) each rank's shard holds."""
        return [e - s for s, e in pieces_of_range(a, b, self.comm.size, self.L)]

    def _reduce_scatter(self, ranges, params) -> list:
        """Pack ``params``' gradients over the flat ``ranges``, drop them, and start reduce-
        scattering onto the shards: [(s, e, handle)] of this rank's part of each, averaged."""
        xp = backend.array_module(self.grad_shard)
        packed = []
        for a, b in ranges:
            buf = xp.zeros(b - a, dtype=self.compute_dtype)
            for p in params:
                o = self._offset[id(p)]
                if a <= o < b and p.grad is not None:
                    buf[o - a:o - a + p.size] = p.grad.reshape(-1)
            packed.append(buf)
        self._track()
        for p in params:
            p.grad = None
        return [intersect(a, b, self.lo, self.hi) + (self.comm.ireduce_scatter(
            buf, averaging(buf, self.comm.size), counts=self._counts(a, b)),)
            for (a, b), buf in zip(ranges, packed)]

    def _add_parts(self, handles) -> None:
        """Wait for reduce-scatters and add the parts received into the gradient shard."""
        for s, e, handle in handles:
            part = handle.wait()
            if s < e:
                self.grad_shard[s - self.lo:e - self.lo] += part

    def _gather_full(self, stepped: bool = False) -> None:
        """Stages 1-2: allgather every rank's updated shard into the full parameters (its
        compute copy written by the optimizer's step where ``stepped`` and it does)."""
        if self.mixed and not (stepped and self.opt.copy_into is not None):
            self.compute.data[self.lo:self.hi] = self.master.astype(self.compute_dtype)
        if self.comm.size > 1:                        # in place, into the full params
            self.comm.allgather(self.compute.data[self.lo:self.hi],
                                counts=shard_counts(self.L, self.comm.size),
                                out=self.compute.data)

    # ---- the step interface (the same as the DDP path's in train.py) -------------------------
    def zero_grad(self) -> None:
        self.grad_shard[...] = 0

    @contextlib.contextmanager
    def micro_context(self, last: bool):
        yield
        if not last:
            self._between_micro_batches()

    def sync(self) -> None:
        """After backward: every rank's gradient shard holds the averaged gradient."""
        self._reduce()
        if self.grad_sum is not None:
            self.grad_sum(self.grad_shard, self.lo)

    def apply(self, lr: float, grad_clip: float = 0.0):
        """Unscale, agree on overflow, clip by the global norm, update, rebuild parameters.

        Returns (applied, grad_norm)."""
        xp = backend.array_module(self.master)
        g = self.grad_shard.astype(self.master.dtype)
        if self.scaler.enabled:
            g *= 1.0 / self.scaler.scale
        # fp16 checks every element (a device read); otherwise a non-finite gradient shows
        # in the global sum of squares, which is read anyway
        finite = bool(xp.isfinite(g).all()) if self.scaler.enabled else True
        sums = self.norm.reduce(backend.host_values([self.norm.sum_sq(g, self.lo),
                                                     0.0 if finite else 1.0]))
        norm, overflow = float(np.sqrt(sums[0])), sums[1] > 0 or not np.isfinite(sums[0])
        if not self.scaler.update(bool(overflow)):
            self._end_step()
            return False, None
        self.opt.flat.grad = g
        self.opt.step(lr, clipping=(norm, grad_clip))   # (data parallelism's rule and kernel)
        self.opt.flat.grad = None
        self._rebuild_parameters(stepped=True)
        self._end_step()
        return True, norm

    def _end_step(self) -> None:
        self._track()

    # ---- memory accounting ------------------------------------------------------------------
    def memory(self) -> dict:
        """Bytes of parameters, gradients and optimizer state alive now (array nbytes)."""
        params, grads = self._held()
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
        return [f"ZeRO-{self.level}",
                f"ZeRO-{self.level}: rank {self.comm.rank} holds elements [{self.lo}, "
                f"{self.hi}) of {self.L:,}; padding to equal shards would add {self.padding} "
                "(the last shards are shorter instead)"]


class Zero1(Zero, Zero1Shape):
    """Optimizer state sharded: full parameters and gradient, one reduce-scatter a step."""

    level = 1

    def _place(self, full, bucket_mb: float, first_bucket_mb: float) -> None:
        for p, o in zip(self.params, self.offsets):
            p.data = full[o:o + p.size].reshape(p.shape).astype(self.compute_dtype)
        self.compute = FlatParams(self.params)                 # full compute parameters
        self.master = full[self.lo:self.hi].copy() if self.mixed else \
            self.compute.data[self.lo:self.hi]
        # reduce-scattered in place: the shard is a view of the full gradient
        self.grad_shard = self.compute.grad[self.lo:self.hi]

    def zero_grad(self) -> None:
        self.compute.grad[...] = 0                             # the shard is a view of it

    def _reduce(self) -> None:            # micro-batches accumulate in the full gradient
        if self.comm.size > 1:            # afterwards only the shard is meaningful
            g = self.compute.grad
            self.grad_shard[...] = self.comm.reduce_scatter(g, averaging(g, self.comm.size))
        self._track()

    def _rebuild_parameters(self, stepped: bool = False) -> None:
        self._gather_full(stepped)

    def _compute_shard(self):
        return self.compute.data[self.lo:self.hi]

    def _held(self) -> tuple:
        return self.compute.data.nbytes, self.compute.grad.nbytes


class Zero2(Zero1, Zero2Shape):
    """Gradients sharded too: buckets reduce-scatter onto the shards as backward finishes
    them; no full gradient buffer (every micro-batch is reduced as it ends)."""

    level = 2

    def _place(self, full, bucket_mb: float, first_bucket_mb: float) -> None:
        super()._place(full, bucket_mb, first_bucket_mb)
        self.compute.grad = None
        for p in self.params:
            p.grad = None
        self.grad_shard = backend.array_module(full).zeros(self.hi - self.lo,
                                                           dtype=self.compute_dtype)
        self.groups = make_buckets(self.params, self.compute_dtype.itemsize, bucket_mb,
                                   first_bucket_mb)
        self.queue = BucketQueue(self.groups,
                                 lambda b: self._reduce_scatter(b.ranges, b.params),
                                 lambda b, handles: self._add_parts(handles), self.overlap)
        for p in self.params:
            p.register_grad_hook(self.queue.ready)

    def zero_grad(self) -> None:
        self.grad_shard[...] = 0

    def _reduce(self) -> None:
        self.queue.flush()
        self._track()

    _between_micro_batches = _reduce

    def _held(self) -> tuple:
        return self.compute.data.nbytes, self.grad_shard.nbytes + sum(
            p.grad.nbytes for p in self.params if p.grad is not None)
