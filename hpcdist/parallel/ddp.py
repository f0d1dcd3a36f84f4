"""Data parallelism: every rank holds the whole model; gradients are averaged in buckets.

Gradients live in the optimizer's flat gradient buffer (``optim.FlatParams``); a bucket is a
contiguous slice of it (buckets.py: the mechanism ZeRO-2 shares — ready, launch in order,
wait; the first bucket small, the rest ``bucket_mb``, PyTorch's 25 MB default). A launched
bucket starts its non-blocking average through the compression scheme; ``sync_gradients()``
starts what backward did not reach (unused parameters) and waits only for what is in flight.
"""
from __future__ import annotations

import contextlib

from ..comm.arith import bounds_of
from ..device import kernels
from ..optim import FlatParams
from .buckets import Bucket, BucketQueue, make_buckets, plan_buckets  # noqa: F401 (exports)
from .compression import NoCompression

class DistributedDataParallel:
    """Wrap ``model`` for data-parallel training over ``comm``.

    Args:
        model: an ``nn.Module``; its parameters are broadcast from rank 0 at construction.
        comm: a Communicator (every rank constructs DDP together).
        flat: the optimizer's FlatParams if it already exists; otherwise one is made
            (pass ``ddp.flat`` to the optimizer then).
        compute: with mixed precision, the low-precision FlatParams bound to the model; each
            bucket's gradients are cast from it into ``flat.grad`` (fp32) before averaging.
        bucket_mb, first_bucket_mb: bucket byte caps.
        overlap: start each bucket's average during backward (False: all at sync time).
        compression: a compression scheme (``compression.make_compression``).
        experts: parameters held by this rank's expert-parallel share (parallel/expert.py):
            their buckets are averaged over ``expert_comm`` instead, as a share of all of
            ``comm`` (summed over ``expert_comm``, divided by ``comm.size``).
    """

    def __init__(self, model, comm, flat: FlatParams | None = None, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, overlap: bool = True, *, compression=None,
                 compute=None, experts=(), expert_comm=None):
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError("bucket sizes must be positive")
        self.module, self.comm = model, comm
        self.flat = flat if flat is not None else FlatParams(model.parameters())
        self.compute = compute if compute is not None else self.flat
        self.compression = compression or NoCompression()
        # The average over one rank is the gradient itself: nothing to start or wait for (a
        # non-blocking call per bucket cost ~15 us of bookkeeping each, 18 buckets a step).
        self._identity = comm.size == 1 and type(self.compression) is NoCompression
        self.require_sync = True
        params = self.flat.params
        mine = {id(p) for p in experts}
        self.expert_comm = expert_comm
        self.buckets = make_buckets(params, self.flat.data.dtype.itemsize, bucket_mb,
                                    first_bucket_mb, lambda p: int(id(p) in mine))
        if not mine:                           # every rank starts from rank 0's weights
            comm.bcast(self.flat.data, root=0)
        for b in self.buckets if mine else ():  # (an expert's: its group's rank 0)
            if not b.group:
                comm.bcast(self.flat.data[b.lo:b.hi], root=0)
            elif expert_comm.size > 1:
                expert_comm.bcast(self.flat.data[b.lo:b.hi], root=0)
        if self.compute is not self.flat:
            self.compute.data[...] = self.flat.data.astype(self.compute.data.dtype)
        self.queue = BucketQueue(self.buckets, self._launch, lambda b, handle: handle.wait(),
                                 overlap)
        offset = {id(p): lo for p, (lo, _) in zip(params, bounds_of([p.size for p in params]))}
        # {bucket: [(offset in the bucket, shape)]}: what a scheme that needs shapes binds to
        self.bucket_shapes = {b.index: [(offset[id(p)] - b.lo, tuple(p.shape)) for p in b.params]
                              for b in self.buckets}
        self.compression.bind(self.bucket_shapes)
        # Observers (benchmarks' probes): called with (bucket, its gradient) as a bucket is
        # handed to the communicator, and with (the DDP) once every bucket is averaged.
        self.on_launch: list = []
        self.on_synced: list = []
        for p in params:
            p.register_grad_hook(self._grad_ready)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def averages_nothing(self) -> bool:
        """One rank without compression: the gradient is its own average (no MPI at all)."""
        return self._identity

    @property
    def overlap(self) -> bool:
        """Whether buckets launch during backward (False: all at ``sync_gradients``)."""
        return self.queue.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.queue.overlap = on

    # ---- during backward ---------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        if self.require_sync:
            self.queue.ready(p)

    def _launch(self, bucket):
        """Start the bucket's average; returns its handle (None on one rank: nothing to do)."""
        grad = self.flat.grad[bucket.lo:bucket.hi]
        if self.compute is not self.flat:          # mixed precision: average in fp32
            kernels.WIDEN(self.compute.grad[bucket.lo:bucket.hi], grad)   # (grad[...] = ...)
        for observe in self.on_launch:
            observe(bucket, grad)
        if bucket.group:                           # an expert's: a share of all of DP
            grad *= self.expert_comm.size / self.comm.size
            if self.expert_comm.size == 1:
                return None
            return self.compression.start(self.expert_comm, grad, bucket.index)
        if self._identity:
            return None
        return self.compression.start(self.comm, grad, bucket.index)

    # ---- after backward ------------------------------------------------------------------
    def sync_gradients(self) -> None:
        """Average every bucket over the ranks (call after backward, before the step)."""
        self.queue.flush()
        for observe in self.on_synced:
            observe(self)
        if hasattr(self.compression, "step"):
            self.compression.step += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients locally, without communication."""
        prev, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = prev
