"""The training-strategy interface, and the strategies built behind it from a configuration.

``train.py`` drives every strategy through the same few calls, once per step:

    step.zero_grad()
    with step.micro_context(last): loss = model(x, y); step.scale_loss(loss).backward()
    step.sync()                         # gradients averaged (DDP buckets, ZeRO reduce-scatter)
    applied, grad_norm = step.apply(lr, grad_clip)
    step.memory(); step.full_parameters()     # checkpoints: parallel/state.py

and reads ``step.model``, ``step.data_comm`` (the ranks that split the data: each reads other
samples), ``step.comm`` (the gradient communicator, for byte counts) and ``step.scaler``.

Strategies: ``DataParallelStep`` (DDP + mixed precision, ``--zero 0``), ``parallel.zero.Zero``
(stages 1-3), and tensor parallelism, which is either of the first two over the data-parallel
group of a DP x TP mesh with a tensor-parallel GPT inside, plus two duties of its own:
``Norm`` (count each parameter once in the global gradient norm: shards summed over the
tensor-parallel group, replicated parameters once) and the sum of sequence-parallel gradients
over that group.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .. import backend, nn, optim, timeline
from ..comm.mesh import ProcessMesh
from .compression import make_compression
from .ddp import DistributedDataParallel
from .mixed_precision import LossScaler, MixedPrecision


class Norm:
    """The global gradient norm of a flat gradient (or of its shard [lo, hi)), counting each
    parameter of the one logical model once. ``count``: a bool mask over the flat elements —
    False for replicated parameters on all but one tensor-parallel rank; ``comms``: where the
    partial sums of squares are added up."""

    def __init__(self, comms=(), count=None):
        self.comms, self.count = [c for c in comms if c is not None and c.size > 1], count

    def sum_sq(self, grad, lo: int = 0) -> float:
        g = grad if self.count is None else grad[self.count[lo:lo + grad.size]]
        return optim.grad_norm_sq(g)

    def reduce(self, sums: np.ndarray) -> np.ndarray:
        for comm in self.comms:
            sums = comm.allreduce(sums)
        return sums


class GradSum:
    """Sum the gradients of the given flat ranges over ``comm`` (sequence-parallel LayerNorms
    and biases: each tensor-parallel rank holds a partial gradient)."""

    def __init__(self, comm, ranges):
        self.comm, self.ranges = comm, ranges

    def __call__(self, grad, lo: int = 0) -> None:
        """``grad`` holds the flat elements [lo, lo + grad.size)."""
        if self.comm is None or self.comm.size == 1 or not self.ranges:
            return
        xp = backend.array_module(grad)
        hi = lo + grad.size
        parts = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in self.ranges if a < hi and b > lo]
        if not parts:
            buf = xp.zeros(0, dtype=grad.dtype)
        else:
            buf = xp.concatenate([grad[a:b] for a, b in parts])
        buf = self.comm.allreduce(buf)             # every tp rank has the same ranges
        o = 0
        for a, b in parts:
            grad[a:b] = buf[o:o + b - a]
            o += b - a


def forward_backward(step, x, y, scale: float = 1.0) -> float:
    """The whole model on this rank: forward, loss (times ``scale``), backward; the loss."""
    with timeline.span("forward"):
        _, loss = step.model(x, y)
    with timeline.span("backward"):
        step.scale_loss(loss * scale).backward()
    return float(loss.data)


class DataParallelStep:
    """The plain data-parallel path (``--zero 0``): DDP + mixed precision + a full optimizer."""

    def __init__(self, model, ddp, opt, mp, data_comm, norm=None, grad_sum=None):
        self.model, self.ddp, self.opt, self.mp = model, ddp, opt, mp
        self.data_comm = data_comm
        self.comm = ddp.comm                       # the gradient communicator (bytes count)
        self.scaler = mp.scaler
        self.norm, self.grad_sum = norm or Norm(), grad_sum

    def zero_grad(self):
        self.mp.zero_grad()

    def forward_backward(self, x, y, scale: float = 1.0) -> float:
        return forward_backward(self, x, y, scale)

    def micro_context(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def scale_loss(self, loss):
        return self.mp.scale_loss(loss)

    def sync(self):
        self.ddp.sync_gradients()
        if self.grad_sum is not None:
            self.grad_sum(self.mp.master.grad)

    def apply(self, lr: float, grad_clip: float = 0.0):
        overflow = self.mp.unscale_and_check(self.data_comm) if self.scaler.enabled else False
        if not self.scaler.update(overflow):
            return False, None
        grad = self.mp.master.grad
        norm = math.sqrt(self.norm.reduce(np.array([self.norm.sum_sq(grad)]))[0])
        scale = optim.clip_scale(norm, grad_clip) if grad_clip else 1.0
        if scale < 1.0:
            grad *= scale
        self.opt.step(lr)
        self.mp.copy_master_to_compute()
        return True, norm

    def eval_context(self):
        return contextlib.nullcontext()

    def memory(self) -> dict:
        """Bytes alive in parameters, gradients and optimizer state (compute + master)."""
        mp = self.mp
        params = mp.compute.data.nbytes
        # mixed precision: the fp32 master weights count as optimizer state (the ZeRO paper's
        # K), and DDP averages into an fp32 gradient beside the compute gradient
        grads = mp.compute.grad.nbytes + (mp.master.grad.nbytes if mp.mixed else 0)
        state = sum(v.nbytes for v in self.opt.state.values() if hasattr(v, "nbytes")) + \
            (mp.master.data.nbytes if mp.mixed else 0)
        return {"params": params, "grads": grads, "optimizer": state,
                "total": params + grads + state}

    peak_memory = memory                            # nothing here changes size in a step

    def full_parameters(self):
        return self.mp.master.data


def make_optimizer_factory(cfg):
    # With DGC the momentum lives in the compressor; the optimizer must not add its own.
    momentum = 0.0 if cfg.compress == "topk" and cfg.compress_momentum else cfg.momentum

    def make_optimizer(flat):
        if cfg.optimizer == "adamw":
            return optim.AdamW(flat, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                               weight_decay=cfg.weight_decay)
        return optim.SGD(flat, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)
    return make_optimizer


def build_strategy(cfg, comm, train_set):
    """The model and the training step for this rank (collective over ``comm``)."""
    from .zero import Zero
    backend.set_default_float("float64" if cfg.dtype == "fp64" else "float32")
    backend.reset_precision()
    model_parallel = cfg.tp > 1 or cfg.pp > 1
    mesh = ProcessMesh(comm, dp=comm.size // (cfg.tp * cfg.pp), tp=cfg.tp, pp=cfg.pp) \
        if model_parallel else None
    dp_comm = mesh.dp_comm if mesh else comm
    nn.manual_seed(cfg.seed)                         # the same model on every rank
    # Dropout streams per data-parallel replica and stage: the ranks of one tensor-parallel
    # group draw the same masks for the activations they all hold.
    backend.seed(cfg.seed + 1000 * (mesh.coord.dp * cfg.pp + mesh.coord.pp if mesh
                                    else comm.rank))
    model = nn.GPT(nn.GPTConfig(
        block_size=train_set.block_size, vocab_size=train_set.vocab_size, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
        tie_weights=cfg.tie_weights, checkpoint_activations=cfg.checkpoint_activations))
    if cfg.tp > 1:
        from .tp import TensorParallelGPT
        model = TensorParallelGPT(model, mesh.tp_comm, cfg.sequence_parallel)
    full, embed_comm = model, None
    if cfg.pp > 1:
        from .pipeline import PipelineModel, partition
        split = [int(n) for n in cfg.pp_split.split(",")] if cfg.pp_split else None
        bounds = partition(cfg.n_layer, cfg.pp * cfg.virtual_stages, split)
        model = PipelineModel(full, mesh.coord.pp, cfg.pp, cfg.virtual_stages, bounds)
        if cfg.tie_weights:                          # the first and the last stage share wte
            ends = mesh.coord.pp in (0, cfg.pp - 1)
            embed_comm = mesh.pp_comm.split(color=0 if ends else 1)   # collective over pp
            if not ends:                               # the middle stages hold no table
                embed_comm.close()
                embed_comm = None
    norm, grad_sum = Norm(), None
    if mesh is not None:
        count, ranges, off = [], [], 0
        partial = {id(p) for p in full.sequence_parallel_params()} if cfg.tp > 1 else set()
        head_copy = cfg.pp > 1 and cfg.tie_weights and mesh.coord.pp == cfg.pp - 1
        specs = model.named_specs() if hasattr(model, "named_specs") else \
            [(n, p, None) for n, p in model.named_parameters()]
        for name, p, spec in specs:
            # count each parameter of the one model once: replicated ones on tensor-parallel
            # rank 0, the tied table on the first stage
            once = (spec is not None or mesh.coord.tp == 0) and not (
                head_copy and name == "wte.weight")
            count.append(np.full(p.size, once))
            if id(p) in partial:
                ranges.append((off, off + p.size))
            off += p.size
        norm = Norm([dp_comm if cfg.zero else None, mesh.tp_comm, mesh.pp_comm],
                    np.concatenate(count))
        grad_sum = GradSum(mesh.tp_comm, ranges) if ranges else None
    elif cfg.zero:
        norm = Norm([dp_comm])
    scaler = LossScaler(init_scale=cfg.loss_scale, enabled=cfg.precision == "fp16")
    make_optimizer = make_optimizer_factory(cfg)
    if cfg.zero:
        low = None if cfg.precision == "fp32" else backend.compute_dtype(cfg.precision)
        step = Zero(model, dp_comm, cfg.zero, make_optimizer, compute_dtype=low, scaler=scaler,
                    bucket_mb=cfg.bucket_mb, first_bucket_mb=cfg.first_bucket_mb,
                    norm=norm, grad_sum=grad_sum)
        step.model, step.data_comm, step.mesh = model, dp_comm, mesh
    else:
        mp = MixedPrecision(model.parameters(), cfg.precision, scaler)
        compression = make_compression(cfg.compress, cfg.density, cfg.compress_momentum,
                                       cfg.compress_clip, cfg.density_warmup)
        grad_comm = dp_comm
        if cfg.backend == "nccl":                  # gradients over NCCL, the rest over MPI
            from ..comm.nccl import NcclCommunicator
            grad_comm = NcclCommunicator(dp_comm.mpi)
        ddp = DistributedDataParallel(model, grad_comm, flat=mp.master, compute=mp.compute,
                                      bucket_mb=cfg.bucket_mb,
                                      first_bucket_mb=cfg.first_bucket_mb,
                                      overlap=cfg.overlap and cfg.pp == 1,
                                      compression=compression)
        step = DataParallelStep(model, ddp, make_optimizer(mp.master), mp, dp_comm, norm,
                                grad_sum)
        step.mesh = mesh
    if cfg.pp > 1:
        from .pipeline import PipelineStep
        step = PipelineStep(step, model, mesh, cfg.schedule, cfg.micro_batches or 2 * cfg.pp,
                            cfg.virtual_stages, embed_comm)
    return model, step
