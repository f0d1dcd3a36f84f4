"""Data parallelism: every rank holds the whole model; gradients are averaged in buckets.

Gradients live in the optimizer's flat gradient buffer (``optim.FlatParams``); a bucket is a
contiguous slice of it. Buckets are cut from the end of the buffer — the last layers, whose
gradients backward finishes first — the first one small (``first_bucket_mb``, so
communication starts early), the rest ``bucket_mb`` (PyTorch's 25 MB default). Each
parameter's gradient hook counts its bucket down; a bucket whose count reaches zero starts its
non-blocking average at once, always in bucket order on every rank. ``sync_gradients()``
starts what backward did not reach (unused parameters) and waits only for what is in flight.
"""
from __future__ import annotations

import contextlib

from ..comm.layout import bounds_of
from ..optim import FlatParams
from .compression import NoCompression

MB = 1 << 20


class Bucket:
    """A contiguous slice [lo, hi) of the flat gradient and the parameters that fill it."""

    def __init__(self, index: int, lo: int, hi: int, params):
        self.index, self.lo, self.hi, self.params = index, lo, hi, params
        self.pending = len(params)
        self.handle = None

    def __repr__(self):
        return f"Bucket({self.index}, [{self.lo}, {self.hi}), {len(self.params)} params)"


def plan_buckets(sizes, itemsize: int, bucket_mb: float, first_bucket_mb: float):
    """Bucket boundaries over parameters of the given element counts (flat order).

    Walks the parameters from last to first, closing a bucket once it reaches its byte cap
    (the first bucket's cap is ``first_bucket_mb``). Returns a list of (lo, hi, [param
    indices]) in launch order. Pure logic: tested without MPI.
    """
    spans = bounds_of(sizes)
    offsets, off = [lo for lo, _ in spans], spans[-1][1] if spans else 0
    buckets, members, hi, cap = [], [], off, first_bucket_mb * MB
    for i in reversed(range(len(sizes))):
        members.append(i)
        lo = offsets[i]
        if (hi - lo) * itemsize >= cap:
            buckets.append((lo, hi, members))
            members, hi, cap = [], lo, bucket_mb * MB
    if members:
        buckets.append((offsets[members[-1]], hi, members))
    return buckets


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
    """

    def __init__(self, model, comm, flat: FlatParams | None = None, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, overlap: bool = True, compression=None,
                 compute=None):
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError("bucket sizes must be positive")
        self.module, self.comm = model, comm
        self.flat = flat if flat is not None else FlatParams(model.parameters())
        self.compute = compute if compute is not None else self.flat
        self.overlap = overlap
        self.compression = compression or NoCompression()
        # The average over one rank is the gradient itself: nothing to start or wait for (a
        # non-blocking call per bucket cost ~15 us of bookkeeping each, 18 buckets a step).
        self._identity = comm.size == 1 and type(self.compression) is NoCompression
        self.require_sync = True
        comm.bcast(self.flat.data, root=0)     # every rank starts from rank 0's weights
        if self.compute is not self.flat:
            self.compute.data[...] = self.flat.data.astype(self.compute.data.dtype)
        params = self.flat.params
        plan = plan_buckets([p.size for p in params], self.flat.data.dtype.itemsize,
                            bucket_mb, first_bucket_mb)
        self.buckets = [Bucket(i, lo, hi, [params[j] for j in members])
                        for i, (lo, hi, members) in enumerate(plan)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        offset = {id(p): lo for p, (lo, _) in zip(params, bounds_of([p.size for p in params]))}
        # {bucket: [(offset in the bucket, shape)]}: what a scheme that needs shapes binds to
        self.bucket_layout = {b.index: [(offset[id(p)] - b.lo, tuple(p.shape)) for p in b.params]
                              for b in self.buckets}
        self.compression.bind(self.bucket_layout)
        self._next = 0                            # next bucket to launch, in order
        # Observers (benchmarks' probes): called with (bucket, its gradient) as a bucket is
        # handed to the communicator, and with (the DDP) once every bucket is averaged.
        self.on_launch: list = []
        self.on_synced: list = []
        for p in params:
            p.register_grad_hook(self._grad_ready)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ---- during backward ---------------------------------------------------------------------
    def _grad_ready(self, p) -> None:
        if not self.require_sync:
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch finished buckets, but never one before all earlier buckets have launched."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket) -> None:
        grad = self.flat.grad[bucket.lo:bucket.hi]
        if self.compute is not self.flat:          # mixed precision: average in fp32
            grad[...] = self.compute.grad[bucket.lo:bucket.hi]
        for observe in self.on_launch:
            observe(bucket, grad)
        if not self._identity:
            bucket.handle = self.compression.start(self.comm, grad, bucket.index)
        self._next = bucket.index + 1

    # ---- after backward ------------------------------------------------------------------
    def sync_gradients(self) -> None:
        """Average every bucket over the ranks (call after backward, before the step)."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])   # unused params, or overlap off
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            b.pending = len(b.params)
        self._next = 0
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
