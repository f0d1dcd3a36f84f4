"""The strategies built from a configuration: ``build_strategy`` makes this rank's mesh,
model and training step (the interface is parallel/base.py), one concern per function.

Strategies: ``DataParallelStrategy`` (DDP + mixed precision, ``--zero 0``), ``parallel.zero.Zero``
(stages 1-3), and tensor parallelism, which is either of the first two over the data-parallel
group of a DP x TP mesh with a tensor-parallel GPT inside, plus two duties of its own:
``Norm`` (count each parameter once in the global gradient norm: shards summed over the
tensor-parallel group, replicated parameters once) and the sum of sequence-parallel gradients
over that group (``GradSum``); pipelines wrap either in ``pipeline.PipelineStrategy``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..device import backend, fp8, kernels
from .. import nn, optim
from ..autograd.lazy_zero import settle_grads
from ..comm import ulfm
from ..comm.mesh import ProcessMesh
from ..host.layout import Layout
from ..comm.nccl import make_communicator
from ..nn import lora, placement
from .base import GradSum, Norm, Strategy, owned
from .compression import make_compression
from .context import apply_context_parallel
from .ddp import DistributedDataParallel
from .mixed_precision import LossScaler, MixedPrecision
from .expert import apply_expert_parallel
from ..nn.moe import held_experts, moe_layers
from .pipeline import PipelineModel, PipelineStrategy
from .schedules import partition
from .sequence import sequence_of
from .tp import apply_tensor_parallel
from .tp.probe import check_placements
from .zero3 import LEVELS as ZERO_LEVELS

__all__ = ["Strategy", "DataParallelStrategy", "Norm", "GradSum", "build_strategy"]


class DataParallelStrategy(Strategy):
    """The plain data-parallel path (``--zero 0``): DDP + mixed precision + a full optimizer."""

    def __init__(self, model, ddp, opt, mp, dp_comm, norm=None, *, grad_sum=None, mesh=None):
        self.model, self.ddp, self.opt, self.mp = model, ddp, opt, mp
        mp.attach(opt)                             # the optimizer writes the compute copy
        self.dp_comm, self.mesh = dp_comm, mesh
        self.comm = ddp.comm                       # the gradient communicator (bytes count)
        self.scaler = mp.scaler
        self.norm, self.grad_sum = norm or Norm(), grad_sum

    def zero_grad(self):
        self.mp.zero_grad()

    def micro_context(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def scale_loss(self, loss):
        return self.mp.scale_loss(loss)

    def sync(self):
        settle_grads()                 # (zero_grad is lazy: a step with no backward reads zeros)
        self.ddp.sync_gradients()
        if self.grad_sum is not None:
            self.grad_sum(self.mp.master.grad)

    def apply(self, lr: float, grad_clip: float = 0.0):
        overflow = self.mp.unscale_and_check([self.dp_comm] + self.norm.comms) \
            if self.scaler.enabled else False
        ulfm.commit()           # every survivor applies this step, or none (--on-failure shrink)
        if not self.scaler.update(overflow):
            return False, None
        grad = self.mp.master.grad
        norm = self.norm.global_norm(grad)
        self.opt.step(lr, clipping=(norm, grad_clip))      # (AdamW's kernel clips as it reads)
        self.mp.after_step()
        return True, norm

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

    def full_parameters(self):
        return self.mp.master.data

    def flat_state(self):
        arrays = {"param": self.mp.master.data}
        arrays.update({f"opt.{k}": v for k, v in self.opt.state.items()})
        return 0, self.mp.master.data.size, arrays, self.opt.step_count

    def optimizer(self):
        return self.opt

    def loaded(self, step_count: int) -> None:
        self.opt.step_count = step_count
        self.mp.copy_master_to_compute()

    def describe(self) -> list[str]:
        c = self.ddp.compression
        return [f"compress {c.name}" + (f" rank {c.rank}" if c.name == "powersgd" else "")]

    def compression(self):
        return self.ddp.compression

    def holds_state(self) -> bool:
        """Replicas: rank 0 of the group writes (under EP: of the ranks holding its experts)."""
        ep = self.mesh is not None and self.mesh.ep > 1
        return (self.mesh.expert_dp_comm if ep else self.dp_comm).rank == 0


def make_optimizer_factory(cfg):
    # With DGC the momentum lives in the compressor; the optimizer must not add its own.
    momentum = 0.0 if cfg.compress == "topk" and cfg.compress_momentum else cfg.momentum

    def make_optimizer(flat):
        if cfg.optimizer == "adamw":
            return optim.AdamW(flat, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                               weight_decay=cfg.weight_decay)
        return optim.SGD(flat, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)
    return make_optimizer


def make_mesh(cfg, comm):
    """The DP x CP x TP x PP process mesh (None for plain data parallelism)."""
    layout = Layout.of(cfg, comm.size)
    if layout.plain:
        return None
    return ProcessMesh(comm, dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                       ep=layout.ep, backend=cfg.backend)


def make_model(cfg, comm, mesh, train_set):
    """The one logical model, seeded alike on every rank, cut for tensor parallelism; the
    dropout stream per data-parallel replica and stage (the ranks of one tensor-parallel
    group draw the same masks for the activations they all hold)."""
    backend.set_default_float("float64" if cfg.dtype == "fp64" else "float32")
    backend.reset_precision()
    why = fp8.fp8_cores_problem() if cfg.precision == "fp8" else None
    if why:
        raise backend.DeviceError(f"--precision fp8: {why}; use --precision bf16")
    fp8.set_linears(cfg.precision == "fp8")   # (every strategy's: ZeRO makes no MixedPrecision)
    kernels.configure(cfg.tf32)
    kernels.attention.configure(cfg.attention, graphs=cfg.cuda_graph != "off")
    if cfg.attention == "cudnn" and kernels.cudnn_attention.why_not():
        raise backend.DeviceError(f"--attention cudnn: {kernels.cudnn_attention.why_not()}")
    nn.manual_seed(cfg.seed)
    replica = mesh.coord.dp * cfg.ep + mesh.coord.ep if mesh else comm.rank   # its batches
    backend.seed(cfg.seed + 1000 * (replica * cfg.pp + mesh.coord.pp if mesh else replica))
    block = train_set.block_size
    if cfg.init_from:                              # a pretrained folder: its positions
        from ..checkpoint import hf
        block = hf.shape(cfg.init_from)["block_size"]
    model = nn.build(cfg.arch, **model_fields(cfg, cfg.arch, block_size=block,
                                              vocab_size=train_set.vocab_size))
    if cfg.init_from:                              # the same on every rank, before any cut
        model.load_state_dict(hf.params(cfg.init_from, model.config,
                                        [n for n, _ in model.named_parameters()]))
    placement.check_declared(model)                # (every parameter says how it lies)
    if cfg.tp > 1:                                 # modules swapped for parallel ones
        apply_tensor_parallel(model, mesh.tp_comm, cfg.sequence_parallel)
        if cfg.precision != "fp8":                 # (fp8's scales would count the probe)
            check_placements(model, mesh.tp_comm, cfg.sequence_parallel)
    if getattr(train_set, "packed", False):        # rows of several documents (nn/packing.py)
        if cfg.cp > 1:
            raise ValueError("packed rows under context parallelism (--cp) are not built "
                             "yet: pass --packing off (a padded row per document)")
        model.packed = True
    if cfg.cp > 1:                                 # each rank: a slice of every sequence
        apply_context_parallel(model, mesh.cp_comm, cfg.cp_impl)
    if cfg.lora_rank or cfg.adapter:               # adapters on the cut layers, the rest frozen
        low = None if cfg.precision == "fp32" else backend.compute_dtype(cfg.precision)
        from ..checkpoint import peft
        spec, tensors, where = peft.of_settings(cfg)
        lora.apply(model, nn.family(cfg.arch), model.config, spec, tensors=tensors,
                   where=where, dtype=low, nf4=cfg.base_dtype == "nf4")
    return model


def vocab_multiple(cfg) -> int:
    """The rows the token table and head are padded to a multiple of: the setting, or where
    it is 0, 64 on a GPU (cuBLAS's tensor-core kernels want the head's width a multiple of
    8 and run best at 64; GPT-2's 50,257 otherwise falls back to older kernels) and 1 on the
    CPU (BLAS takes any width: padding would only add work)."""
    setting = cfg.get("vocab_multiple") if isinstance(cfg, dict) else cfg.vocab_multiple
    if setting:
        return setting
    return 1 if backend.device_label() == "cpu" else 64


def model_fields(cfg, arch: str, **given) -> dict:
    """The fields of family ``arch``'s config that a TrainConfig (or a checkpoint's meta
    dict) sets, with ``given`` on top; ``vocab_multiple`` 0 resolved for this device."""
    import dataclasses
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    config_cls = nn.FAMILIES[arch].config
    out = {f.name: get(f.name) for f in dataclasses.fields(config_cls)
           if get(f.name) is not None}
    if out.get("vocab_multiple") == 0:
        out["vocab_multiple"] = vocab_multiple(cfg)
    out.update(given)
    return out


def place_experts(cfg, mesh, model, dp_comm):
    """Every MoE layer's load counted over the ranks that hold other tokens (``dp_comm``:
    data, expert and context parallel; a tensor-parallel group's ranks see the same tokens);
    under --ep, this rank's share of the experts (returns the parameters only it holds).
    Under sequence parallelism the tensor-parallel ranks hold other rows too: the load is
    counted over them as well, while the gradients are averaged over ``dp_comm`` only (and
    summed over the tensor-parallel group: the experts' placement is partial there)."""
    group = dp_comm
    if mesh is not None and cfg.tp > 1 and cfg.sequence_parallel:
        group = mesh.group("dp", "ep", "cp", "tp")
    for m in moe_layers(model):
        m.group, m.averaged = group, dp_comm.size
    if cfg.ep == 1:
        return []
    return apply_expert_parallel(model, mesh.ep_comm)[1]


def make_stage(cfg, mesh, full):
    """This rank's pipeline stage of ``full``, and the communicator over the first and last
    stages that share a tied embedding (None where this rank holds no copy)."""
    split = [int(n) for n in cfg.pp_split.split(",")] if cfg.pp_split else None
    bounds = partition(cfg.n_layer, cfg.pp * cfg.virtual_stages, split)
    seq = sequence_of(full) if cfg.cp > 1 or cfg.sequence_parallel else None
    model = PipelineModel(full, mesh.coord.pp, cfg.pp, cfg.virtual_stages, bounds, seq)
    embed_comm = None
    if cfg.tie_weights:                              # the first and the last stage share the table
        ends = mesh.coord.pp in (0, cfg.pp - 1)
        embed_comm = mesh.pp_comm.split(color=0 if ends else 1)   # collective over pp
        if not ends:                                   # the middle stages hold no table
            embed_comm.close()
            embed_comm = None
    return model, embed_comm


def norm_and_grad_sum(cfg, mesh, model, shard_comm):
    """How the global gradient norm counts each parameter of the one model once (ZeRO's
    shards over ``shard_comm``), and which gradients are summed over another group after
    the average, both read from each parameter's declared placement (nn/placement.py): a
    gradient partial over the tensor-parallel axis (a norm over this rank's heads; under
    sequence parallelism everything replicated on the residual stream) is summed over the
    tensor-parallel group; under ZeRO with EP the dense parameters over the expert-parallel
    group."""
    if mesh is None:
        return Norm([shard_comm] if cfg.zero else []), None
    layout = placement.Layout(tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, cp=cfg.cp,
                              ep=cfg.ep, dp=mesh.dp, pp=cfg.pp)
    placed = placement.resolve(model, layout, held_experts(model))
    count, ranges, dense, off = [], [], [], 0
    for (name, p, where), once in zip(placed, owned(model, mesh, placed)):
        count.append(np.full(p.size, once))
        if where["tp"].partial:
            ranges.append((off, off + p.size))
        if not where["ep"].sharded:
            dense.append((off, off + p.size))
        off += p.size
    norm = Norm([shard_comm if cfg.zero else None, mesh.tp_comm, mesh.pp_comm, mesh.ep_comm],
                np.concatenate(count))
    if cfg.zero and cfg.ep > 1:      # shards over dp x cp, averaged there: the rest over ep
        return norm, GradSum(mesh.ep_comm, dense, scale=1.0 / cfg.ep)
    return norm, GradSum(mesh.tp_comm, ranges) if ranges else None


def build_parameter_server(cfg, comm, train_set):
    """``--strategy ps``: workers [0, W), servers [W, world) (parallel/ps.py)."""
    from .ps import PSServer, PSWorker, roles
    worker = comm.rank < roles(comm.size, cfg.servers)
    model = make_model(cfg, comm, None, train_set)
    sub = comm.split(color=0 if worker else 1)       # the workers; the servers
    if worker:
        return model, PSWorker(model, comm, sub, cfg.servers)
    return model, PSServer(model, comm, sub, make_optimizer_factory(cfg), cfg.servers,
                           cfg.max_staleness, cfg=cfg)


def build_groups(cfg, comm, train_set):
    """``--strategy diloco`` or ``--shard-group node``: a layout in every replica group, the
    groups joined by DiLoCo's outer loop or by hybrid sharding's gradient average."""
    from dataclasses import replace
    from .groups import Replicated, replica_groups, reseed, world_batches
    diloco = cfg.strategy == "diloco"
    groups = replica_groups(comm, cfg.group_size if diloco else cfg.shard_size)
    inside = replace(cfg, strategy="collective") if diloco else replace(cfg, shard_group="all")
    model, inner = build_strategy(inside, groups.inner, train_set)
    batches = world_batches(comm, groups, inner)
    reseed(cfg, batches)
    if not diloco:
        return model, Replicated(inner, comm, groups, batches)
    from .diloco import DiLoCo, Outer
    # the group's ranks that hold the same elements split each exchange between them
    replicas = inner.dp_comm if not cfg.zero else inner.cross if cfg.shard_group == "node" \
        else None
    return model, DiLoCo(inner, comm, groups, batches, Outer(
        cfg.inner_steps, cfg.outer_lr, cfg.outer_momentum, cfg.outer_nesterov, cfg.fragments,
        cfg.outer_overlap, cfg.outer_wire, cfg.outer_mix, cfg.steps), replicas)


def build_strategy(cfg, comm, train_set):
    """The model and the training strategy for this rank (collective over ``comm``)."""
    if cfg.strategy == "ps":
        return build_parameter_server(cfg, comm, train_set)
    if cfg.strategy == "diloco" or cfg.shard_group == "node":
        return build_groups(cfg, comm, train_set)
    mesh = make_mesh(cfg, comm)
    # under --backend nccl every group's device arrays go over NCCL (host values over MPI)
    dp_comm = mesh.dp_comm if mesh else comm if cfg.backend == "mpi" else \
        make_communicator(cfg.backend, host=comm, label="dp")
    full = model = make_model(cfg, comm, mesh, train_set)
    embed_comm = None
    if cfg.pp > 1:
        model, embed_comm = make_stage(cfg, mesh, full)
    experts = place_experts(cfg, mesh, model, dp_comm)
    # ZeRO under EP shards over the ranks holding the same experts (their flat vectors are
    # alike); the dense parameters' gradients are then summed over the EP group too
    shard_comm = mesh.expert_dp_comm if cfg.zero and cfg.ep > 1 else dp_comm
    norm, grad_sum = norm_and_grad_sum(cfg, mesh, model, shard_comm)
    # NCCL runs a stream's calls in the order they are issued; under EP the backward graphs
    # differ by routing, so gradient buckets launched as they fill would interleave with the
    # experts' all-to-all differently on each rank (a deadlock): they launch after backward
    in_order = cfg.backend == "nccl" and cfg.ep > 1
    scaler = LossScaler(init_scale=cfg.loss_scale, enabled=cfg.precision == "fp16")
    make_optimizer = make_optimizer_factory(cfg)
    if cfg.zero:
        low = None if cfg.precision == "fp32" else backend.compute_dtype(cfg.precision)
        strategy = ZERO_LEVELS[cfg.zero](model, shard_comm, make_optimizer, compute_dtype=low,
                                         scaler=scaler, bucket_mb=cfg.bucket_mb,
                                         first_bucket_mb=cfg.first_bucket_mb, norm=norm,
                                         grad_sum=grad_sum, mesh=mesh, overlap=not in_order)
    else:
        mp = MixedPrecision(model.parameters(), cfg.precision, scaler)
        compression = make_compression(cfg.compress, cfg.density, cfg.compress_momentum,
                                       cfg.compress_clip, cfg.density_warmup, cfg.powersgd_rank,
                                       start_step=cfg.powersgd_start)
        ddp = DistributedDataParallel(model, dp_comm, flat=mp.master, compute=mp.compute,
                                      bucket_mb=cfg.bucket_mb,
                                      first_bucket_mb=cfg.first_bucket_mb,
                                      overlap=cfg.overlap and cfg.pp == 1 and not in_order,
                                      compression=compression, experts=experts,
                                      expert_comm=mesh.expert_dp_comm if experts else None)
        strategy = DataParallelStrategy(model, ddp, make_optimizer(mp.master), mp, dp_comm,
                                        norm, grad_sum=grad_sum, mesh=mesh)
    if cfg.pp > 1:
        strategy = PipelineStrategy(strategy, model, mesh, cfg.schedule,
                                    cfg.micro_batches or 2 * cfg.pp, cfg.virtual_stages,
                                    embed_comm=embed_comm)
    return model, strategy
