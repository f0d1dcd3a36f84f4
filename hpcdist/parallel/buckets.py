"""Gradient buckets, the one mechanism DDP and ZeRO-2 share: a gradient is ready -> its
bucket counts down -> finished buckets launch their reduction in bucket order (the same order
on every rank, whatever order backward finished them in) -> the step waits for them all.

A bucket is a contiguous slice [lo, hi) of the flat gradient vector and the parameters that
fill it, cut from the end of the vector (the last layers, whose gradients backward finishes
first): the first one small, so communication starts early, the rest ``bucket_mb``. What a
launch does is the user's callback: DDP averages the slice (through its compression scheme),
ZeRO-2 reduce-scatters it onto the shards.
"""
from __future__ import annotations

from ..comm.arith import bounds_of

MB = 1 << 20


class Bucket:
    """Parameters whose flat ranges move together in one collective: DDP's and ZeRO-2's
    gradient buckets (one contiguous range [lo, hi)), ZeRO-3's gather groups (a block's
    ranges, gathered before it runs and reduce-scattered after its backward)."""

    def __init__(self, index: int, ranges, params):
        self.index, self.ranges, self.params = index, list(ranges), params
        self.pending = len(params)
        self.handle = None          # the collective in flight
        self.launched = False       # ZeRO-3: its gradients are on their way this micro-batch
        self.buffers = None         # ZeRO-3: gathered full values, one array per range
        self.group = 0              # DDP: 1 for expert parameters (parallel/expert.py)

    @property
    def lo(self) -> int:
        return self.ranges[0][0]

    @property
    def hi(self) -> int:
        return self.ranges[-1][1]

    def __repr__(self):
        return f"Bucket({self.index}, {self.ranges}, {len(self.params)} params)"


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


def make_buckets(params, itemsize: int, bucket_mb: float, first_bucket_mb: float,
                 group_of=None) -> list:
    """The buckets over ``params`` (flat order), in launch order. ``group_of(p)``: which
    reduction a parameter joins (expert parameters and the rest); a bucket holds one
    group's parameters only (``bucket.group``)."""
    group_of = group_of or (lambda p: 0)
    runs, start = [], 0                     # maximal runs of one group, in flat order
    for i in range(1, len(params) + 1):
        if i == len(params) or group_of(params[i]) != group_of(params[start]):
            runs.append((start, i))
            start = i
    out, base = [], [0]
    for a, b in runs:
        base.append(base[-1] + sum(p.size for p in params[a:b]))
    for r in reversed(range(len(runs))):    # the last parameters launch first
        a, b = runs[r]
        first = first_bucket_mb if not out else bucket_mb
        for lo, hi, members in plan_buckets([p.size for p in params[a:b]], itemsize,
                                            bucket_mb, first):
            bucket = Bucket(len(out), [(base[r] + lo, base[r] + hi)],
                            [params[a + j] for j in members])
            bucket.group = group_of(params[a])
            out.append(bucket)
    return out


class BucketQueue:
    """Ready -> launch in order -> wait. ``launch(bucket)`` starts its reduction and returns
    what ``finish(bucket, handle)`` completes after backward (None: nothing to wait for);
    ``overlap``: launch during backward (False: all at ``flush``)."""

    def __init__(self, buckets: list, launch, finish, overlap: bool = True):
        self.buckets, self.launch, self.finish, self.overlap = buckets, launch, finish, overlap
        self._of = {id(p): b for b in buckets for p in b.params}
        self._next = 0                            # the next bucket to launch, in order

    def ready(self, p) -> None:
        """Parameter ``p``'s gradient is final for this micro-batch (its hook)."""
        self._of[id(p)].pending -= 1
        if self.overlap:
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next])

    def _launch(self, bucket) -> None:
        bucket.handle = self.launch(bucket)
        self._next = bucket.index + 1

    def flush(self) -> None:
        """Launch what backward did not reach (unused parameters, overlap off), complete
        every bucket in order, and reset the counts for the next micro-batch."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for b in self.buckets:
            if b.handle is not None:
                self.finish(b, b.handle)
                b.handle = None
            b.pending = len(b.params)
        self._next = 0
