"""Training configuration: a dataclass with typed overrides from TOML and flags.

Settings come from ``TrainConfig`` defaults, then a TOML file (``--config``), then flags; every
field is a flag (``n_layer`` -> ``--n-layer``) and a TOML key. ``validate`` rejects settings that
cannot work before any rank does any work; ``ConfigError`` carries the one-line message.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields, make_dataclass

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .. import nn
from ..host.layout import Layout
from .config_help import HELP
from .errors import ConfigError
from .shape import against_pretrained, from_checkpoint, sized
from .settings import (CHOICES, MAX_STEPS, NON_NEGATIVE, POSITIVE, SETTINGS, device_from_env,
                       flag)
from ..host.cli import Parser


@dataclass
class Settings:
    """The settings every run has; TrainConfig adds the families' own (below)."""
    # task
    task: str = "sort"            # sort | reverse | text
    data: str = ""                # text file for task 'text'
    data_encoding: str = "utf-8"  # its encoding (decoded strictly: bad bytes are an error)
    length: int = 6               # digits per sequence (sort/reverse)
    num_digits: int = 10          # digit alphabet size (sort/reverse)
    block_size: int = 64          # context length (text)
    tokenizer: str = ""           # text: a Hugging Face tokenizer.json (default: characters)
    vocab_size: int = 0           # text: raw uint16 shards' vocabulary size
    packing: str = "bfd"          # document shards: bfd (rows of several documents) | off
    # model
    model: str = ""               # a published size (nn/<family>.py's SIZES): its family, shape
    arch: str = nn.DEFAULT_ARCH   # the model family (nn/FAMILIES: its file in nn/)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = None             # None: the family's (gpt: biases; llama: none)
    tie_weights: bool = None      # None: the family's (gpt: tied; llama: untied)
    checkpoint_activations: bool = False  # recompute each block's activations in backward
    init_from: str = ""           # a Hugging Face model folder: its family, shape and weights
    vocab_multiple: int = 0       # token table and head padded to a multiple (0: 64 on a GPU)
    # LoRA (nn/lora.py): adapters trained over a frozen base
    lora_rank: int = 0            # 0: every parameter trains
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"  # roles: q,k,v,o,gate,up,down,experts | all-linear
    rslora: bool = False          # scale alpha / sqrt(r) in place of alpha / r
    adapter: str = ""             # a PEFT adapter folder: its settings and weights
    base_dtype: str = "auto"      # auto (the compute precision's) | nf4 (QLoRA: nn/nf4.py)
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
    compress_momentum: float = 0.9  # topk: DGC momentum correction (the optimizer: none)
    compress_clip: float = 0.0    # topk: local gradient clipping norm (0 disables)
    density_warmup: int = 0       # topk: steps of DGC's exponential density warm-up
    powersgd_rank: int = 4        # powersgd: rank of each matrix's approximation
    powersgd_start: int = 0       # powersgd: dense steps first (PyTorch's start_powerSGD_iter)
    precision: str = "fp32"       # fp32 | fp16 | bf16 compute (fp32 master weights)
    loss_scale: float = 65536.0   # fp16: initial dynamic loss scale
    tf32: bool = False            # fp32 GEMMs on TF32 tensor cores (GPU, compute capability 8+)
    attention: str = "auto"       # auto | flash | gemms | cudnn (device/kernels/attention.py)
    cuda_graph: str = "off"       # off | on | auto: steps replayed as CUDA graphs (run/graphed.py)
    backend: str = "mpi"          # mpi | nccl (nccl: GPU only)
    zero: int = 0                 # ZeRO level: 0 (plain DDP), 1, 2 or 3
    strategy: str = "collective"  # collective (DDP/ZeRO/TP/PP) | ps | diloco (groups, H steps)
    shard_group: str = "all"      # ZeRO over all | node (groups of --shard-size: hybrid)
    shard_size: int = 0           # 0: a node's ranks
    group_size: int = 0           # diloco (parallel/diloco.py; every field: config_help.py)
    inner_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    fragments: int = 1
    outer_overlap: int = 0
    outer_wire: str = "fp32"
    outer_mix: float = 0.5
    servers: int = 1              # ps: server ranks (the last ones)
    max_staleness: int = -1       # ps: a worker waits when s clocks ahead (0: sync, -1: never)
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
    # mixture of experts (nn/moe.py, parallel/expert.py)
    experts: int = 0              # experts per MoE layer (0: dense MLPs); the rest: --help
    top_k: int = 2
    moe_every: int = 1
    router: str = "softmax"
    shared_experts: int = 0
    expert_hidden: int = 0        # each expert's MLP width (0: 4 x n_embd)
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    balance: str = "aux"
    bias_rate: float = 1e-3
    ep: int = 1                   # expert-parallel size
    # checkpoints
    save_dir: str = ""            # where checkpoints go ("" = none)
    save_every: int = 0           # steps between checkpoints (0 = only at the end)
    keep_last: int = 0            # keep only the newest N checkpoints (0 = all)
    resume: bool = False          # continue from the latest checkpoint in save_dir
    overwrite: bool = False       # move another run's checkpoints in save_dir aside
    allow_other_files: bool = False   # save_dir may hold files no run wrote
    async_save: bool = False      # write checkpoints from a background thread
    # run
    seed: int = 1337
    timeout: float = 0.0          # seconds a rank may wait on another (0: $HPCDIST_TIMEOUT/300)
    on_failure: str = "abort"     # abort | shrink (a dead rank: end the job | go on without it)
    shrink_batch: str = "scale"   # after a shrink: scale | keep the global batch
    respawn: bool = False         # after a shrink: spawn replacements, which join the job
    mirror_every: int = 1         # shrink, sharded state: a buddy's memory holds it every K steps
    device: str = "cpu"           # cpu | gpu | auto | standin
    dtype: str = "fp32"           # fp32 | fp64 (master precision; fp64 for exactness tests)
    log_every: int = 50
    eval_every: int = 0           # held-out evaluation every N steps (0 = at the end only)
    eval_batch: int = 512         # sequences an evaluation forward takes at most
    eval_tokens: int = 262144     # held-out tokens scored at most (0: every window up to 4,096)
    out_dir: str = "runs"
    # observability
    tensorboard: bool = False     # metrics.jsonl's records as TensorBoard event files too
    wandb: bool = False           # ... and as a Weights & Biases run (offline by default)
    trace: str = ""               # write a Chrome trace of every rank to this file
    comm_log: bool = False        # print per-collective timings next to the alpha-beta model
    trace_memory: bool = False    # measure activation memory per step (memtrace; slower)
    straggler: str = ""           # "RANK:MS": that rank sleeps MS ms in every step
    allow_singletons: bool = False  # run although MPI started fewer ranks than promised


