"""What each strategy, compression scheme, parallel layout and backend runs with, declared as
data: one list of refusals per feature, each a (setting it is about, check) pair whose check
returns the message when the configuration asks for what the feature cannot do, else
something false. ``config.validate`` raises the first that applies, in the order of
``REFUSALS``. Pure: importing this starts nothing (no MPI), so a login node can check a job.
"""
from __future__ import annotations

from . import schedules


def _pipeline_plan(c) -> str | None:
    """The schedule and split a pipeline of these settings would run, tried (the registry)."""
    try:
        schedules.make(c.schedule, c.pp, c.micro_batches or 2 * c.pp, c.virtual_stages)
        split = [int(n) for n in c.pp_split.split(",")] if c.pp_split else None
        schedules.partition(c.n_layer, c.pp * c.virtual_stages, split)
    except ValueError as e:
        return str(e)
    return None


class ZeroShape:
    """What a ZeRO level splits over its group and moves each step, declared by the level's
    class (parallel/zero.py, zero3.py inherit these) and read by the planner (plan/) without
    MPI: ``sharded``, of params, grads and optimizer; ``traffic``, the gradient sync's bytes
    over DDP's allreduce (a reduce-scatter and an allgather move what one allreduce does);
    ``calls_per_block``, its extra calls per transformer block. Level 0: plain DDP."""
    level = 0
    sharded: tuple = ()
    traffic: float = 1.0
    calls_per_block: int = 0


class Zero1Shape(ZeroShape):
    level, sharded = 1, ("optimizer",)


class Zero2Shape(Zero1Shape):
    level, sharded = 2, ("grads", "optimizer")


class Zero3Shape(ZeroShape):
    level, sharded = 3, ("params", "grads", "optimizer")
    traffic = 1.5                 # the parameters gathered twice (forward, backward): 3 psi
    calls_per_block = 3           # two allgathers and a reduce-scatter


ZERO_SHAPES = {s.level: s for s in (ZeroShape, Zero1Shape, Zero2Shape, Zero3Shape)}


ZERO = [   # parallel/zero.py: ZeRO 1-3 over the data-parallel group (DP x CP)
    ("zero", lambda c: c.zero not in (0, 1, 2, 3) and
     f"--zero must be 0, 1, 2 or 3, got {c.zero}"),
    ("zero", lambda c: c.zero and c.compress != "none" and
     f"--zero {c.zero} reduce-scatters dense gradients; gradient compression runs with "
     "--zero 0 only"),
]

TENSOR = [   # parallel/tp: heads, MLP width and vocabulary split over tp ranks
    ("tp", lambda c: c.tp < 1 and f"--tp must be >= 1, got {c.tp}"),
    ("tp", lambda c: c.n_head % c.tp and
     f"--tp {c.tp} must divide n_head ({c.n_head}): each tensor-parallel rank holds an "
     "equal share of the heads"),
    ("tp", lambda c: _kv_heads(c) % c.tp and
     f"--tp {c.tp} must divide n_kv_head ({_kv_heads(c)}): each tensor-parallel rank holds "
     f"whole kv heads (Megatron's rule); use a --tp dividing {_kv_heads(c)}, or more kv "
     "heads"),
    ("tp", lambda c: c.experts == 0 and _ffn(c) % c.tp and
     f"--tp {c.tp} must divide the MLP's width {_ffn(c)} (its columns split over the "
     "tensor-parallel ranks): a --tp that divides it, or (rotary families) --ffn-hidden "
     "a multiple of --tp"),
]


def _declared(c):
    """The family's config of the settings (nn/<family>.py): what its model will be."""
    from .. import nn
    return nn.config_of(c, vocab_size=1, vocab_multiple=1)


def _kv_heads(c) -> int:
    return _declared(c).attention_shape().n_kv_head


def _kinded_problem(c) -> str | None:
    """Why --cp cannot run these layers: the first whose attention is not the plain causal
    softmax (a scale of its own, a cap, a window, sinks: a family's ``scores``)."""
    cfg = _declared(c)
    for i in range(cfg.n_layer if hasattr(cfg, "scores") else 0):
        s = cfg.scores(i)
        if s != type(s)():
            return (f"--cp {c.cp}: layer {i}'s attention is {s}; ring attention and Ulysses "
                    "carry no scale of a family's own, cap, window or sinks yet: run without "
                    "--cp")
    return None


def _ffn(c) -> int:
    """The dense MLP's width, as the family declares it."""
    return _declared(c).mlp_width()

