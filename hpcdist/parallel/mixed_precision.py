"""Mixed precision: low-precision compute copies, fp32 master weights, dynamic loss scaling.

The model's Parameters hold fp16 or bf16 compute copies (forward and backward run in that
dtype); the optimizer owns an fp32 master copy of the same flat vector. Each step: the loss
is multiplied by the scale before backward; DDP casts each bucket of compute gradients into
the fp32 master gradient and averages there; the master gradient is unscaled and checked for
inf/nan — an overflow on any rank (agreed with our allreduce) skips the step on every rank and
backs the scale off; otherwise the optimizer updates the master weights and they are cast
back into the compute copies. bf16 has fp32's exponent range, so it runs without scaling.
"""
from __future__ import annotations

import numpy as np

from ..device import backend, fp8
from ..optim import FlatParams

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


def averaging(buf, size: int) -> str:
    """The op that averages gradients ``buf`` over ``size`` ranks: fp16 is divided by the
    world first (in place) and summed, PyTorch DDP's pre-division, so the sum cannot overflow
    where the average would not (fp16 ends at 65,504: the dynamic loss scale would settle a
    factor ``size`` lower, and the small gradients underflow sooner); else "avg"."""
    if size > 1 and buf.dtype == np.float16:
        buf /= size
        return "sum"
    return "avg"


class LossScaler:
    """Dynamic loss scale (PyTorch GradScaler / Megatron semantics, with hysteresis).

    After ``growth_interval`` steps without overflow the scale grows by ``growth_factor``; an
    overflow uses up one unit of ``hysteresis`` and, once none is left, multiplies the scale by
    ``backoff_factor``. Every overflowing step is skipped.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 enabled: bool = True):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1")
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.enabled = enabled
        self.good_steps = 0
        self.hysteresis_left = hysteresis
        self.skipped = 0

    def update(self, overflow: bool) -> bool:
        """Record a step's outcome; return True when the step may be applied."""
        if not self.enabled:
            return not overflow
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale *= self.backoff_factor
                self.hysteresis_left = self.hysteresis
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
            self.hysteresis_left = self.hysteresis
        return True

    def state_dict(self) -> dict:
        return {k: np.array(getattr(self, k)) for k in
                ("scale", "good_steps", "hysteresis_left", "skipped")}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        for k in ("good_steps", "hysteresis_left", "skipped"):
            setattr(self, k, int(sd[k]))


class MasterParams(FlatParams):
    """An fp32 copy of a FlatParams' vector, not bound to any Parameter (the optimizer's)."""

    def __init__(self, compute: FlatParams, dtype="float32"):   # noqa: no super(): no binding
        xp = backend.array_module(compute.data)
        self.data = compute.data.astype(dtype)
        self.grad = xp.zeros(compute.size, dtype=dtype)
        self.decay_ranges, self.offsets, self.size = compute.decay_ranges, compute.offsets, compute.size
        self.params = compute.params


class MixedPrecision:
    """Compute copies in ``precision`` bound to the model; fp32 ``master`` for the optimizer.

    For "fp32" nothing is copied: ``compute`` and ``master`` are the same FlatParams.
    """

    _writer = None          # the optimizer that writes the compute copy (``attach``)

    def __init__(self, params, precision: str = "fp32", scaler: LossScaler | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        params = list(params)
        fp8.set_linears(precision == "fp8")      # fp8: bf16, the linear layers' GEMMs in fp8
        low = backend.compute_dtype(precision)   # bf16 without CuPy bf16: float32, emulated
        if low == np.float32:
            self.compute = self.master = FlatParams(params)
            self.scaler = LossScaler(enabled=False)
            return
        master_values = [p.data.astype(np.float32) for p in params]
        for p in params:                           # the model now computes in ``low``
            p.data = p.data.astype(low)
        self.compute = FlatParams(params)
        self.master = MasterParams(self.compute)
        for off, v in zip(self.compute.offsets, master_values):   # exact fp32 values,
            self.master.data[off:off + v.size] = v.reshape(-1)         # not rounded ones
        self.scaler = scaler or LossScaler(enabled=(precision == "fp16"))

    @property
    def mixed(self) -> bool:
        return self.compute is not self.master

    def scale_loss(self, loss):
        return loss * self.scaler.scale if self.scaler.enabled else loss

    def zero_grad(self) -> None:
        """The compute gradient zeroed by its next write (the training loop's); the master's
        is not zeroed at all: DDP writes every bucket of it from the compute gradient at each
        sync (a pass over 4 bytes a parameter, and a launch, saved)."""
        self.compute.zero_grad(lazy=True)

    def unscale_and_check(self, comms) -> bool:
        """Unscale the (averaged) master gradient; True if any rank saw inf/nan, agreed over
        every communicator of ``comms`` (data-parallel, then tensor and pipeline groups: a
        stage's overflow skips the step on every stage)."""
        g = self.master.grad
        if self.scaler.enabled:
            g *= 1.0 / self.scaler.scale
        bad = not bool(backend.array_module(g).isfinite(g).all())
        flag = np.array([1.0 if bad else 0.0])
        for comm in comms:
            flag = comm.allreduce(flag, op="max")
        return bool(flag[0] > 0)

    def copy_master_to_compute(self) -> None:
        if self.mixed:
            self.compute.data[...] = self.master.data     # (cast on assignment: one pass)

    def attach(self, opt) -> None:
        """``opt`` (over ``master``) writes the compute copy as it steps: on a GPU AdamW's
        own kernel rounds each new parameter to bf16 beside the fp32 one (no second pass
        over the weights); ``after_step`` then has nothing left to do."""
        self._writer = opt if self.mixed else None
        if self._writer is not None:
            opt.copy_into = self.compute.data

    def after_step(self) -> None:
        """After the optimizer's step: the compute copy holds the new weights."""
        if self.mixed and self._writer is None:
            self.copy_master_to_compute()
