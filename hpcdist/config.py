"""Training configuration: a dataclass with typed overrides from TOML and flags.

Settings come from ``TrainConfig`` defaults, then a TOML file (``--config``), then flags; every
field is a flag (``n_layer`` -> ``--n-layer``) and a TOML key. ``validate`` rejects settings that
cannot work before any rank does any work; ``ConfigError`` carries the one-line message.
"""
from __future__ import annotations

import argparse
import codecs
import math
import os
from dataclasses import dataclass, fields

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from . import backend


@dataclass
class TrainConfig:
    # task
    task: str = "sort"            # sort | reverse | text
    data: str = ""                # text file for task 'text'
    data_encoding: str = "utf-8"  # its encoding (decoded strictly: bad bytes are an error)
    length: int = 6               # digits per sequence (sort/reverse)
    num_digits: int = 10          # digit alphabet size (sort/reverse)
    block_size: int = 64          # context length (text)
    tokenizer: str = ""           # text: a Hugging Face tokenizer.json (default: characters;
                                  # token shards: the one beside them)
    vocab_size: int = 0           # text: raw uint16 shards' vocabulary size
    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    checkpoint_activations: bool = False  # recompute each block's activations in backward
    init_from: str = ""           # a Hugging Face GPT-2 folder: its shape and weights
    # optimization
    steps: int = 600
    batch_size: int = 64          # per rank
    optimizer: str = "adamw"      # adamw | sgd
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    momentum: float = 0.9         # sgd only
    grad_clip: float = 1.0        # 0 disables
    grad_accum: int = 1           # micro-batches per step (communication on the last only)
    scale_lr: bool = False        # multiply lr by the world size (linear scaling, with warmup)
    # data parallelism
    bucket_mb: float = 25.0       # gradient bucket size
    first_bucket_mb: float = 1.0  # the first bucket (last layers) is smaller: starts earlier
    overlap: bool = True          # average buckets during backward
    compress: str = "none"        # none | fp16 | topk | powersgd
    density: float = 0.01         # topk: fraction of each bucket sent
    compress_momentum: float = 0.9  # topk: DGC momentum correction (the optimizer then runs
                                  # without momentum of its own)
    compress_clip: float = 0.0    # topk: local gradient clipping norm (0 disables)
    density_warmup: int = 0       # topk: steps of DGC's exponential density warm-up
    powersgd_rank: int = 4        # powersgd: rank of each matrix's approximation (rank 1
                                  # lost 12 points on the default task, rank 4 none)
    powersgd_start: int = 0       # powersgd: dense steps first (PyTorch's start_powerSGD_iter)
    precision: str = "fp32"       # fp32 | fp16 | bf16 compute (fp32 master weights)
    loss_scale: float = 65536.0   # fp16: initial dynamic loss scale
    backend: str = "mpi"          # mpi | nccl (nccl: GPU only)
    zero: int = 0                 # ZeRO stage: 0 (plain DDP), 1, 2 or 3
    strategy: str = "collective"  # collective (DDP/ZeRO/TP/PP) | ps (parameter servers)
    servers: int = 1              # ps: server ranks (the last ones)
    max_staleness: int = -1       # ps: a worker waits when s clocks ahead of the slowest
                                  # (0: synchronous, = DDP; -1: never waits)
    # model parallelism
    tp: int = 1                   # tensor-parallel size (data-parallel size = world / tp)
    sequence_parallel: bool = False  # split LayerNorm/dropout activations along the sequence
    pp: int = 1                   # pipeline stages (data-parallel size = world / (tp x pp))
    micro_batches: int = 0        # micro-batches per batch in the pipeline (0: 2 x pp)
    schedule: str = "1f1b"        # gpipe | 1f1b | interleaved | zb-h1
    virtual_stages: int = 1       # model chunks per rank (interleaved)
    pp_split: str = ""            # blocks per stage, e.g. "2,2,1" ("" = as even as possible)
    cp: int = 1                   # context-parallel size: each sequence split over cp ranks
    cp_impl: str = "ring"         # ring (K/V blocks round a ring) | ulysses (all-to-all)
    # checkpoints
    save_dir: str = ""            # where checkpoints go ("" = none)
    save_every: int = 0           # steps between checkpoints (0 = only at the end)
    resume: bool = False          # continue from the latest checkpoint in save_dir
    overwrite: bool = False       # a fresh run into a save_dir holding another run's
                                  # checkpoints moves them aside (never deletes them)
    # run
    seed: int = 1337
    timeout: float = 0.0          # seconds any rank may wait on another before the job ends
                                  # with a report (0: $HPCDIST_TIMEOUT, else 300)
    device: str = "cpu"           # cpu | gpu | auto
    dtype: str = "fp32"           # fp32 | fp64 (master precision; fp64 for exactness tests)
    log_every: int = 50
    eval_batch: int = 512
    out_dir: str = "runs"
    # observability
    trace: str = ""               # write a Chrome trace of every rank to this file
    comm_log: bool = False        # print per-collective timings next to the alpha-beta model
    trace_memory: bool = False    # measure activation memory per step (memtrace; slower)
    straggler: str = ""           # "RANK:MS": that rank sleeps MS ms in every step (a slow
                                  # worker, for benchmarks)
    allow_singletons: bool = False  # run although the launcher promised more ranks than
                                    # MPI started (each task a world of one)