PIPELINE = [   # parallel/pipeline.py: the stages, a verified schedule
    ("pp", lambda c: (c.pp < 1 or c.virtual_stages < 1 or c.micro_batches < 0) and
     "--pp and --virtual-stages must be >= 1, --micro-batches >= 0"),
    ("pp", lambda c: c.pp > 1 and c.zero > 1 and
     f"--zero {c.zero} with --pp would reduce-scatter each stage's gradients after every "
     "micro-batch (ZeRO-3: gather its parameters for each too), m times ZeRO-1's traffic; "
     "like Megatron-LM and DeepSpeed, pipelines run with --zero 0 or 1 (docs/zero.md)"),
    ("micro_batches", lambda c: c.pp > 1 and c.batch_size < (c.micro_batches or 2 * c.pp) and
     f"--batch-size {c.batch_size} is split into {c.micro_batches or 2 * c.pp} "
     "micro-batches: it must be at least that"),
    ("pp", lambda c: c.pp > 1 and _pipeline_plan(c)),
    ("pp", lambda c: c.pp == 1 and (c.schedule != "1f1b" or c.virtual_stages != 1 or
                                    c.pp_split or c.micro_batches) and
     "--schedule, --virtual-stages, --pp-split and --micro-batches are for pipelines: add "
     "--pp P (P > 1)"),
]

