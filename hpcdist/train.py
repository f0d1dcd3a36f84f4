"""Train a GPT on an embedded task or a text file: ``python -m hpcdist.train [--config F.toml]``.

Settings come from ``TrainConfig`` defaults, then a TOML file (``--config``), then flags; every
field is a flag (``n_layer`` -> ``--n-layer``). Bad settings end the run before any work with a
one-line error and exit code 2. Rank 0 prints a header, a progress line every ``log_every``
steps, and the held-out accuracy at the end; metrics go to ``out_dir/metrics.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, fields

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import numpy as np

from . import backend, data, nn, optim
from .tensor import no_grad


@dataclass
class TrainConfig:
    # task
    task: str = "sort"            # sort | reverse | text
    data: str = ""                # text file for task 'text'
    length: int = 6               # digits per sequence (sort/reverse)
    num_digits: int = 10          # digit alphabet size (sort/reverse)
    block_size: int = 64          # context length (text)
    # model
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
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
    # run
    seed: int = 1337
    device: str = "cpu"           # cpu | gpu | auto
    dtype: str = "fp32"           # fp32 | fp64 (compute and master precision)
    log_every: int = 50
    eval_batch: int = 512
    out_dir: str = "runs"


class ConfigError(ValueError):
    """A setting that cannot work; reported as one line, exit code 2."""


POSITIVE = ("length", "num_digits", "block_size", "n_layer", "n_head", "n_embd", "steps",
            "batch_size", "log_every", "eval_batch")
CHOICES = {"task": ("sort", "reverse", "text"), "optimizer": ("adamw", "sgd"),
           "device": backend.DEVICES, "dtype": ("fp32", "fp64")}


def validate(cfg: TrainConfig) -> None:
    for name in POSITIVE:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"unknown {name} {getattr(cfg, name)!r}: choose one of "
                              f"{', '.join(choices)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0, got lr={cfg.lr} min_lr={cfg.min_lr}")
    if cfg.warmup < 0 or cfg.grad_clip < 0 or cfg.weight_decay < 0:
        raise ConfigError("warmup, grad_clip and weight_decay must be non-negative")
    if cfg.task == "text" and not cfg.data:
        raise ConfigError("task 'text' needs a data file: --data PATH")
    if cfg.data and cfg.task != "text":
        raise ConfigError(f"--data is for task 'text'; task {cfg.task!r} is generated, "
                          "drop --data or pass --task text")


def load_toml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m hpcdist.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="TOML file of settings (flags override it)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, dest=f.name, type={"int": int, "float": float, "str": str}[f.type],
                           default=None, help=f"default {f.default!r}")
    return p


def parse_config(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    values = load_toml(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if k != "config" and v is not None})
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


# ---- evaluation -------------------------------------------------------------------------------

def evaluate(model, dataset, batch: int, max_examples: int = 4096):
    """Held-out (accuracy, loss).

    Digit tasks: exact match — every scored position's argmax equals its target. With teacher
    forcing this equals greedy decoding getting the whole answer right. Text: next-character
    accuracy over up to ``max_examples`` evenly spaced windows.
    """
    xp = backend.xp()
    n = len(dataset)
    idx = np.arange(n) if n <= max_examples else np.linspace(0, n - 1, max_examples).astype(int)
    exact = isinstance(dataset, data.DigitTask)
    correct = total = 0
    loss_sum = 0.0
    was_training = model.training
    model.eval()
    with no_grad():
        for s in range(0, len(idx), batch):
            x, y = dataset.batch(idx[s:s + batch])
            logits, loss = model(xp.asarray(x), xp.asarray(y))
            pred = backend.to_numpy(logits.data.argmax(axis=-1))
            scored = y != data.IGNORE
            hit = (pred == y) | ~scored
            if exact:
                correct += int(hit.all(axis=1).sum())
                total += len(y)
            else:
                correct += int((hit & scored).sum())
                total += int(scored.sum())
            loss_sum += float(loss.data) * len(y)
    model.train(was_training)
    return correct / max(total, 1), loss_sum / len(idx)


# ---- the run ----------------------------------------------------------------------------------

def build(cfg: TrainConfig):
    """Datasets, model and optimizer for a validated config (host-side errors surface here)."""
    try:
        train_set, test_set = data.make_task(cfg.task, length=cfg.length,
                                             num_digits=cfg.num_digits, data=cfg.data or None,
                                             block_size=cfg.block_size)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    backend.set_default_float("float64" if cfg.dtype == "fp64" else "float32")
    nn.manual_seed(cfg.seed)
    gcfg = nn.GPTConfig(block_size=train_set.block_size, vocab_size=train_set.vocab_size,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                        dropout=cfg.dropout, bias=cfg.bias, tie_weights=cfg.tie_weights)
    model = nn.GPT(gcfg)
    if cfg.optimizer == "adamw":
        opt = optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                          weight_decay=cfg.weight_decay)
    else:
        opt = optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                        weight_decay=cfg.weight_decay)
    return train_set, test_set, model, opt


def train(cfg: TrainConfig, rank: int = 0, world: int = 1, log=print) -> dict:
    """Run training; return the final metrics. ``log`` prints on rank 0 only."""
    device = backend.init(cfg.device)
    train_set, test_set, model, opt = build(cfg)
    xp = backend.xp()
    sampler = data.DistributedSampler(len(train_set), cfg.batch_size, rank, world, seed=cfg.seed)
    is_main = rank == 0
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        metrics = open(metrics_path, "w")
    say = log if is_main else (lambda *a, **k: None)
    say(f"hpcdist | GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), "
        f"{model.num_parameters():,} parameters | task {cfg.task} "
        f"({len(train_set):,} train / {len(test_set):,} held-out) | device {device} | "
        f"world size {world} | {cfg.dtype} | {cfg.steps} steps x batch {cfg.batch_size}")

    tokens_per_step = cfg.batch_size * train_set.block_size * world
    t_start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = train_set.batch(sampler.next_batch())
        lr = optim.lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
        opt.zero_grad()
        _, loss = model(xp.asarray(x), xp.asarray(y))
        loss.backward()
        norm = optim.clip_grad_norm(opt.flat.grad, cfg.grad_clip) if cfg.grad_clip else None
        opt.step(lr)
        loss_value = float(loss.data)
        dt = time.perf_counter() - t0
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec = {"step": step, "loss": loss_value, "lr": lr, "step_ms": dt * 1e3,
                   "tokens_per_s": tokens_per_step / dt,
                   "grad_norm": norm}
            say(f"step {step:5d}/{cfg.steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {dt * 1e3:.1f} ms/step")
            if is_main:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
        if not np.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; "
                                     "lower --lr or enable --grad-clip")

    accuracy, test_loss = evaluate(model, test_set, cfg.eval_batch)
    final = {"event": "final", "accuracy": accuracy, "test_loss": test_loss,
             "train_loss": loss_value, "steps": cfg.steps,
             "seconds": time.perf_counter() - t_start}
    what = "exact-match" if cfg.task != "text" else "next-char"
    say(f"held-out accuracy ({what}): {accuracy * 100:.2f}% | held-out loss {test_loss:.4f} | "
        f"{final['seconds']:.1f} s")
    if is_main:
        metrics.write(json.dumps(final) + "\n")
        metrics.close()
    return final


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv)
        backend.init(cfg.device)
    except (ConfigError, backend.DeviceError) as e:
        print(f"hpcdist.train: error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except ConfigError as e:
        print(f"hpcdist.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