class ConfigError(ValueError):
    """A setting that cannot work; reported as one line, exit code 2. ``field``: the setting
    it is about, where there is one (parse_config names the file a TOML value came from)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


POSITIVE = ("length", "num_digits", "block_size", "n_layer", "n_head", "n_embd", "steps",
            "batch_size", "log_every", "eval_batch", "grad_accum", "bucket_mb", "first_bucket_mb",
            "loss_scale")
CHOICES = {"task": ("sort", "reverse", "text"), "optimizer": ("adamw", "sgd"),
           "device": backend.DEVICES, "dtype": ("fp32", "fp64"),
           "compress": ("none", "fp16", "topk", "powersgd"),
           "precision": ("fp32", "fp16", "bf16"),
           "backend": ("mpi", "nccl"), "strategy": ("collective", "ps"),
           "cp_impl": ("ring", "ulysses")}


def validate(cfg: TrainConfig) -> None:
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.type == "float" and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number, got {value}", f.name)
    for name in POSITIVE:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}", name)
    from .parallel.schedules import SCHEDULES     # the registry (pure: no MPI)
    for name, choices in list(CHOICES.items()) + [("schedule", SCHEDULES)]:
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"unknown {name} {getattr(cfg, name)!r}: choose one of "
                              f"{', '.join(choices)}", name)
    if cfg.timeout < 0:
        raise ConfigError(f"timeout must be >= 0 seconds (0: the default), got {cfg.timeout}",
                          "timeout")
    try:
        codecs.lookup(cfg.data_encoding)
    except LookupError:
        raise ConfigError(f"unknown data_encoding {cfg.data_encoding!r} (e.g. utf-8, latin-1)",
                          "data_encoding") from None
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})",
                          "n_embd")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}", "dropout")
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0, got lr={cfg.lr} min_lr={cfg.min_lr}",
                          "lr")
    if cfg.warmup < 0 or cfg.grad_clip < 0 or cfg.weight_decay < 0:
        raise ConfigError("warmup, grad_clip and weight_decay must be non-negative", "warmup")
    if cfg.task == "text" and not cfg.data:
        raise ConfigError("task 'text' needs a data file: --data PATH", "task")
    if cfg.vocab_size < 0:
        raise ConfigError(f"--vocab-size must be >= 0, got {cfg.vocab_size}", "vocab_size")
    if (cfg.tokenizer or cfg.vocab_size) and cfg.task != "text":
        raise ConfigError("--tokenizer and --vocab-size are for --task text", "tokenizer")
    if cfg.data and cfg.task != "text":
        raise ConfigError(f"--data is for task 'text'; task {cfg.task!r} is generated, "
                          "drop --data or pass --task text", "data")
    if not 0.0 < cfg.density <= 1.0:
        raise ConfigError(f"density must be in (0, 1], got {cfg.density}", "density")
    if not 0.0 <= cfg.compress_momentum < 1.0:
        raise ConfigError(f"compress_momentum must be in [0, 1), got {cfg.compress_momentum}",
                          "compress_momentum")
    if cfg.save_every < 0 or cfg.density_warmup < 0 or cfg.compress_clip < 0 \
            or cfg.powersgd_start < 0:
        raise ConfigError("save_every, density_warmup, compress_clip and powersgd_start must "
                          "be non-negative", "save_every")
    if cfg.powersgd_rank < 1:
        raise ConfigError(f"--powersgd-rank (PowerSGD's approximation rank) must be >= 1, got "
                          f"{cfg.powersgd_rank}", "powersgd_rank")
    if (cfg.save_every or cfg.resume or cfg.overwrite) and not cfg.save_dir:
        raise ConfigError("--save-every, --resume and --overwrite need --save-dir",
                          "save_every")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --save-dir and --overwrite moves it "
                          "aside: pick one", "overwrite")
    if cfg.precision != "fp32" and cfg.dtype == "fp64":
        raise ConfigError(f"--precision {cfg.precision} keeps fp32 master weights; "
                          "it cannot be combined with --dtype fp64", "precision")
    if cfg.backend == "nccl" and cfg.device != "gpu":
        raise ConfigError("--backend nccl needs --device gpu (NCCL moves GPU memory)", "backend")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}", "zero")
    if cfg.zero and cfg.compress != "none":
        raise ConfigError(f"--zero {cfg.zero} reduce-scatters dense gradients; gradient "
                          "compression runs with --zero 0 only", "zero")
    if cfg.zero and cfg.backend == "nccl":
        raise ConfigError("--zero runs on the MPI backend; drop --backend nccl", "zero")
    if cfg.zero == 3 and cfg.checkpoint_activations:
        raise ConfigError("--zero 3 with --checkpoint-activations is not supported yet "
                          "(recomputation would gather each block a third time); pick one", "zero")
    if cfg.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {cfg.tp}", "tp")
    if cfg.n_head % cfg.tp:     # then n_embd and the MLP width (multiples of n_head) split too
        raise ConfigError(f"--tp {cfg.tp} must divide n_head ({cfg.n_head}): each tensor-"
                          f"parallel rank holds an equal share of the heads", "tp")
    if cfg.tp > 1 and cfg.zero == 3:
        raise ConfigError("--zero 3 with --tp is not supported (ZeRO-3 would gather shards "
                          "of shards); use --zero 1 or 2 with --tp", "zero")
    if cfg.tp > 1 and cfg.backend == "nccl":
        raise ConfigError("--tp runs its collectives over MPI; drop --backend nccl", "backend")
    if cfg.pp < 1 or cfg.virtual_stages < 1 or cfg.micro_batches < 0:
        raise ConfigError("--pp and --virtual-stages must be >= 1, --micro-batches >= 0", "pp")
    if cfg.pp > 1:
        from .parallel import schedules
        for bad, why in ((cfg.zero > 1, f"--zero {cfg.zero} shards gradients during backward; "
                          "with --pp use --zero 0 or 1"),
                         (cfg.precision != "fp32", f"--precision {cfg.precision} with --pp is "
                          "not supported yet; use fp32"),
                         (cfg.compress != "none", "--compress with --pp is not supported yet"),
                         (cfg.backend == "nccl", "--pp runs over MPI; drop --backend nccl")):
            if bad:
                raise ConfigError(why, "pp")
        m = cfg.micro_batches or 2 * cfg.pp
        if cfg.batch_size < m:
            raise ConfigError(f"--batch-size {cfg.batch_size} is split into {m} micro-batches: "
                              "it must be at least that", "micro_batches")
        try:
            schedules.make(cfg.schedule, cfg.pp, m, cfg.virtual_stages)
            partition = schedules.partition
            split = [int(n) for n in cfg.pp_split.split(",")] if cfg.pp_split else None
            partition(cfg.n_layer, cfg.pp * cfg.virtual_stages, split)
        except ValueError as e:
            raise ConfigError(str(e), "pp") from None
    elif cfg.schedule != "1f1b" or cfg.virtual_stages != 1 or cfg.pp_split or cfg.micro_batches:
        raise ConfigError("--schedule, --virtual-stages, --pp-split and --micro-batches are for "
                          "pipelines: add --pp P (P > 1)", "pp")
    validate_cp(cfg)
    if cfg.sequence_parallel and cfg.tp == 1:
        raise ConfigError("--sequence-parallel splits activations over the tensor-parallel "
                          "group: it needs --tp > 1", "sequence_parallel")
    if cfg.backend == "nccl" and cfg.compress != "none":
        raise ConfigError(f"--compress {cfg.compress} runs on the MPI backend; with "
                          "--backend nccl use --compress none", "backend")
    if cfg.straggler:
        try:
            r, ms = cfg.straggler.split(":")
            if int(r) < 0 or float(ms) < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--straggler takes RANK:MS (e.g. 3:50), got {cfg.straggler!r}",
                              "straggler") from None
    if cfg.strategy == "ps":
        for bad, why in ((cfg.zero, "--zero"), (cfg.tp > 1, "--tp"), (cfg.pp > 1, "--pp"),
                         (cfg.compress != "none", "--compress"),
                         (cfg.precision != "fp32", f"--precision {cfg.precision}"),
                         (cfg.backend != "mpi", f"--backend {cfg.backend}")):
            if bad:
                raise ConfigError(f"--strategy ps (parameter servers) runs plain data "
                                  f"parallelism in fp32/fp64 over MPI: drop {why}", "strategy")
        if cfg.servers < 1 or cfg.max_staleness < -1:
            raise ConfigError(f"--servers must be >= 1 and --max-staleness >= -1 (-1: "
                              f"unbounded), got {cfg.servers} and {cfg.max_staleness}",
                              "servers")
    elif cfg.servers != 1 or cfg.max_staleness != -1:
        raise ConfigError("--servers and --max-staleness are for --strategy ps", "servers")


def validate_cp(cfg: TrainConfig) -> None:
    """Context parallelism's settings (parallel/context.py)."""
    if cfg.cp < 1:
        raise ConfigError(f"--cp must be >= 1, got {cfg.cp}", "cp")
    if cfg.cp == 1:
        if cfg.cp_impl != "ring":
            raise ConfigError("--cp-impl is for context parallelism: add --cp N (N > 1)", "cp")
        return
    heads = cfg.n_head // max(cfg.tp, 1)
    if cfg.cp_impl == "ulysses" and heads % cfg.cp:
        raise ConfigError(f"--cp-impl ulysses splits the {heads} heads each tensor-parallel "
                          f"rank holds (n_head / tp) over --cp {cfg.cp}: cp must divide them; "
                          f"use --cp-impl ring, or a cp dividing {heads}", "cp")
    for bad, why in ((cfg.dropout > 0, "--dropout > 0 (attention dropout on a ring is not "
                      "supported; use --dropout 0)"),
                     (cfg.strategy == "ps", "--strategy ps (parameter servers run plain data "
                      "parallelism)")):
        if bad:
            raise ConfigError(f"--cp {cfg.cp} does not run with {why}", "cp")