CONTEXT = [   # parallel/context.py: each sequence split over cp ranks, attention too
    ("cp", lambda c: c.cp < 1 and f"--cp must be >= 1, got {c.cp}"),
    ("cp", lambda c: c.cp == 1 and c.cp_impl != "ring" and
     "--cp-impl is for context parallelism: add --cp N (N > 1)"),
    ("cp", lambda c: c.cp > 1 and c.cp_impl == "ulysses" and
     (_kv_heads(c) // max(c.tp, 1)) % c.cp
     and f"--cp-impl ulysses splits the {_kv_heads(c) // max(c.tp, 1)} kv heads each "
         f"tensor-parallel rank holds (n_kv_head / tp; each with its queries) over --cp "
         f"{c.cp}: cp must divide them; use --cp-impl ring, or a cp dividing "
         f"{_kv_heads(c) // max(c.tp, 1)}"),
    ("cp", lambda c: c.cp > 1 and _kinded_problem(c)),
    ("cp", lambda c: c.cp > 1 and c.strategy == "ps" and
     f"--cp {c.cp} does not run with --strategy ps (parameter servers run plain data "
     "parallelism)"),
    ("sequence_parallel", lambda c: c.sequence_parallel and c.tp == 1 and
     "--sequence-parallel splits activations over the tensor-parallel group: it needs "
     "--tp > 1"),
]

NCCL = [   # comm/nccl.py: every group's device arrays over NCCL, host values over MPI
    ("backend", lambda c: c.backend == "nccl" and c.device not in ("gpu", "standin") and
     "--backend nccl needs --device gpu (NCCL moves GPU memory; --device standin runs its "
     "stand-in)"),
    ("backend", lambda c: c.backend == "nccl" and c.compress in ("topk", "fp16") and
     f"--compress {c.compress} runs on the MPI backend ("
     + ("the Top-K exchange is an allgatherv of (index, value) pairs of sizes only the "
        "ranks know" if c.compress == "topk" else "NCCL reduces in the array's own dtype: "
        "no fp16 wire") + "); with --backend nccl use --compress none or powersgd"),
]


def _moe_problem(c) -> str | None:
    if c.experts < 0 or c.ep < 1 or c.moe_every < 1 or c.shared_experts < 0 or \
            c.expert_hidden < 0:
        return ("--experts, --shared-experts and --expert-hidden must be >= 0, --ep and "
                "--moe-every >= 1")
    if c.experts == 0:
        return (c.ep > 1 or c.shared_experts or c.expert_hidden) and \
            "--ep, --shared-experts and --expert-hidden are for mixture-of-experts models: " \
            "add --experts E"
    if not 1 <= c.top_k <= c.experts:
        return f"--top-k {c.top_k} must be between 1 and the {c.experts} experts"
    if c.ep > 1 and c.experts % c.ep:
        return f"--ep {c.ep} must divide the {c.experts} experts (each rank an equal share)"
    if c.capacity_factor < 0 or c.aux_loss_coef < 0 or c.z_loss_coef < 0 or c.bias_rate < 0:
        return ("--capacity-factor (0: dropless), --aux-loss-coef, --z-loss-coef and "
                "--bias-rate must be >= 0")
    if c.balance == "bias" and c.router != "sigmoid":
        return "--balance bias steers the sigmoid router (DeepSeek-V3): add --router sigmoid"
    return None


def _moe_drops(c) -> str | None:
    """What mixture of experts does not compose with yet (each: not built, not impossible)."""
    if not c.experts:
        return None
    for bad, why in ((c.sequence_parallel, "--sequence-parallel (the experts run whole on "
                      "every rank of the tensor-parallel group, over all of its tokens)"),
                     (c.cp > 1 and c.capacity_factor > 0, "--capacity-factor with --cp (drops "
                      "follow global token order; context-parallel ranks hold slices)"),
                     (c.compress != "none", "--compress"),
                     (c.strategy == "ps", "--strategy ps")):
        if bad:
            return (f"--experts runs with data, expert, tensor, pipeline and context "
                    f"parallelism, ZeRO, recompute, accumulation and mixed precision; {why} "
                    "with experts is not built yet")
    return None


EXPERTS = [   # nn/moe.py, parallel/expert.py: experts, and EP over the all-to-all
    ("experts", _moe_problem),
    ("experts", _moe_drops),
]


def _ps_drops(c) -> str | None:
    for bad, why in ((c.zero, "--zero"), (c.tp > 1, "--tp"), (c.pp > 1, "--pp"),
                     (c.compress != "none", "--compress"),
                     (c.precision != "fp32", f"--precision {c.precision}"),
                     (c.backend != "mpi", f"--backend {c.backend}")):
        if bad:
            return (f"--strategy ps (parameter servers) runs plain data parallelism in "
                    f"fp32/fp64 over MPI: drop {why}")
    return None


PARAMETER_SERVER = [   # parallel/ps.py: workers and servers, plain data parallelism
    ("strategy", lambda c: c.strategy == "ps" and _ps_drops(c)),
    ("servers", lambda c: c.strategy == "ps" and (c.servers < 1 or c.max_staleness < -1) and
     f"--servers must be >= 1 and --max-staleness >= -1 (-1: unbounded), got {c.servers} "
     f"and {c.max_staleness}"),
    ("servers", lambda c: c.strategy != "ps" and (c.servers != 1 or c.max_staleness != -1)
     and "--servers and --max-staleness are for --strategy ps"),
]

OUTER = ("group_size", "inner_steps", "outer_lr", "outer_momentum", "outer_nesterov",
         "fragments", "outer_overlap", "outer_wire", "outer_mix")


def _diloco_problem(c) -> str | None:
    if c.strategy != "diloco":
        default = type(c)()
        given = [k for k in OUTER if getattr(c, k) != getattr(default, k)]
        return given and (f"--{given[0].replace('_', '-')} is for --strategy diloco")
    if c.inner_steps < 1 or c.fragments < 1 or c.group_size < 0 or c.outer_overlap < 0:
        return ("--inner-steps and --fragments must be >= 1, --group-size and --outer-overlap "
                ">= 0")
    if c.outer_lr <= 0 or not 0 <= c.outer_momentum < 1 or not 0 <= c.outer_mix <= 1:
        return (f"need --outer-lr > 0, 0 <= --outer-momentum < 1 and 0 <= --outer-mix <= 1, "
                f"got {c.outer_lr}, {c.outer_momentum}, {c.outer_mix}")
    if c.fragments > c.inner_steps:
        return (f"--fragments {c.fragments} meet H / fragments steps apart: at most "
                f"--inner-steps ({c.inner_steps})")
    if c.outer_overlap and c.outer_overlap >= c.inner_steps // c.fragments:
        return (f"--outer-overlap {c.outer_overlap} must be below H / fragments = "
                f"{c.inner_steps // c.fragments}: one fragment in flight at a time")
    for bad, why in ((c.pp > 1, "--pp (the loss lives on the last stage: the outer loop's "
                                "batches and losses are not wired through the stages)"),
                     (c.cp > 1, "--cp (a context group reads one batch: not wired through "
                                "the outer loop)"),
                     (c.ep > 1, "--ep (the experts' groups would cross the replica groups)"),
                     (c.backend != "mpi", f"--backend {c.backend} (its groups have never run "
                                          "on a GPU)")):
        if bad:
            return (f"--strategy diloco runs DDP, ZeRO or TP inside each group; {why.split(' (')[0]}"
                    f" inside a group is not built: {why.split(' (', 1)[1][:-1]}")
    return None


def _hybrid_problem(c) -> str | None:
    if c.shard_group == "all":
        return c.shard_size and "--shard-size is for --shard-group node"
    if not c.zero:
        return "--shard-group node shards ZeRO's state inside each node: add --zero 1, 2 or 3"
    if c.shard_size < 0:
        return f"--shard-size must be >= 0 (0: one node's ranks), got {c.shard_size}"
    for bad, why in ((c.tp > 1, "--tp"), (c.pp > 1, "--pp"), (c.cp > 1, "--cp"),
                     (c.ep > 1, "--ep"), (c.backend != "mpi", f"--backend {c.backend}")):
        if bad:
            return (f"--shard-group node (hybrid sharding) runs ZeRO over data parallelism "
                    f"only; {why} with it is not built")
    return None


def world_problem(c, world: int):
    """(message, setting) where the replica groups do not cut this world or the straggler
    is not in it, else None (config.validate_world)."""
    if c.straggler and int(c.straggler.split(":")[0]) >= world:
        return (f"--straggler rank {c.straggler.split(':')[0]} is not a rank of a world of "
                f"{world}", "straggler")
    model = c.tp * c.pp * c.cp
    for name, size in (("group_size", c.group_size), ("shard_size", c.shard_size)):
        if size and (world % size or size % model):
            return (f"--{name.replace('_', '-')} {size} must divide the world size {world} "
                    f"and be a multiple of tp x pp x cp = {model}", name)
    return None


GROUPS = [   # parallel/groups.py, diloco.py: layouts in replica groups
    ("strategy", _diloco_problem),
    ("shard_group", _hybrid_problem),
]


def _shrink_problem(c) -> str | None:
    """--on-failure shrink: data parallelism recovers from the state every replica holds, a
    sharded layout from its buddies' memory (--mirror-every, run/mirror.py); compression's
    state (and a mirror switched off) from the last checkpoint (needs --save-dir). Over
    NCCL too: a death aborts the NCCL communicators and the survivors build new ones."""
    if c.on_failure != "shrink":
        return (c.shrink_batch != "scale" or c.respawn) and \
            "--shrink-batch and --respawn are for --on-failure shrink"
    if c.strategy != "collective":
        return (f"--on-failure shrink with --strategy {c.strategy} is not built; run with "
                "--on-failure abort")
    if c.respawn and c.backend == "nccl":
        return ("--respawn with --backend nccl is not built (a new process would need the "
                "lost rank's GPU); --on-failure shrink without --respawn goes on over the "
                "survivors' GPUs")
    replicated = c.zero == 0 and c.tp * c.pp * c.cp * c.ep == 1 and c.compress == "none" \
        and c.shard_group == "all"
    mirrored = c.mirror_every > 0 and c.compress == "none"
    if not replicated and not mirrored and not c.save_dir:
        return ("--on-failure shrink: this layout shards its state (" +
                ("compression's residuals" if c.compress != "none" else "--mirror-every 0") +
                "), so the survivors restore from the last checkpoint: add --save-dir")
    return None


FAILURES = [   # comm/ulfm.py, run/recovery.py: in-job recovery
    ("on_failure", _shrink_problem),
]

MIXED_PRECISION = [   # parallel/mixed_precision.py: fp32 master weights
    ("precision", lambda c: c.precision != "fp32" and c.dtype == "fp64" and
     f"--precision {c.precision} keeps fp32 master weights; it cannot be combined with "
     "--dtype fp64"),
]


def graph_problem(c) -> str | None:
    """Why a CUDA graph cannot hold this run's forward and backward (None: it can): a graph
    replays kernels at fixed addresses with the arguments of its capture, so nothing inside
    may read the device from the host, take a host value that changes (dropout's seeds,
    fp16's loss scale) or talk to another rank over MPI; DDP averages the gradients after
    backward instead."""
    return ("mixture of experts routes by counts the host reads (--experts)" if c.experts else
            "attention's GEMM path runs batched GEMMs through CuPy, whose cuBLAS calls refuse "
            "a capture (--attention auto leaves it out)" if c.attention == "gemms" else
            "dropout's random offsets are host values a graph would freeze (--dropout)"
            if c.dropout else
            "fp16's dynamic loss scale is a host value a graph would freeze (--precision bf16 "
            "needs no scale)" if c.precision == "fp16" else
            "tensor, pipeline and context parallelism talk to other ranks inside forward and "
            "backward" if c.tp * c.pp * c.cp > 1 else
            f"--zero {c.zero} moves shards inside the step" if c.zero else
            f"--strategy {c.strategy} is not built with it" if c.strategy != "collective" else
            f"--compress {c.compress} is not built with it" if c.compress != "none" else
            "--on-failure shrink rebuilds the layout a graph holds" if c.on_failure == "shrink"
            else None)


def _cuda_graph_problem(c) -> str | None:
    """--cuda-graph on (run/graphed.py) where a graph cannot hold the step: refused (auto
    is not: the run says why it stays eager)."""
    why = graph_problem(c) if c.cuda_graph == "on" else None
    return why and f"--cuda-graph: {why}; run without --cuda-graph"


CUDA_GRAPH = [   # run/graphed.py: forward and backward replayed as one CUDA graph
    ("cuda_graph", _cuda_graph_problem),
]

REFUSALS = MIXED_PRECISION + NCCL[:1] + ZERO + TENSOR + PIPELINE + CONTEXT + NCCL[1:] + \
    PARAMETER_SERVER + EXPERTS + GROUPS + FAILURES + CUDA_GRAPH
