"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025): replica
groups train apart and meet every H steps. Each group runs its own layout (DDP, ZeRO, TP)
and inner optimizer; at a round's end the pseudo-gradient (the model at the last meeting
minus the group's model now) is averaged across the groups over ``cross`` only (one rank per
group and place: the slow links), and an outer SGD (Nesterov momentum, the paper's 0.7 / 0.9)
steps the shared model, which every group continues from. Streaming: the flat parameters in
F equal fragments, fragment f meeting at steps f*H/F (mod H); its exchange may run ``overlap``
steps behind, non-blocking, after which the local fragment becomes mix x local + (1 - mix) x
outer (the paper's alpha). A checkpoint, a stop and the last step end every fragment's round
(so a checkpoint holds one model, the same in every group). docs/diloco.md has the rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..comm.arith import shard_bounds
from ..device import backend
from ..host import timeline
from .groups import AcrossGroups
from .outer_wire import OuterWire


@dataclass
class Outer:
    """The outer loop's settings (config: --inner-steps, --outer-*, --fragments; the
    defaults are TrainConfig's)."""
    inner_steps: int
    lr: float
    momentum: float
    nesterov: bool
    fragments: int
    overlap: int
    wire: str
    mix: float
    steps: int              # the run's steps (what the header says of its last round)


def fragment_bounds(sizes, F: int) -> list:
    """F contiguous ranges of the flat parameters (model order: the blocks one after another),
    as equal as elements go (a tensor may straddle two): [lo, hi) in flat offsets."""
    total = sum(sizes)
    return [shard_bounds(total, F, f) for f in range(F)]


class DiLoCo(AcrossGroups):
    """``inner`` (any strategy over this group) plus the outer loop over ``groups.cross``."""

    def __init__(self, inner, comm, groups, batches, outer: Outer, replicas=None):
        super().__init__(inner, comm, groups, batches)
        self.o = outer
        # the ranks of the group that hold the same elements (DDP's replicas): each sends its
        # 1/K of a fragment across, and the average comes back together inside the group
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        lo, hi, arrays, _ = inner.flat_state()
        self.param = arrays["param"]                   # this rank's flat [lo, hi), live
        self.outer = self.param.copy()                 # the model at the last meeting
        self.momentum = backend.array_module(self.param).zeros_like(self.param)
        sizes = [p.size for p in self.model.parameters()]
        self.frags = [(max(a, lo) - lo, max(min(b, hi), lo) - lo)
                      for a, b in fragment_bounds(sizes, outer.fragments)]
        F, H = outer.fragments, outer.inner_steps
        self.offsets = [f * H // F for f in range(F)]
        self.wire = OuterWire(groups.cross, outer.wire)
        self.steps, self.dirty, self.inflight = 0, [False] * F, None
        self.exchanges, self.wait_s = [], 0.0          # bytes of each exchange; blocked time

    @property
    def step_comm(self):
        return self.inner.step_comm       # a group's steps average its own gradients

    # ---- the step ------------------------------------------------------------------------
    def begin(self, stop, start: int = 0) -> None:
        self.inner.begin(stop, start)
        self.steps = start                 # rounds are counted in the run's steps

    def apply(self, lr: float, grad_clip: float = 0.0):
        applied, norm = self.inner.apply(lr, grad_clip)
        self.steps += 1                    # every group counts steps alike (skipped ones too)
        self.dirty = [True] * len(self.dirty)
        moved = False
        if self.inflight is not None and self.steps >= self.inflight[2]:
            moved = self._finish()
        for f, off in enumerate(self.offsets):
            if self.steps % self.o.inner_steps == off:
                moved |= self._sync(f, blocking=self.o.overlap == 0)
        if moved:
            self._rebuild()
        return applied, norm

    def control(self, step: int, cfg, stop, comm):
        stopped, save_at, more = super().control(step, cfg, stop, comm)
        before = self.cross.bytes_sent
        if save_at is not None or not more:            # one model in every group: meet now
            self.flush()
        self._control_bytes = self.cross.bytes_sent - before
        return stopped, save_at, more

    def control_bytes(self) -> int:
        return getattr(self, "_control_bytes", 0)

    def flush(self) -> None:
        """End every fragment's round now (blocking): every group holds the outer model."""
        moved = self._finish() if self.inflight is not None else False
        for f in range(len(self.frags)):
            if self.dirty[f]:
                moved |= self._sync(f, blocking=True)
        if moved:
            self._rebuild()

    # ---- one fragment's meeting ------------------------------------------------------------
    def _sync(self, f: int, blocking: bool) -> bool:
        """Start fragment f's exchange (and finish it, ``blocking``); whether the flat
        parameters changed."""
        moved = self._finish() if self.inflight is not None else False   # one in flight
        lo, hi = self._piece(f)
        delta = self.outer[lo:hi] - self.param[lo:hi]  # the pseudo-gradient (this rank's part)
        before = self.cross.bytes_sent
        with timeline.span("outer exchange", fragment=f):
            pending = self.wire.start(delta)
        self.inflight = (f, pending, self.steps + self.o.overlap, before)
        return self._finish(mix=False) if blocking else moved

    def _finish(self, mix: bool = True) -> bool:
        f, pending, _, before = self.inflight
        t0 = time.perf_counter()
        a, b = self.frags[f]
        with timeline.span("outer wait", fragment=f):
            avg = pending.wait()
            self.exchanges.append(self.cross.bytes_sent - before)
            if self.replicas is not None:              # the parts, whole again (intra-node)
                avg = self.replicas.allgather(avg, total=b - a)
        self.wait_s += time.perf_counter() - t0
        self.inflight = None
        o = self.o
        step = avg
        if o.momentum:
            m = self.momentum[a:b]
            m *= o.momentum
            m += avg
            step = avg + o.momentum * m if o.nesterov else m
        self.outer[a:b] -= o.lr * step
        if mix and o.overlap:          # the steps run meanwhile: the paper's mixing
            self.param[a:b] = o.mix * self.param[a:b] + (1 - o.mix) * self.outer[a:b]
        else:
            self.param[a:b] = self.outer[a:b]
            self.dirty[f] = False
        return True

    def _piece(self, f: int) -> tuple:
        """[lo, hi) of fragment f this rank sends across the groups."""
        a, b = self.frags[f]
        if self.replicas is None:
            return a, b
        lo, hi = shard_bounds(b - a, self.replicas.size, self.replicas.rank)
        return a + lo, a + hi

    def _rebuild(self) -> None:
        """The parameters the group computes with, from the flat state just written."""
        self.inner.loaded(self.inner.optimizer().step_count)

    # ---- state -----------------------------------------------------------------------------
    def flat_state(self):
        lo, hi, arrays, count = self.inner.flat_state()
        arrays["opt.outer_momentum"] = self.momentum
        return lo, hi, arrays, count

    def loaded(self, step_count: int) -> None:
        self.inner.loaded(step_count)
        self.outer[...] = self.param                   # a checkpoint holds a meeting's model

    def own_state(self) -> dict:
        """This group's inner optimizer state (the groups' differ; the layout-free pieces hold
        group 0's): a resume at the same layout continues every group exactly."""
        own = self.inner.own_state()
        own.update({f"diloco.{k}": backend.to_numpy(v).copy()
                    for k, v in self.inner.optimizer().state.items() if hasattr(v, "shape")})
        return own

    def load_own_state(self, own: dict) -> None:
        self.inner.load_own_state(own)
        state = self.inner.optimizer().state
        for k, v in own.items():
            if k.startswith("diloco.") and k[len("diloco."):] in state:
                state[k[len("diloco."):]][...] = backend.to_device(np.asarray(v))

    # ---- reports ---------------------------------------------------------------------------
    def memory(self) -> dict:
        m = dict(self.inner.memory())
        extra = self.outer.nbytes + self.momentum.nbytes
        m["optimizer"] += extra
        m["total"] += extra
        return m

    def describe(self) -> list[str]:
        o, g = self.o, self.groups
        inner = self.inner.describe() or [""]
        outer = (f"outer SGD lr {o.lr} momentum {o.momentum}" +
                 (" Nesterov" if o.nesterov and o.momentum else "") + f", {o.wire} wire")
        stream = (f", {o.fragments} fragments staggered by {o.inner_steps // o.fragments}"
                  if o.fragments > 1 else "") + (
            f", exchanges {o.overlap} step(s) behind (mix {o.mix})" if o.overlap else "")
        last = o.steps % o.inner_steps
        short = [f"DiLoCo: {o.inner_steps} does not divide the {o.steps} steps: the last round "
                 f"runs {last} (every round ends at the last step and at each checkpoint)"
                 ] if last else []
        return [f"{inner[0]} | DiLoCo {g.count} groups x {g.inner.size} ranks, H "
                f"{o.inner_steps}, {outer}{stream}"] + inner[1:] + short

    def summary(self) -> dict:
        out = dict(self.inner.summary())
        sent = self.cross.bytes_sent
        err = float(np.mean(self.wire.errors)) if self.wire.errors else None
        out.update({"outer_exchanges": len(self.exchanges), "outer_bytes": sent,
                    "outer_peak_bytes": max(self.exchanges, default=0),
                    "outer_wait_s": self.wait_s, "outer_quant_error": err})
        line = (f"DiLoCo: {len(self.exchanges)} fragment exchanges, {sent:,} bytes across "
                f"groups from this rank (the most in one: {max(self.exchanges, default=0):,}), "
                f"{self.wait_s:.2f} s waited on them")
        if err is not None:
            line += f"; {self.o.wire} pseudo-gradients off by {err:.2%} (relative L2, mean)"
        out["line"] = (out["line"] + "\n" + line) if out.get("line") else line
        return out