def validate_world(cfg: TrainConfig, world: int, train_len: int, seq_len: int = 0) -> None:
    """Checks that depend on the world size; identical on every rank, so all fail together."""
    model = cfg.tp * cfg.pp * cfg.cp
    if world % model:
        raise ConfigError(f"the world size {world} is not divisible by --tp {cfg.tp} x --pp "
                          f"{cfg.pp} x --cp {cfg.cp}: the data-parallel size is world / (tp x "
                          f"pp x cp); run a multiple of {model} ranks")
    if cfg.cp > 1 and 0 < seq_len < 2 * cfg.cp:
        raise ConfigError(f"--cp {cfg.cp} cuts each sequence into {2 * cfg.cp} chunks; the "
                          f"sequences here have {seq_len} positions", "cp")
    replicas = world // model
    if cfg.strategy == "ps":
        replicas = world - cfg.servers
        if replicas < 1:
            raise ConfigError(f"--strategy ps with --servers {cfg.servers} needs more ranks "
                              f"than servers (world size {world}): at least one worker")
    if cfg.straggler and int(cfg.straggler.split(":")[0]) >= world:
        raise ConfigError(f"--straggler rank {cfg.straggler.split(':')[0]} is not a rank of "
                          f"a world of {world}")
    global_batch = cfg.batch_size * replicas
    if train_len < global_batch * cfg.grad_accum:
        raise ConfigError(f"the training set has {train_len} examples, fewer than one global "
                          f"step needs ({cfg.batch_size} per replica x {replicas} replicas x "
                          f"{cfg.grad_accum} micro-batches); lower --batch-size")
    if cfg.compress in ("topk", "powersgd") and replicas * cfg.cp == 1:
        raise ConfigError(f"--compress {cfg.compress} on a single rank compresses nothing; "
                          "run with mpirun -n N (N > 1) or drop --compress")


