"""The strategy interface every training layout implements, and what they share.

``train.py`` drives every strategy through the same few calls, once per step:

    strategy.zero_grad()
    with strategy.micro_context(last): loss = strategy.forward_backward(x, y, 1 / accum)
    strategy.sync()                 # gradients averaged (DDP buckets, ZeRO reduce-scatter)
    applied, grad_norm = strategy.apply(lr, grad_clip)

The rest of this design: docs/layers.md, "hpcdist/parallel/base.py"."""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..device import backend
from .. import optim
from ..host import timeline
from ..optim import intersect
from ..nn import placement
from ..nn.moe import held_experts, loss_multiplier


class StepRole:
    """A step: what train.py calls for every batch, in this order."""

    def zero_grad(self) -> None:
        raise NotImplementedError

    def micro_context(self, last: bool):
        """Around one micro-batch's forward and backward (``last``: the step's last one)."""
        return contextlib.nullcontext()

    def scale_loss(self, loss):
        return loss * self.scaler.scale if self.scaler.enabled else loss

    def multiplier(self, scale: float) -> float:
        """What ``scale_loss(loss * scale)`` multiplies the loss by (the gradients MoE layers
        inject for their auxiliary losses get it too)."""
        return scale * self.scaler.scale if self.scaler.enabled else scale

    def forward_backward(self, x, y, scale: float = 1.0):
        """The whole model on this rank: forward, loss (times ``scale``), backward; the loss,
        where it was computed (a device scalar is not read here: train.py reads the losses
        of several steps at once, at log steps)."""
        with timeline.span("forward"):
            _, loss = self.model(x, y)
        with timeline.span("backward"), loss_multiplier(self.multiplier(scale)):
            self.scale_loss(loss * scale).backward()
        return loss.data

    def sync(self) -> None:
        """After the last micro-batch's backward: gradients averaged over ``dp_comm``."""
        raise NotImplementedError

    def apply(self, lr: float, grad_clip: float = 0.0):
        """The optimizer step: (applied, global gradient norm), (False, None) when the loss
        scaler skips it."""
        raise NotImplementedError

    def eval_context(self):
        """Around a forward outside a step (evaluation)."""
        return contextlib.nullcontext()

    def begin(self, stop, start: int = 0) -> None:
        """After a resume, before the first step (``stop``: the run's StopRequest or None;
        ``start``: the steps already done)."""


class LoopRole:
    """Around the steps: the loss a step reports, when to stop or save, and a loop of the
    strategy's own."""

    def control_bytes(self) -> int:
        """Bytes the last ``control`` sent for the model (not the stop's agreement): the
        step's record counts them (DiLoCo meets at saves and at the end there)."""
        return 0

    #: a strategy that runs its own loop (a parameter server answering workers) sets this and
    #: implements ``run``; train.py then hands it the run instead of stepping it
    brings_loop = False

    def mean_losses(self, losses: list) -> list:
        """The losses the run reports for some steps: each the mean over the data-parallel
        ranks (one read from the device, one collective for them all)."""
        return self.dp_comm.allreduce(backend.host_values(losses), op="avg").tolist()

    def control(self, step: int, cfg, stop, comm):
        """After step ``step``: (the signal that stops the run, 0: none; the step to save a
        checkpoint under, None: no save now; whether another step follows). Collective:
        the stop request is agreed over ``comm`` every step."""
        stopped = stop.poll(comm, more=step < cfg.steps - 1) if stop is not None else 0
        save = bool(cfg.save_dir) and bool(stopped or step == cfg.steps or (
            cfg.save_every and step % cfg.save_every == 0))
        return stopped, step if save else None, step < cfg.steps and not stopped

    def run(self, stop, save, stopped: int, start: int) -> dict:
        """The whole run, for a strategy that ``brings_loop``: its final metrics."""
        raise NotImplementedError(f"{type(self).__name__} runs in train.py's loop")


class StateRole:
    """The checkpointable part: the flat state a checkpoint holds (parallel/state.py makes it
    layout-free), and what is restored into it."""

    def flat_state(self):
        """(lo, hi, {kind: flat array over this rank's flat elements [lo, hi)}, optimizer
        step count): ``param`` and ``opt.<state>``, in the order of ``model.parameters()``."""
        raise NotImplementedError

    def loaded(self, step_count: int) -> None:
        """After ``flat_state``'s arrays were filled from a checkpoint: the optimizer's step
        count, and the parameters the model computes with rebuilt from them."""
        raise NotImplementedError

    def holds_state(self) -> bool:
        """Whether this rank writes its ``flat_state`` into a checkpoint (a data-parallel
        replica without ZeRO does not: rank 0 of its group writes the copy)."""
        return True

    def own_state(self) -> dict:
        """This rank's own arrays for a checkpoint (restored only into the same layout)."""
        c = self.compression()
        return {} if c is None else {f"compress.{k}": v for k, v in c.state_dict().items()}

    def load_own_state(self, own: dict) -> None:
        c = self.compression()
        if c is not None:
            c.load_state_dict({k[len("compress."):]: v for k, v in own.items()
                               if k.startswith("compress.")})

    def add_optimizer_state(self, name: str, array) -> None:
        """Optimizer state a checkpoint brings that this run has not made yet."""
        self.optimizer().state[name] = array

    def optimizer(self):
        raise NotImplementedError

    def compression(self):
        """The gradient compressor with per-rank state to checkpoint (None: none)."""
        return None


