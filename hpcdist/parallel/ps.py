"""Asynchronous data parallelism through parameter servers: ``--strategy ps``.

The last ``--servers`` ranks are servers, each holding a shard of the flat parameters and of
the optimizer state; the other ranks are workers with the whole model. A worker computes a
gradient, pushes each server its shard of it (non-blocking point-to-point), and waits for each
server's answer: that server's current shard of the parameters. There is no collective among
the workers and no barrier per step.

The rest of this design: docs/data-parallel.md, "hpcdist/parallel/ps.py"."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from ..device import backend
from .. import optim
from ..comm import watchdog
from ..comm.arith import shard_bounds
from ..optim import FlatParams, decay_ranges_in
from .base import Strategy
from .mixed_precision import LossScaler
from .shards import ShardParams

PUSH, REPLY, CUT = 101, 102, 103          # point-to-point tags
GO, SAVE, STOP, END = 0, 1, 2, 3          # what the first server's answer tells a worker
HIST = 64                                 # staleness histogram bins (the last: >= 63)


def roles(world: int, servers: int) -> int:
    """The number of workers (ranks [0, W) work, [W, world) serve)."""
    return world - servers


def staleness_summary(comm, hist, max_gap: int) -> dict:
    """Every server's staleness histogram, summed, and the largest clock gap answered across
    (collective over every rank: the workers add nothing)."""
    buf = np.concatenate([hist, [max_gap]]).astype(np.float64)
    total = comm.allreduce(buf, op="sum")
    gap = comm.allreduce(np.array([float(max_gap)]), op="max")
    h = total[:HIST].astype(np.int64)
    n = int(h.sum())
    out = {"staleness_hist": [int(x) for x in np.trim_zeros(h, "b")],
           "staleness_mean": float((h * np.arange(HIST)).sum() / n) if n else 0.0,
           "staleness_max": int(np.nonzero(h)[0].max()) if n else 0,
           "clock_gap_max": int(gap[0])}
    shares = ", ".join(f"{k}: {c / max(n, 1) * 100:.1f}%"
                       for k, c in enumerate(out["staleness_hist"]) if c)
    out["line"] = (f"staleness of applied gradients (steps): mean {out['staleness_mean']:.2f}, "
                   f"max {out['staleness_max']} ({shares}) | largest clock gap answered "
                   f"{out['clock_gap_max']}")
    return out


class PSWorker(Strategy):
    """A worker: the whole model, no optimizer; pushes gradients, takes back parameters."""

    norm_is_global = False      # a step's gradient norm is this worker's (run/report.py)

    def __init__(self, model, comm, dp_comm, servers: int):
        self.model, self.comm, self.dp_comm, self.mesh = model, comm, dp_comm, None
        self.scaler = LossScaler(enabled=False)
        self.flat = FlatParams(model.parameters())
        self.workers = roles(comm.size, servers)
        self.servers = [self.workers + s for s in range(servers)]
        self.bounds = [shard_bounds(self.flat.size, servers, s) for s in range(servers)]
        self.clock = 0                   # gradients pushed
        self.version = 0                 # the first server's version in its last answer
        self.action, self.signal = GO, 0
        self.stop = None
        self._sends: list = []

    # ---- a step --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.grad[...] = 0

    def sync(self) -> None:
        """Push this step's gradient: each server its shard (answers come in ``apply``)."""
        self.clock += 1
        seen = self.stop.signum if self.stop is not None else 0
        ctrl = np.array([self.clock, seen], dtype=np.int64)
        for s, (lo, hi) in zip(self.servers, self.bounds):
            self._sends += [self.comm.isend(ctrl, s, PUSH),
                            self.comm.isend(self.flat.grad[lo:hi], s, PUSH)]

    def apply(self, lr: float, grad_clip: float = 0.0):
        """Take each server's answer: its shard of the parameters (the optimizer step, the
        learning rate and the clipping happen there)."""
        for i, (s, (lo, hi)) in enumerate(zip(self.servers, self.bounds)):
            ctrl = self.comm.recv(s, REPLY)
            self.flat.data[lo:hi] = self.comm.recv(s, REPLY)
            if i == 0:
                self.version, self.action, self.signal = (int(v) for v in ctrl[:3])
        for h in self._sends:
            h.wait()
        self._sends = []
        return True, None

    def begin(self, stop, start: int = 0) -> None:
        """Before the first step: the servers' parameters (fresh or resumed)."""
        self.stop = stop
        for s, (lo, hi) in zip(self.servers, self.bounds):
            self.flat.data[lo:hi] = self.comm.recv(s, REPLY)

    def mean_losses(self, losses: list) -> list:
        return backend.host_values(losses).tolist()   # no collective among workers: its own

    @property
    def step_comm(self):
        return None                      # each push is applied alone

    def control(self, step: int, cfg, stop, comm):
        """What the first server's answer said: stop, save (under the servers' version),
        end."""
        a = self.action
        save = self.version if cfg.save_dir and a != GO else None
        return (self.signal if a == STOP else 0), save, a not in (STOP, END)

    def summary(self) -> dict:
        return staleness_summary(self.comm, np.zeros(HIST, dtype=np.int64), 0)

    # ---- what it holds ---------------------------------------------------------------------
    def memory(self) -> dict:
        p, g = self.flat.data.nbytes, self.flat.grad.nbytes
        return {"params": p, "grads": g, "optimizer": 0, "total": p + g}

    def full_parameters(self):
        return self.flat.data

    def flat_state(self):
        return 0, 0, {"param": self.flat.data[:0]}, self.version

    def holds_state(self) -> bool:
        return False

    def add_optimizer_state(self, name: str, array) -> None:
        pass

    def loaded(self, step_count: int) -> None:
        self.version = step_count

    def describe(self) -> list[str]:
        return [f"parameter server: {len(self.servers)} server(s), {self.workers} worker(s)"]


