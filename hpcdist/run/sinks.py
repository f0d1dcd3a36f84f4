"""metrics.jsonl's records, also as TensorBoard event files (``--tensorboard``: tensorboardX's
writer, into ``out_dir/tensorboard``) and as a Weights & Biases run (``--wandb``: offline into
``out_dir/wandb`` unless $WANDB_MODE says otherwise). Rank 0 only; every record that
metrics.jsonl gets — a step's loss, lr, gradient norm, tokens/s, MFU, an evaluation's
held-out loss, a recovery — goes to each sink as scalars at its step ("train/loss",
"eval/test_loss", "recovered/world"). A sink that fails warns once and is written no more:
the run goes on, as with metrics.jsonl itself (runtime.RunFile)."""
from __future__ import annotations

import atexit
import json
import math
import os
import sys

_open: dict = {}        # out_dir -> Sinks (one a process: a recovery's _run reuses them)


def problem(cfg) -> str | None:
    """Why the sinks asked for cannot be written (a library missing), for start-up."""
    for flag, package in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if getattr(cfg, flag, False):
            try:
                __import__(package)
            except ImportError:
                return (f"--{flag} needs the {package} package: pip install '{package}' "
                        f"(or 'hpcdist[{flag}]')")
    return None


def scalars(record: dict) -> tuple[int | None, dict]:
    """(the record's step, tag -> value of its finite numbers): a step's record under
    "train/", an event's under its name."""
    group = record.get("event") or "train"
    out = {}
    for key, value in record.items():
        if key in ("step", "time", "event") or isinstance(value, bool) or \
                not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[f"{group}/{key}"] = float(value)
    return record.get("step"), out


class Sinks:
    """The open writers of one run folder."""

    def __init__(self, cfg, start: int):
        self.writers, self.failed = [], set()
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter        # (purge: the steps redone after a
            self.writers.append(("tensorboard", _TensorBoard(SummaryWriter(   # resume)
                os.path.join(cfg.out_dir, "tensorboard"),
                purge_step=start + 1 if start else None))))
        if cfg.wandb:
            self.writers.append(("wandb", _WandB(cfg, start)))

    def add(self, record: dict) -> None:
        step, values = scalars(record)
        if step is None or not values:
            return
        for name, writer in self.writers:
            if name in self.failed:
                continue
            try:
                writer.add(step, values, record.get("time"))
            except Exception as e:                  # (the writer's own kinds): warn once
                self.failed.add(name)
                print(f"[hpcdist] warning: --{name} failed ({type(e).__name__}: {e}); it is "
                      "not written any more in this run, which goes on", file=sys.stderr)

    def flush(self) -> None:
        for name, writer in self.writers:
            if name not in self.failed:
                writer.flush()


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def add(self, step: int, values: dict, walltime) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step, walltime=walltime)

    def flush(self) -> None:
        self.writer.flush()


class _WandB:
    def __init__(self, cfg, start: int):
        import wandb
        os.makedirs(os.path.join(cfg.out_dir, "wandb"), exist_ok=True)
        self.run = wandb.init(project="hpcdist", dir=cfg.out_dir, id=_run_id(cfg),
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              config={k: v for k, v in vars(cfg).items()
                                      if isinstance(v, (int, float, str, bool))},
                              resume="allow", settings=wandb.Settings(
                                  silent=True, console="off"))
        atexit.register(self.run.finish)          # (its files complete when the run ends)

    def add(self, step: int, values: dict, walltime) -> None:
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass


def _run_id(cfg) -> str | None:
    """The W&B run of a save folder's run (its run.json id, run/savedir.py): a --resume goes
    on in the same W&B run; without a save folder, a new one."""
    try:
        with open(os.path.join(cfg.save_dir, "run.json")) as f:
            return f"hpcdist-{json.load(f)['id']}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sinks(cfg, start: int = 0) -> Sinks | None:
    """This process's sinks for ``cfg``'s out folder (opened on first use), None without
    --tensorboard or --wandb."""
    if not (getattr(cfg, "tensorboard", False) or getattr(cfg, "wandb", False)):
        return None
    if cfg.out_dir not in _open:
        _open[cfg.out_dir] = Sinks(cfg, start)
    return _open[cfg.out_dir]
