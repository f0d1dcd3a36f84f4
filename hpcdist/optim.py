"""Optimizers as update rules on flat arrays, LR schedules, and gradient-norm clipping.

An optimizer packs its parameters into one contiguous buffer (``FlatParams``): each
parameter's ``.data`` and ``.grad`` become views into ``flat.data`` and ``flat.grad``. The
update rule (``sgd_update``, ``adamw_update``) then runs once over the flat arrays — few,
large NumPy calls instead of one small call per tensor — and ZeRO can run the very same rule
on a shard ``[lo, hi)`` of those arrays. Semantics follow torch.optim.SGD and torch.optim.AdamW.
"""
from __future__ import annotations

import math

import numpy as np

from .device import backend, kernels
from .device.kernels import adamw as adamw_kernels, cpu as cpu_kernels, cpu_flat
from .autograd.lazy_zero import forget_grads, settle_grads, zeroed_grads


class FlatParams:
    """Parameters packed into one flat ``data`` array and one flat ``grad`` array.

    ``offsets[i]`` is where parameter i starts; ``decay_ranges`` lists the merged [lo, hi)
    ranges whose parameters take weight decay (matrices, not biases or norms, as in GPT-2).
    """

    def __init__(self, params, decay=lambda p: p.ndim >= 2):
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the optimizer's list")
        xp = backend.array_module(params[0].data)
        dtype = params[0].data.dtype
        total = sum(p.size for p in params)
        self.data = xp.empty(total, dtype=dtype)
        self.grad = xp.zeros(total, dtype=dtype)
        self.params, self.offsets = params, []
        ranges, off = [], 0
        for p in params:
            n = p.size
            self.data[off:off + n] = p.data.reshape(-1)
            p.data = self.data[off:off + n].reshape(p.shape)
            p.grad = self.grad[off:off + n].reshape(p.shape)
            if decay(p):
                if ranges and ranges[-1][1] == off:
                    ranges[-1] = (ranges[-1][0], off + n)
                else:
                    ranges.append((off, off + n))
            self.offsets.append(off)
            off += n
        self.decay_ranges = ranges
        self.size = total
        self._views = [p.grad for p in params]      # what zero_grad(lazy) checks is still so

    def zero_grad(self, lazy: bool = False) -> None:
        """Every gradient zero: by a pass over ``grad``, or (``lazy``) by its next write —
        autograd's ``forget_grads``, no pass; until the next backward() or step() ends, the
        ``.grad`` arrays hold the last step's values: for the training loop, which reads and
        writes them only through autograd. Lazy where each ``.grad`` is still its view here,
        and on the host only: on a device each buffer an op can only add into (a bias's, a
        norm's) would cost a launch to zero at its first write (8 a GPT layer), where one pass
        over all of them is one launch (and little of the GPU's bandwidth)."""
        views = getattr(self, "_views", None)      # (a shard's or master copy's: none)
        ours = views and all(p.grad is v for p, v in zip(self.params, views))
        if lazy and ours and not backend.is_gpu_array(self.grad):
            forget_grads(self.params)
        else:
            self.grad[...] = 0
            if ours:                                 # (a GEMM's epilogue may write them)
                zeroed_grads(self.params)