class ReportRole:
    """What the run's header and final report say of the layout."""

    def memory(self) -> dict:
        """Bytes alive between steps: params, grads, optimizer (and total)."""
        raise NotImplementedError

    def peak_memory(self) -> dict:
        """The most bytes alive within a step."""
        return self.memory()

    def full_parameters(self):
        """Every parameter of this rank's model, flat, as the optimizer holds them."""
        raise NotImplementedError

    def describe(self) -> list[str]:
        """What the run's header says of this layout: its part of the header line first,
        then whole lines."""
        return []

    def summary(self) -> dict:
        """What the strategy adds to the final report (collective where it gathers)."""
        return {}


class Strategy(StepRole, LoopRole, StateRole, ReportRole):
    """A training layout: its four roles (each at most 8 methods). Subclasses set ``model``,
    ``dp_comm``, ``comm``, ``scaler`` and ``mesh`` (None without model parallelism) in
    their constructors."""

    model = dp_comm = comm = scaler = mesh = None

    def close(self) -> None:
        """Free the communicators the run's mesh made (collective; train() calls it last):
        a process that trains many times would run out of MPI's communicator ids."""
        if self.mesh is not None:
            self.mesh.close()

    @property
    def batch_comm(self):
        """The ranks that read different batches: ``dp_comm`` less its context-parallel
        axis (a context-parallel group reads one batch and splits each sequence)."""
        return self.mesh.batch_comm if self.mesh is not None else self.dp_comm

    @property
    def step_comm(self):
        """The ranks of ``batch_comm`` whose gradients one step averages (a token-level loss
        counts the scored tokens over them: run/loop.py ``token_weights``); None: this
        rank's gradient is applied alone."""
        return self.batch_comm


def delegate(inner: str, names):
    """A class decorator: each method in ``names`` the class does not define calls the same
    method of ``self.<inner>`` (a wrapper, such as the pipeline around its inner step, says
    which calls it passes through and writes only the ones it changes)."""

    def forward(name):
        def call(self, *args, **kwargs):
            return getattr(getattr(self, inner), name)(*args, **kwargs)
        call.__name__ = name
        return call

    def decorate(cls):
        for name in names:
            if name not in cls.__dict__:
                setattr(cls, name, forward(name))
        return cls
    return decorate


def owned(model, mesh, placed=None) -> list:
    """Per parameter, in ``model.named_specs()`` order: whether this rank owns it — counts it
    once in the global gradient norm and writes it into checkpoints — read from its declared
    placements (``placed``: nn.placement.resolve's, made here where not given): on each of
    the tensor- and expert-parallel axes a shard is its holder's, a replicated parameter
    (whole or partial gradient: summed by then) rank 0's of that axis; a copy held for a
    tied head (``model.copies()``) nobody's here."""
    copies = model.copies()
    if placed is None:
        layout = placement.Layout() if mesh is None else \
            placement.Layout(tp=mesh.tp, cp=mesh.cp, ep=mesh.ep, dp=mesh.dp, pp=mesh.pp)
        placed = placement.resolve(model, layout, held_experts(model))

    def once(where) -> bool:
        return mesh is None or all(where[axis].sharded or getattr(mesh.coord, axis) == 0
                                   for axis in ("tp", "ep"))
    return [once(where) and id(p) not in copies for _, p, where in placed]


class Norm:
    """The global gradient norm of a flat gradient (or of its shard [lo, hi)), counting each
    parameter of the one logical model once. ``count``: a bool mask over the flat elements —
    False for replicated parameters on all but one tensor-parallel rank; ``comms``: where the
    partial sums of squares are added up."""

    def __init__(self, comms=(), count=None):
        self.comms, self.count = [c for c in comms if c is not None and c.size > 1], count

    def counted(self, grad, lo: int = 0):
        """This rank's counted elements of ``grad`` (which holds [lo, lo + grad.size))."""
        return grad if self.count is None else grad[self.count[lo:lo + grad.size]]

    def sum_sq(self, grad, lo: int = 0):
        """The sum of squares of this rank's counted elements, where ``grad`` lives."""
        return optim.grad_norm_sq(self.counted(grad, lo))

    def global_norm(self, grad, lo: int = 0):
        """The norm of the whole gradient: left on the device where no other rank holds a
        part of it (nothing to add up: one launch, optim.grad_norm), else read and added up
        over ``comms``."""
        if not self.comms and backend.is_gpu_array(grad):
            return optim.grad_norm(self.counted(grad, lo))
        return math.sqrt(self.reduce(backend.host_values([self.sum_sq(grad, lo)]))[0])

    def reduce(self, sums: np.ndarray) -> np.ndarray:
        for comm in self.comms:
            sums = comm.allreduce(sums)
        return sums


class GradSum:
    """Sum the gradients of the given flat ranges over ``comm`` (sequence-parallel LayerNorms
    and biases: each tensor-parallel rank holds a partial gradient; under ZeRO with expert
    parallelism, ``scale`` 1/ep first and the dense parameters' ranges over the EP group)."""

    def __init__(self, comm, ranges, scale: float = 1.0):
        self.comm, self.ranges, self.scale = comm, ranges, scale

    def __call__(self, grad, lo: int = 0) -> None:
        """``grad`` holds the flat elements [lo, lo + grad.size)."""
        if self.scale != 1.0:
            grad *= self.scale
        if self.comm is None or self.comm.size == 1 or not self.ranges:
            return
        xp = backend.array_module(grad)
        hi = lo + grad.size
        parts = [(s - lo, e - lo) for s, e in (intersect(a, b, lo, hi) for a, b in self.ranges)
                 if s < e]
        if not parts:
            buf = xp.zeros(0, dtype=grad.dtype)
        else:
            buf = xp.concatenate([grad[a:b] for a, b in parts])
        buf = self.comm.allreduce(buf)             # every tp rank has the same ranges
        o = 0
        for a, b in parts:
            grad[a:b] = buf[o:o + b - a]
            o += b - a