def load_toml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if "--" + key.replace("_", "-") in RENAMED:
            name = RENAMED["--" + key.replace("_", "-")]
        if name not in known:
            raise ConfigError(f"config file {path!r}: unknown key {key!r} "
                              f"(known: {', '.join(sorted(known))})")
        want = known[name].type
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str)}[want]
        if not ok:
            raise ConfigError(f"config file {path!r}: {key} should be {want}, "
                              f"got {type(value).__name__} {value!r}")
        out[name] = float(value) if want == "float" else value
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage first)
        raise ConfigError(message)


# --help: what each option does, in groups. Every TrainConfig field appears exactly once
# (checked at import).
HELP = {
    "data": {
        "task": "what to learn: sort | reverse (generated digit tasks, exact-match accuracy) "
                "| text (next character of --data)",
        "data": "--task text: a text file, or token shards: a folder from python -m "
                "hpcdist.data prepare, a glob of llm.c shards, a raw uint16 .bin",
        "data_encoding": "its encoding; decoded strictly (bad bytes are an error)",
        "length": "digits per sequence (sort, reverse)",
        "num_digits": "digit alphabet size (sort, reverse)",
        "block_size": "context length in tokens (text)",
        "tokenizer": "text: a Hugging Face tokenizer.json (python -m hpcdist.data prepare "
                     "writes one); default: characters, or the one beside token shards",
        "vocab_size": "text: the vocabulary size of raw uint16 .bin shards (0: from the "
                      "tokenizer)",
    },
    "model": {
        "n_layer": "transformer blocks", "n_head": "attention heads per block",
        "n_embd": "embedding width", "dropout": "dropout probability (0 disables)",
        "bias": "biases in linear layers and LayerNorms",
        "tie_weights": "the output head reuses the token embedding",
        "checkpoint_activations": "recompute each block's activations in backward (less "
                                  "memory, one more forward)",
        "init_from": "start from a Hugging Face GPT-2 folder (config.json + "
                     "model.safetensors): its shape and weights, in any layout; the data must "
                     "use its tokenizer",
        "dtype": "master precision: fp32 | fp64 (fp64 for exactness tests)",
        "device": "cpu | gpu | auto (gpu: one GPU per rank, by node-local rank)",
    },
    "optimisation": {
        "steps": "optimizer steps", "batch_size": "sequences per data-parallel replica per "
                                                  "micro-batch",
        "grad_accum": "micro-batches per step (gradients communicated on the last only)",
        "optimizer": "adamw | sgd", "lr": "peak learning rate", "min_lr": "final learning "
                                                                          "rate (cosine decay)",
        "warmup": "linear warm-up steps", "weight_decay": "decoupled weight decay (matrices)",
        "beta1": "AdamW beta1", "beta2": "AdamW beta2", "momentum": "SGD momentum",
        "grad_clip": "clip the global gradient norm to this (0 disables)",
        "scale_lr": "multiply lr by the number of data-parallel replicas",
        "precision": "compute precision fp32 | fp16 | bf16 (fp32 master weights)",
        "loss_scale": "fp16: initial dynamic loss scale", "seed": "seed of the model and data",
    },
    "parallelism": {
        "tp": "tensor-parallel size: heads, MLP width and vocabulary split over tp neighbouring "
              "ranks (data-parallel size = world / tp)",
        "sequence_parallel": "with --tp: split LayerNorm/dropout activations along the sequence",
        "pp": "pipeline stages: the blocks split over pp ranks (data-parallel size = world / "
              "(tp x pp))",
        "micro_batches": "micro-batches each batch is split into in the pipeline (0: 2 x pp)",
        "schedule": "pipeline schedule: gpipe | 1f1b | interleaved | zb-h1 (verified before "
                    "any micro-batch moves)",
        "virtual_stages": "model chunks per rank (--schedule interleaved)",
        "pp_split": "blocks per stage, e.g. 2,2,1 (default: as even as possible)",
        "cp": "context-parallel size: each sequence split over cp ranks, attention too "
              "(data-parallel size = world / (tp x pp x cp))",
        "cp_impl": "context parallelism through attention: ring (K/V blocks round the group) "
                   "| ulysses (all-to-all, heads <-> sequence; cp must divide n_head / tp)",
        "zero": "ZeRO stage 0 (plain DDP) | 1 (optimizer state) | 2 (+ gradients) | 3 (+ "
                "parameters), sharded over the data-parallel group",
        "strategy": "collective (DDP, ZeRO, TP, PP) | ps: asynchronous parameter servers",
        "servers": "ps: how many of the last ranks are servers (each holds a shard of the "
                   "parameters and optimizer)",
        "max_staleness": "ps: a worker waits while it is this many clocks ahead of the "
                         "slowest (0: synchronous, equals DDP; -1: never)",
        "bucket_mb": "gradient bucket size in MB", "first_bucket_mb": "the first (last "
                                                                     "layers') bucket, smaller",
        "overlap": "average buckets during backward", "backend": "mpi | nccl (GPU gradients)",
        "compress": "gradient compression: none | fp16 | topk (DGC) | powersgd",
        "density": "topk: fraction of each bucket sent",
        "compress_momentum": "topk: DGC momentum correction (the optimizer runs without)",
        "compress_clip": "topk: local gradient clipping norm (0 disables)",
        "density_warmup": "topk: steps of DGC's exponential density warm-up",
        "powersgd_rank": "powersgd: rank r of each gradient matrix's approximation (sends "
                         "r(n+m) values for n x m; 4 holds the default task's accuracy, 1 "
                         "lost 12 points; --rank is the old spelling)",
        "powersgd_start": "powersgd: average densely for this many steps first",
        "timeout": "seconds any rank may wait on another before the job ends with a report "
                   "naming who did not arrive (0: $HPCDIST_TIMEOUT, else 300)",
    },
    "checkpoints": {
        "save_dir": "where checkpoints go (none without it)",
        "save_every": "steps between checkpoints (0: only at the end)",
        "resume": "continue from the newest verified checkpoint in --save-dir",
        "overwrite": "a fresh run into a --save-dir that holds another run's checkpoints "
                     "moves them aside to <dir>.old-N (never deletes); without it that is "
                     "refused",
    },
    "observability": {
        "log_every": "print a progress line every N steps (metrics.jsonl records every step)",
        "eval_batch": "evaluation batch size", "out_dir": "metrics.jsonl, ranks.json, "
                                                          "comm_log.json go here",
        "trace": "write a Chrome trace of every rank to this file (ui.perfetto.dev)",
        "comm_log": "print per-collective timings beside the alpha-beta model",
        "trace_memory": "measure each step's activation memory and peak above the model "
                        "state (CPU: tracemalloc, slower)",
        "straggler": "RANK:MS: that rank sleeps MS milliseconds in every step (a slow worker)",
        "allow_singletons": "run even where the launcher's environment promises N tasks but "
                            "MPI started a world of 1 (refused by default: a launcher/MPI "
                            "mismatch makes N separate 1-rank runs)",
    },
}
_helped = [name for group in HELP.values() for name in group]
assert sorted(_helped) == sorted(f.name for f in fields(TrainConfig)), \
    "config.HELP must describe every TrainConfig field exactly once"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hpcdist.train",
                description="Train a GPT on an embedded task or a text file, over MPI ranks: "
                            "mpirun -n 8 python -m hpcdist.train [options]. Settings come from "
                            "the defaults, then --config FILE.toml, then these flags.")
    p.add_argument("--config", help="TOML file of settings (keys as below, with _ or -)")
    known = {f.name: f for f in fields(TrainConfig)}
    for group, options in HELP.items():
        g = p.add_argument_group(group)
        for name, text in options.items():
            f = known[name]
            flag = "--" + name.replace("_", "-")
            if f.type == "bool":
                g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{text} (default {f.default})")
            else:
                g.add_argument(flag, dest=name, default=None,
                               type={"int": int, "float": float, "str": str}[f.type],
                               help=f"{text} (default {f.default!r})")
    return p


# Old spellings still accepted, with a note: flag -> field.
RENAMED = {"--rank": "powersgd_rank"}


def parse_config(argv=None) -> TrainConfig:
    argv = list(argv) if argv is not None else None
    import sys
    for old, field in RENAMED.items():
        for i, a in enumerate(argv if argv is not None else sys.argv[1:]):
            if a == old or a.startswith(old + "="):
                new = "--" + field.replace("_", "-")
                print(f"note: {old} is now {new} (the old spelling still works)")
                if argv is None:
                    argv = list(sys.argv[1:])
                argv[i] = new + a[len(old):]
    args = build_parser().parse_args(argv)
    values = load_toml(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    from_file = set(values) - set(flags)
    values.update(flags)
    cfg = TrainConfig(**values)
    try:
        validate(cfg)
    except ConfigError as e:
        if e.field in from_file or (e.field is None and from_file):
            where = f"set in config file {args.config!r}" if e.field in from_file else \
                f"with settings from config file {args.config!r}"
            raise ConfigError(f"{e} ({where})", e.field) from None
        raise
    return cfg