# the families' own settings: name -> (type, help, the families that declare it)
FAMILY_OPTIONS = nn.options()
assert not set(FAMILY_OPTIONS) & {f.name for f in fields(Settings)}, \
    "a family's own setting must not be one every run has"


def _post_init(self):
    """The family's defaults where the settings left them open (None): bias, tie_weights
    and its own settings; those of other families stay None."""
    if self.arch not in nn.FAMILIES:
        return                                   # (validate refuses it, naming the known)
    defaults = {f.name: f.default for f in fields(nn.FAMILIES[self.arch].config)}
    for name in ("bias", "tie_weights", *FAMILY_OPTIONS):
        if getattr(self, name) is None and name in defaults:
            setattr(self, name, defaults[name])


# Every setting: Settings' fields and then each family's own, defaulting to None (the
# family's default, filled by __post_init__ for the chosen family).
TrainConfig = make_dataclass(
    "TrainConfig", [(name, kind, field(default=None)) for name, (kind, _, _) in
                    FAMILY_OPTIONS.items()],
    bases=(Settings,), namespace={"__post_init__": _post_init,
                                  "__doc__": "Every training setting (--help lists them)."})
TrainConfig.__module__ = __name__


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError for the first setting that cannot work: non-finite or non-positive
    numbers, unknown choices, then ``SETTINGS`` and every feature's declared refusals
    (parallel/capabilities.py), in order."""
    from ..parallel import capabilities  # pure: no MPI
    from ..parallel.schedules import SCHEDULES
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.type == "float" and value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag(f.name)} must be a finite number, got {value}", f.name)
    for name in POSITIVE:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag(name)} must be positive, got {getattr(cfg, name)}", name)
    for name in NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{flag(name)} must be 0 or more, got {getattr(cfg, name)}", name)
    if cfg.steps > MAX_STEPS:
        raise ConfigError(f"--steps {cfg.steps:,} is more than {MAX_STEPS:,} (a step a "
                          "millisecond would take 11 days): a typo?", "steps")
    for name, choices in list(CHOICES.items()) + [("schedule", SCHEDULES)]:
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"unknown {flag(name)} {getattr(cfg, name)!r}: choose one of "
                              f"{', '.join(choices)}", name)
    for name, check in SETTINGS + capabilities.REFUSALS:
        message = check(cfg)
        if message:
            raise ConfigError(message, name)


def validate_world(cfg: TrainConfig, world: int, train_len: int, seq_len: int = 0) -> None:
    """Checks that depend on the world size; identical on every rank, so all fail together."""
    layout = Layout.of(cfg, world)
    model = layout.model
    if world % model:
        raise ConfigError(f"the world size {world} is not divisible by --tp {cfg.tp} x --pp "
                          f"{cfg.pp} x --cp {cfg.cp}: the data-parallel size is world / (tp x "
                          f"pp x cp); run a multiple of {model} ranks")
    if cfg.cp > 1 and 0 < seq_len < 2 * cfg.cp:
        raise ConfigError(f"--cp {cfg.cp} cuts each sequence into {2 * cfg.cp} chunks; the "
                          f"sequences here have {seq_len} positions", "cp")
    replicas = layout.replicas
    if cfg.ep > 1 and replicas % cfg.ep:                 # EP folds over DP
        raise ConfigError(f"--ep {cfg.ep} must divide the data-parallel size {replicas} "
                          f"(world {world} / (tp x pp x cp))", "ep")
    from ..parallel.capabilities import world_problem
    if world_problem(cfg, world):
        raise ConfigError(*world_problem(cfg, world))
    if cfg.strategy == "ps":
        replicas = world - cfg.servers
        if replicas < 1:
            raise ConfigError(f"--strategy ps with --servers {cfg.servers} needs more ranks "
                              f"than servers (world size {world}): at least one worker")
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
        if isinstance(value, dict):
            inner = next(iter(value), "n_layer")
            raise ConfigError(f"config file {path!r}: [{key}] is a table; hpcdist's settings "
                              f"are top-level keys ({inner} = ..., above any [table])")
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


class _Parser(Parser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage first)
        raise ConfigError(self.explain(message))


_helped = [name for group in HELP.values() for name in group]
assert sorted(_helped) == sorted(f.name for f in fields(Settings)), \
    "config.HELP must describe every Settings field exactly once"


def _help_groups() -> dict:
    """--help's groups: HELP's, then one per set of families that declare the same settings
    ("model: llama, qwen2, gemma"), each setting under the families that have it."""
    groups = {name: dict(options) for name, options in HELP.items()}
    for name in ("bias", "tie_weights"):
        groups["model"][name] += f" (default: the family's: {_family_defaults(name)})"
    for name, (_, text, archs) in FAMILY_OPTIONS.items():
        groups.setdefault(f"model: {', '.join(archs)}", {})[name] = \
            f"{text} (default {_family_defaults(name)})"
    return groups


def _family_defaults(name: str) -> str:
    """A family setting's default: one value, or each family's where they differ."""
    values = {arch: {f.name: f.default for f in fields(f.config)}.get(name)
              for arch, f in nn.FAMILIES.items()}
    values = {arch: v for arch, v in values.items() if v is not None}
    if len(set(map(repr, values.values()))) == 1:
        return repr(next(iter(values.values())))
    return ", ".join(f"{arch} {v!r}" for arch, v in values.items())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hpcdist.train",
                description="Train a GPT on an embedded task or a text file, over MPI ranks: "
                            "mpirun -n 8 python -m hpcdist.train [options]. Settings come from "
                            "the defaults, then --config FILE.toml, then these flags.")
    p.add_argument("--config", help="TOML file of settings (keys as below, with _ or -)")
    known = {f.name: f for f in fields(TrainConfig)}
    for group, options in _help_groups().items():
        g = p.add_argument_group(group)
        for name, text in options.items():
            f = known[name]
            said = "" if f.default is None else f" (default {f.default!r})"
            add_setting(g, name, f.type, text + said)
    return p


def add_setting(parser, name: str, kind: str, text: str) -> None:
    """The flag of setting ``name`` of type ``kind`` (a field's annotation: "int", "float",
    "str", "bool"), None when not given (the default is decided after parsing): the trainer's
    settings, and the families' own in the planner's parser too."""
    option = flag(name)
    if name in BARE:                   # given alone: its value there (--cuda-graph: on)
        parser.add_argument(option, dest=name, nargs="?", const=BARE[name], default=None,
                            help=text)
    elif kind == "bool":
        parser.add_argument(option, dest=name, action=argparse.BooleanOptionalAction,
                            default=None, help=text)
    else:
        parser.add_argument(option, dest=name, default=None,
                            type={"int": int, "float": float, "str": str}[kind], help=text)


# Settings of several values whose flag alone means one of them.
BARE = {"cuda_graph": "on"}

# Old spellings still accepted, with a note: flag -> field.
RENAMED = {"--rank": "powersgd_rank"}


def parse_config(argv=None) -> TrainConfig:
    argv = list(argv) if argv is not None else None
    import sys
    for old, name in RENAMED.items():
        for i, a in enumerate(argv if argv is not None else sys.argv[1:]):
            if a == old or a.startswith(old + "="):
                new = flag(name)
                print(f"note: {old} is now {new} (the old spelling still works)")
                if argv is None:
                    argv = list(sys.argv[1:])
                argv[i] = new + a[len(old):]
    args = build_parser().parse_args(argv)
    values = load_toml(args.config) if args.config else {}
    flags = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    from_file = set(values) - set(flags)
    values.update(flags)
    if isinstance(values.get("cuda_graph"), bool):      # (a config file's true / false)
        values["cuda_graph"] = "on" if values["cuda_graph"] else "off"
    device_from_env(values)
    if values.get("data") and "task" not in values:     # a data file means its text task
        values["task"] = "text"
        print("note: --data selects --task text")
    for line in from_checkpoint(values):
        print(line)
    sized(values)
    against_pretrained(values)
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