class PSServer(Strategy):
    """A server: a shard of the parameters and of the optimizer; answers the workers."""

    brings_loop = True              # it answers the workers until they are done

    def __init__(self, model, comm, server_comm, make_optimizer, servers: int,
                 max_staleness: int, *, cfg):
        self.model, self.comm, self.mesh, self.cfg = model, comm, None, cfg
        self.scaler = LossScaler(enabled=False)
        flat = FlatParams(model.parameters())          # the flat order: names, decay ranges
        self.workers = roles(comm.size, servers)
        self.index = comm.rank - self.workers
        self.lo, self.hi = shard_bounds(flat.size, servers, self.index)
        self.master = flat.data[self.lo:self.hi].copy()
        self.grad = backend.xp().zeros_like(self.master)
        self.opt = make_optimizer(ShardParams(self.master, self.grad, decay_ranges_in(
            flat.decay_ranges, self.lo, self.hi)))
        self.dp_comm = server_comm                     # the servers (norms for clipping)
        self.max_staleness = max_staleness
        self.acc = backend.xp().zeros_like(self.master)
        self.count = 0                                 # pushes summed into acc
        self.version = 0
        self.hist = np.zeros(HIST, dtype=np.int64)     # staleness of every applied push
        self.max_gap = 0                               # largest clock gap answered across
        self.lr_scale = self.workers if cfg.scale_lr else 1

    # ---- the optimizer ---------------------------------------------------------------------
    def _step(self) -> None:
        cfg = self.cfg
        self.grad[...] = self.acc / self.count
        self.acc[...] = 0
        self.count = 0
        norm = 0.0
        if cfg.grad_clip:
            sq = np.array([optim.grad_norm_sq(self.grad)])
            norm = float(np.sqrt(self.dp_comm.allreduce(sq)[0] if self.dp_comm.size > 1
                                 else sq[0]))
        self.version += 1
        self.opt.step(optim.lr_at(self.version, cfg.lr * self.lr_scale, cfg.warmup, cfg.steps,
                                  cfg.min_lr * self.lr_scale), clipping=(norm, cfg.grad_clip))

    # ---- serving ---------------------------------------------------------------------------
    def run(self, stop, save, stopped: int, start: int) -> dict:
        """This server's part of a run (train.py calls it in place of the step loop): serve
        until the run ends or stops, then the collective summary; the final record."""
        t_start = time.perf_counter()
        if start < self.cfg.steps and not stopped:
            _, stopped = self.serve(stop, save)
        seconds = time.perf_counter() - t_start
        final = {"event": "preempted" if stopped else "final", "role": "server",
                 "steps": self.version, "world": self.comm.size, "seconds": seconds,
                 "train_seconds": seconds, "memory_state": self.memory()}
        if stopped:
            final["signal"] = signal.Signals(stopped).name
        final.update(self.summary())
        final.pop("line")
        final["history"] = []
        final["params"] = backend.to_numpy(self.full_parameters())
        return final

    def serve(self, stop, save) -> tuple[int, int]:
        """Answer the workers until the run ends or stops; ``save(version)`` writes a
        checkpoint (collective over every rank). Returns (END or STOP, the stop signal)."""
        W, comm, first = self.workers, self.comm, self.index == 0
        pushes = [0] * W                  # gradients received from each worker (its clock)
        waiting = {}                      # worker -> clock of its unanswered push
        used = [self.version] * W         # the version each worker last received
        for w in range(W):                # the starting parameters (fresh or resumed)
            comm.send(self.master, w, REPLY)
        heads = [comm.irecv(w, PUSH) for w in range(W)]
        cut_head = None if first else comm.irecv(W, CUT)
        cut, action, signal = None, GO, 0
        while True:
            progressed = False
            for w in range(W):
                if not heads[w].test():
                    continue
                clock, seen = (int(v) for v in heads[w].wait())
                grad = comm.recv(w, PUSH)
                heads[w] = comm.irecv(w, PUSH)
                pushes[w], waiting[w], progressed = clock, clock, True
                signal = signal or seen
                self._add(grad, self.version - used[w])
            if cut_head is not None and cut is None and cut_head.test():
                msg = cut_head.wait()
                action, signal, cut = int(msg[0]), int(msg[1]), [int(c) for c in msg[2:]]
                progressed = True
            if first and cut is None:
                action, signal, cut = self._decide(stop, signal, pushes, waiting)
                progressed = progressed or cut is not None
            if cut is not None and all(p >= c for p, c in zip(pushes, cut)):
                for w in list(waiting):   # every worker at the cut: answer, then act together
                    self._answer(w, action, signal, used)
                    del waiting[w]
                if self.cfg.save_dir:
                    save(self.version)
                if action != SAVE:
                    for h in heads + [cut_head]:
                        if h is not None:
                            h.cancel()
                    self._busy()
                    return action, signal
                cut, action = None, GO
                continue
            if cut is None and self._answer_ready(pushes, waiting, used):
                progressed = True
            if progressed:
                self._busy()
            else:
                self._idle()

    def _decide(self, stop, signal: int, pushes, waiting):
        """The first server: (action, signal, the cut or None) — whether the run ends, stops
        or saves now; a cut (the push each worker is at, or computing) goes to the others."""
        W, comm = self.workers, self.comm
        signal = signal or (stop.signum if stop is not None else 0)
        action = (END if self.version >= self.cfg.steps else STOP if signal else
                  SAVE if self._save_due() else GO)
        if action == GO:
            return action, signal, None
        cut = [pushes[w] + (0 if w in waiting else 1) for w in range(W)]
        msg = np.array([action, signal] + cut, dtype=np.int64)
        for s in range(W + 1, comm.size):
            comm.send(msg, s, CUT)
        return action, signal, cut

    def _answer_ready(self, pushes, waiting, used) -> bool:
        """Stale Synchronous Parallel: answer a push of clock c once every worker has pushed
        c - s; whether any was answered."""
        low, answered = min(pushes), False
        for w, clock in list(waiting.items()):
            if self.max_staleness < 0 or low >= clock - self.max_staleness:
                self.max_gap = max(self.max_gap, clock - low)
                self._answer(w, GO, 0, used)
                del waiting[w]
                answered = True
        return answered

    def _add(self, grad, stale: int) -> None:
        """A pushed gradient: summed; the W-th since the last step makes the next step. Past
        the last step (``--steps``) pushes are dropped."""
        if self.version >= self.cfg.steps:
            return
        self.acc += grad
        self.count += 1
        self.hist[min(stale, HIST - 1)] += 1
        if self.count == self.workers:
            self._step()

    def _answer(self, w: int, action: int, signal: int, used: list) -> None:
        self.comm.send(np.array([self.version, action, signal], dtype=np.int64), w, REPLY)
        self.comm.send(self.master, w, REPLY)
        used[w] = self.version

    def _save_due(self) -> bool:
        every = self.cfg.save_every
        if self.cfg.save_dir and every and self.version % every == 0 \
                and self.version > self._saved:
            self._saved = self.version
            return True
        return False

    _saved = 0
    _wait = None
    _idle_since = 0.0

    def _idle(self) -> None:
        """Nothing arrived: yield the core for a while, then sleep in growing steps (as
        ``watchdog.wait_requests``); registered as a wait, so a stalled worker is named."""
        now = time.perf_counter()
        if self._wait is None:
            self._wait = watchdog.enter(self.comm.label, 0, "parameter server: waiting for "
                                        "pushes", 0, "the workers")
            self._idle_since = now
        if now - self._idle_since < watchdog.YIELD_S:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, (now - self._idle_since) / 20))

    def _busy(self) -> None:
        if self._wait is not None:
            watchdog.leave(self._wait)
            self._wait = None

    def summary(self) -> dict:
        return staleness_summary(self.comm, self.hist, self.max_gap)

    # ---- what it holds ---------------------------------------------------------------------
    def memory(self) -> dict:
        p, g = self.master.nbytes, self.grad.nbytes + self.acc.nbytes
        o = sum(v.nbytes for v in self.opt.state.values() if hasattr(v, "nbytes"))
        return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}

    def full_parameters(self):
        return self.master

    def flat_state(self):
        arrays = {"param": self.master}
        arrays.update({f"opt.{k}": v for k, v in self.opt.state.items()})
        return self.lo, self.hi, arrays, self.version

    def holds_state(self) -> bool:
        return True

    def optimizer(self):
        return self.opt

    def loaded(self, step_count: int) -> None:
        self.version = self.opt.step_count = step_count
        self._saved = step_count                     # the checkpoint just loaded

    def own_state(self) -> dict:
        return {"ps.acc": backend.to_numpy(self.acc).copy(), "ps.count": np.array(self.count)}

    def load_own_state(self, own: dict) -> None:
        if "ps.acc" in own:
            self.acc[...] = backend.to_device(own["ps.acc"])
            self.count = int(own["ps.count"])

    def describe(self) -> list[str]:
        return [f"parameter server: {self.cfg.servers} server(s), {self.workers} worker(s)"]