def intersect(a: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    """The flat range [a, b) cut to [lo, hi): (start, end), empty when start >= end (the one
    place this is written: shards, checkpoints and reshards all cut ranges so)."""
    return max(a, lo), min(b, hi)


def decay_ranges_in(ranges, lo: int, hi: int):
    """``ranges`` clipped to the shard [lo, hi), shifted to start at 0 (for ZeRO shards)."""
    out = []
    for a, b in ranges:
        a, b = intersect(a, b, lo, hi)
        if a < b:
            out.append((a - lo, b - lo))
    return out


# ---- update rules on flat arrays ---------------------------------------------------------------

def sgd_update(p, g, state: dict, step: int, lr: float, momentum=0.0, *, dampening=0.0,
               nesterov=False, weight_decay=0.0, decay_ranges=None) -> None:
    """One SGD step in place (torch.optim.SGD semantics: L2 decay is added to the gradient)."""
    if weight_decay:
        g = g.copy()
        for a, b in (decay_ranges if decay_ranges is not None else [(0, p.size)]):
            g[a:b] += weight_decay * p[a:b]
    if momentum:
        buf = state.get("momentum")
        if buf is None or step == 1:
            buf = state["momentum"] = g.copy()
        else:
            buf *= momentum
            buf += (1.0 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    p -= lr * g


def adamw_update(p, g, state: dict, step: int, lr: float, beta1=0.9, *, beta2=0.999, eps=1e-8,
                 weight_decay=0.0, decay_ranges=None, low=None, schedule=None,
                 clipping=None) -> bool:
    """One AdamW step in place: bias-corrected moments, decoupled weight decay. ``low``: a
    bf16 array the device kernel also writes the new parameters into (mixed precision's
    compute copy); True when it did (else the caller copies). ``schedule``: a
    DeviceSchedule whose step count and learning rate the step advances and reads on the
    device (``step`` and ``lr`` are then not used). ``clipping``: (norm, max_norm), the
    gradient clipped first as ``clip`` clips it: by the fused kernel as it reads ``g`` (no
    pass over it; ``g`` is left as it was) where that kernel runs and the norm is where it
    runs, else by ``clip`` in place."""
    xp = backend.array_module(p)
    if "exp_avg" not in state:
        state["exp_avg"] = xp.zeros_like(p)
        state["exp_avg_sq"] = xp.zeros_like(p)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    gpu = backend.is_gpu_array(p)
    fused = schedule is not None or (gpu or cpu_kernels.wanted(p)) and g.dtype == p.dtype
    norm, max_norm = clipping or (None, 0.0)
    if max_norm and not (fused and _kernel_clips(norm, gpu)):
        clip(g, norm, max_norm)
        norm, max_norm = None, 0.0
    if schedule is not None:
        return schedule.adamw(p, g, m, v, _decay_mask(p.size, decay_ranges), (beta1, beta2),
                              eps=eps, weight_decay=weight_decay, low=low,
                              clipping=(norm, max_norm))
    if gpu and _writes_low(p, g, low):
        kernels.ADAMW_LOW(p, g, m, v, _decay_mask(p.size, decay_ranges), lr, beta1, beta2,
                          eps, weight_decay, step, norm, max_norm, low)
        return True
    if fused:
        # one fused kernel on the device, or a threaded one on a large host buffer
        kernels.ADAMW(p, g, m, v, _decay_mask(p.size, decay_ranges), lr, beta1, beta2, eps,
                      weight_decay, step, norm, max_norm)
        return False
    if weight_decay:
        for a, b in (decay_ranges if decay_ranges is not None else [(0, p.size)]):
            p[a:b] *= 1.0 - lr * weight_decay
    bias1 = 1.0 - beta1 ** step
    bias2 = 1.0 - beta2 ** step
    if g.dtype != p.dtype:               # a gradient of another dtype: NumPy's promotions
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * (g * g)
        denom = xp.sqrt(v)
        denom /= math.sqrt(bias2)
        denom += eps
        p -= (lr / bias1) * (m / denom)
        return False
    kernels.adam_step_twin(p, g, m, v, lr, beta1, beta2, eps, step)   # the fused one's twin
    return False


def _kernel_clips(norm, gpu: bool) -> bool:
    """Whether AdamW's fused kernel takes the clipping by ``norm``: on a device, a norm there
    (one float64: it reads it, nothing is read to the host); on the host, a host number."""
    if not gpu:
        return not backend.is_gpu_array(norm)
    return backend.is_gpu_array(norm) and adamw_kernels.reads_norm(norm)


def _writes_low(p, g, low) -> bool:
    """Whether AdamW's own kernel can write the bf16 compute copy ``low`` of fp32 ``p``."""
    return low is not None and g.dtype == p.dtype == np.float32 and \
        low.dtype.name == "bfloat16" and low.shape == p.shape and low.flags.c_contiguous


_MASKS: dict = {}


def _decay_mask(n: int, decay_ranges) -> object:
    """A device uint8 mask of the elements in ``decay_ranges`` (all when None), made once."""
    key = (n, None if decay_ranges is None else tuple(map(tuple, decay_ranges)),
           backend.device_label())
    mask = _MASKS.get(key)
    if mask is None:
        import numpy as np
        host = np.zeros(n, dtype=np.uint8)
        for a, b in (decay_ranges if decay_ranges is not None else [(0, n)]):
            host[a:b] = 1
        mask = _MASKS[key] = backend.to_device(host)
    return mask


class DeviceSchedule:
    """The step count and learning rate on the device, for a step replayed as a CUDA graph
    (run/graphed.py), where a host value would stay what it was at the capture:
    ``state`` = [step, lr, 1 - beta1^step, sqrt(1 - beta2^step)] (float64), advanced by one
    kernel (``LR_SCHEDULE``: lr_at's warmup and cosine) and read by AdamW's own
    (``ADAMW_SCHED``, ``ADAMW_LOW_SCHED``). ``host_step`` is the step count the device holds,
    as the host knows it without reading it (``sync`` sets it to the optimizer's)."""

    def __init__(self, base_lr: float, warmup: int, total: int, min_lr: float = 0.0):
        self.base_lr, self.warmup, self.total, self.min_lr = base_lr, warmup, total, min_lr
        self.state = backend.to_device(np.zeros(4, dtype=np.float64))
        self.host_step = 0

    def sync(self, step_count: int) -> None:
        """The device's step count set to ``step_count`` (a copy in: outside a capture)."""
        if step_count != self.host_step:
            self.state[...] = backend.to_device(np.array([step_count, 0, 0, 0], np.float64))
            self.host_step = step_count

    def adamw(self, p, g, m, v, decay, betas, *, eps: float, weight_decay: float,
              low=None, clipping=(None, 0.0)) -> bool:
        """The next step's schedule, then AdamW reading it; True when ``low`` was written.
        ``clipping``: (norm, max_norm), the norm on the device (AdamW's kernel clips)."""
        beta1, beta2 = betas
        if g.dtype != p.dtype:
            raise TypeError(f"a scheduled AdamW step takes a {p.dtype} gradient for {p.dtype} "
                            f"parameters, not {g.dtype}")
        kernels.LR_SCHEDULE(self.state, self.base_lr, self.min_lr, self.warmup, self.total,
                            beta1, beta2)
        if _writes_low(p, g, low):
            kernels.ADAMW_LOW_SCHED(p, g, m, v, decay, self.state, beta1, beta2, eps,
                                    weight_decay, *clipping, low)
            return True
        kernels.ADAMW_SCHED(p, g, m, v, decay, self.state, beta1, beta2, eps, weight_decay,
                            *clipping)
        return False


# ---- optimizers ----------------------------------------------------------------------------------

class Optimizer:
    """Holds the flat buffers, the per-buffer state and the step count; subclasses pick a rule."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0):
        """``params``: a list of Parameters, or a FlatParams already made (by DDP)."""
        if lr < 0:
            raise ValueError(f"learning rate must be non-negative, got {lr}")
        self.flat = params if isinstance(params, FlatParams) else FlatParams(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.state: dict = {}
        self.step_count = 0
        # mixed precision: an array (the compute copy, bf16) that each step leaves holding the
        # new parameters in its dtype (AdamW writes it in its own kernel; others copy)
        self.copy_into = None

    def zero_grad(self, lazy: bool = False) -> None:
        """FlatParams.zero_grad (``lazy``: zero by the next write, as the training loop has it)."""
        self.flat.zero_grad(lazy)

    def step(self, lr: float | None = None, clipping=None) -> None:
        """Apply one update with ``lr`` (the base lr unless a schedule passes one).
        ``clipping``: (the gradient's global norm, max_norm): the gradient clipped first, as
        ``clip`` clips it (AdamW's kernels scale it as they read it, leaving it as it was)."""
        settle_grads()                       # zero_grad with no backward since: zeros
        self.step_count += 1
        wrote = self.update(self.flat.data, self.flat.grad, self.state, self.step_count,
                            self.lr if lr is None else lr, self.flat.decay_ranges,
                            clipping=clipping)
        if self.copy_into is not None and not wrote:
            self.copy_into[...] = self.flat.data

    def update(self, p, g, state, step, lr, decay_ranges, *, clipping=None) -> bool:
        """The rule, in place on ``p`` (``g`` clipped first by ``clipping``); True when it
        also wrote ``copy_into``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Host arrays of the optimizer state plus the step count."""
        out = {f"state.{k}": backend.to_numpy(v).copy() for k, v in self.state.items()}
        out["step_count"] = self.step_count
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step_count"])
        self.state = {k[len("state."):]: backend.to_device(v) for k, v in sd.items()
                      if k.startswith("state.")}


class SGD(Optimizer):
    def __init__(self, params, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening 0")
        super().__init__(params, lr, weight_decay)
        self.momentum, self.dampening, self.nesterov = momentum, dampening, nesterov

    def update(self, p, g, state, step, lr, decay_ranges, *, clipping=None):
        if clipping is not None:
            clip(g, *clipping)
        sgd_update(p, g, state, step, lr, self.momentum, dampening=self.dampening,
                   nesterov=self.nesterov, weight_decay=self.weight_decay,
                   decay_ranges=decay_ranges)


class AdamW(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        for b in betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Adam betas must be in [0, 1), got {betas}")
        super().__init__(params, lr, weight_decay)
        self.betas, self.eps = tuple(betas), eps
        self.schedule: DeviceSchedule | None = None   # step and lr on the device (graphs)

    def update(self, p, g, state, step, lr, decay_ranges, *, clipping=None) -> bool:
        return adamw_update(p, g, state, step, lr, self.betas[0], beta2=self.betas[1],
                            eps=self.eps, weight_decay=self.weight_decay,
                            decay_ranges=decay_ranges, low=self.copy_into,
                            schedule=self.schedule, clipping=clipping)


# ---- schedule and clipping -------------------------------------------------------------------

def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr`` at ``total``.

    ``step`` counts from 1 (the first update).
    """
    if warmup > 0 and step <= warmup:
        return base_lr * step / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def grad_norm_sq(flat_grad):
    """Sum of squared gradient entries (ranks add theirs up for a global norm): a 0-d array
    where the gradient lives (not read from a device here)."""
    if backend.device_label() == "cpu" and flat_grad.ndim == 1 \
            and cpu_kernels.wanted(flat_grad) and flat_grad.flags.c_contiguous:
        try:
            return np.asarray(cpu_flat.sumsq(flat_grad))      # one pass in float64, no copy
        except ImportError:                                    # numba broken: as below
            pass
    if _one_launch(flat_grad):
        return kernels.GRAD_NORM(flat_grad)[0]
    g = flat_grad.astype("float64", copy=False) if flat_grad.dtype.itemsize < 4 else flat_grad
    return (g * g).sum()


def grad_norm(flat_grad):
    """The L2 norm of one rank's whole gradient where it lives: on a device a 0-d float64
    array, in one launch (kernels.GRAD_NORM), not read; on the host a float."""
    if _one_launch(flat_grad):
        return kernels.GRAD_NORM(flat_grad)[1]
    sq = grad_norm_sq(flat_grad)
    if backend.is_gpu_array(sq):
        return backend.array_module(sq).sqrt(sq.astype("float64"))
    return math.sqrt(float(sq))


def _one_launch(flat_grad) -> bool:
    """Whether GRAD_NORM takes ``flat_grad`` on this device: a flat contiguous array there."""
    return backend.is_gpu_array(flat_grad) and flat_grad.ndim == 1 and \
        flat_grad.flags.c_contiguous


def clip(grad, norm, max_norm: float) -> None:
    """Scale ``grad`` in place so that a gradient of global ``norm`` has norm at most
    ``max_norm`` (0: no clipping). A norm still on the device is used there (no read).
    (AdamW's kernels clip as they read the gradient: ``Optimizer.step``'s ``clipping``.)"""
    factor = kernels.clip_factor(norm, max_norm)
    if factor is None:
        return
    if backend.is_gpu_array(factor):
        grad *= factor.astype(grad.dtype)
    elif not _scaled_on_threads(grad, factor):
        grad *= factor


def _scaled_on_threads(grad, scale: float) -> bool:
    """``grad *= scale`` by the CPU kernel on the rank's threads, where it takes ``grad`` and
    ``scale`` is a Python float (NumPy multiplies in grad's type then, as the kernel does)."""
    if backend.device_label() != "cpu" or type(scale) is not float:
        return False
    try:
        return cpu_flat.scale(grad, scale)
    except ImportError:                                        # numba broken: NumPy's
        return False


def clip_grad_norm(flat_grad, max_norm: float) -> float:
    """Scale ``flat_grad`` in place so its L2 norm is at most ``max_norm`` (0: no clipping);
    return the old norm."""
    norm = math.sqrt(float(grad_norm_sq(flat_grad)))
    clip(flat_grad, norm, max_norm)
    return norm
