"""The training settings checked one at a time, before any rank does any work: positive
numbers, the choices each setting takes, and the checks no feature owns (``SETTINGS``:
(setting, check -> a one-line message or falsy); what each feature runs with is declared
in parallel/capabilities.py). config.validate applies them in order."""
from __future__ import annotations

import codecs
import re
from dataclasses import fields

from .. import nn
from ..device import backend
from . import sinks

POSITIVE = ("length", "num_digits", "block_size", "n_layer", "n_head", "n_embd", "steps",
            "batch_size", "log_every", "eval_batch", "grad_accum", "bucket_mb", "first_bucket_mb",
            "loss_scale")
NON_NEGATIVE = ("eval_tokens", "seed")
MAX_STEPS = 10 ** 9      # more is a typo (a step a millisecond would take 11 days)
CHOICES = {"task": ("sort", "reverse", "text"), "optimizer": ("adamw", "sgd"),
           "device": backend.DEVICES, "dtype": ("fp32", "fp64"),
           "compress": ("none", "fp16", "topk", "powersgd"),
           "precision": ("fp32", "fp16", "bf16", "fp8"),
           "backend": ("mpi", "nccl"), "strategy": ("collective", "ps", "diloco"),
           "shard_group": ("all", "node"), "outer_wire": ("fp32", "fp16", "bf16", "int8", "int4"),
           "cp_impl": ("ring", "ulysses"), "router": ("softmax", "sigmoid"),
           "balance": ("aux", "bias", "none"), "on_failure": ("abort", "shrink"),
           "shrink_batch": ("scale", "keep"), "attention": ("auto", "flash", "gemms", "cudnn"),
           "cuda_graph": ("off", "on", "auto"), "packing": ("bfd", "off"),
           "base_dtype": ("auto", "nf4"),
           "arch": tuple(nn.FAMILIES)}


def flag(name: str) -> str:
    """The command-line flag of setting ``name`` (``rope_theta`` -> ``--rope-theta``)."""
    return "--" + name.replace("_", "-")


def device_from_env(values: dict) -> None:
    """--device unset: $HPCDIST_DEVICE's, as the library's backend.init reads it (an unknown
    one is refused naming the variable)."""
    import os
    if "device" in values or not os.environ.get("HPCDIST_DEVICE"):
        return
    from .errors import ConfigError
    values["device"] = os.environ["HPCDIST_DEVICE"].lower()
    if values["device"] not in CHOICES["device"]:
        raise ConfigError(f"HPCDIST_DEVICE={os.environ['HPCDIST_DEVICE']!r}: choose one of "
                          f"{', '.join(CHOICES['device'])}, or pass --device", "device")


def _foreign_setting(c) -> str | None:
    """A family's own setting given for a family that has no such setting."""
    for name, (_, _, archs) in nn.options().items():
        if getattr(c, name) is not None and c.arch not in archs:
            return (f"{flag(name)} is a setting of {', '.join(archs)}, not of --arch {c.arch}: drop "
                    f"it, or choose --arch {archs[0]}")
    return None


def _family_problem(c) -> str | None:
    """The family's own check of its config (nn/<family>.py), naming the value."""
    try:
        nn.config_of(c, vocab_size=c.vocab_size or 1,           # (0 here: the data's, and
                     vocab_multiple=c.vocab_multiple or 1).validate()   # the device's)
    except ValueError as e:
        return f"--arch {c.arch}: {_as_flags(str(e), c.arch)}"
    return None


def _as_flags(message: str, arch: str) -> str:
    """A family config's message with its field names as the flags that set them
    (``rope_theta`` -> ``--rope-theta``)."""
    names = {f.name for f in fields(nn.FAMILIES[arch].config)}
    return re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*\b", lambda m: flag(m[0]) if m[0] in names
                  and ("_" in m[0] or message.startswith(m[0])) else m[0], message)


def _lora_problem(c) -> str | None:
    """What LoRA's settings rule out (nn/lora.py checks the rest)."""
    if c.lora_rank < 0:
        return f"--lora-rank must be >= 0 (0: no adapters), got {c.lora_rank}"
    if c.adapter and c.lora_rank:
        return ("--adapter takes its rank, alpha and targets from its adapter_config.json: "
                "drop --lora-rank")
    if not (c.lora_rank or c.adapter):
        return c.base_dtype != "auto" and ("--base-dtype nf4 freezes the base for LoRA: "
                                           "add --lora-rank R (or --adapter DIR)")
    from ..nn.lora import LoraSpec, targets_of
    try:
        LoraSpec(c.lora_rank or 1, c.lora_alpha, c.lora_dropout, targets_of(c.lora_targets),
                 c.rslora)
    except ValueError as e:
        return str(e)
    if c.precision == "fp8":
        return "LoRA with --precision fp8 is not built: use --precision bf16 (the frozen base in bf16)"
    if c.strategy != "collective":
        return f"LoRA trains under --strategy collective (DDP, ZeRO, TP, PP, CP, EP), not {c.strategy}"
    return None


def _encoding_problem(c) -> str | None:
    try:
        return codecs.lookup(c.data_encoding) and None
    except LookupError:
        return f"unknown data_encoding {c.data_encoding!r} (e.g. utf-8, latin-1)"


def _attention_problem(c) -> str | None:
    """What --attention asks that these settings rule out (the GPU's own checks at start)."""
    if c.attention in ("auto", "flash"):
        return None
    if c.device == "cpu":
        return (f"--attention {c.attention} runs on a GPU (this run: --device cpu); use "
                "--attention flash or auto")
    if c.attention == "cudnn" and (c.precision not in ("bf16", "fp8") or c.dtype == "fp64"):
        return (f"--attention cudnn takes bf16 (cuDNN's fused attention has no {c.precision} "
                "kernel): add --precision bf16, or use --attention flash")
    return None


def _straggler_problem(c) -> str | None:
    r, _, ms = c.straggler.partition(":")
    if r.isdigit() and ms.replace(".", "", 1).isdigit():
        return None
    return f"--straggler takes RANK:MS (e.g. 3:50), got {c.straggler!r}"


# Settings one at a time (and the pairs no feature owns): (setting, check -> message or falsy),
# as parallel/capabilities.py declares what each feature runs with.
SETTINGS = [
    ("timeout", lambda c: c.timeout < 0 and
     f"timeout must be >= 0 seconds (0: the default), got {c.timeout}"),
    ("data_encoding", _encoding_problem),
    ("tensorboard", lambda c: sinks.problem(c)),
    ("async_save", lambda c: c.async_save and (
        "--async-save needs --save-dir (it writes checkpoints)" if not c.save_dir else
        "--async-save: a parameter server saves from its own loop (--strategy ps); drop it"
        if c.strategy == "ps" else
        "--async-save with --on-failure shrink: a write in flight when a rank is lost is not "
        "taken back yet; drop one" if c.on_failure == "shrink" else None)),
    ("attention", lambda c: _attention_problem(c)),
    ("arch", lambda c: _foreign_setting(c)),
    ("arch", lambda c: _family_problem(c)),
    ("vocab_multiple", lambda c: c.vocab_multiple < 0 and
     f"--vocab-multiple must be >= 0 (0: 64 on a GPU, 1 on the CPU), got {c.vocab_multiple}"),
    ("dropout", lambda c: not 0.0 <= c.dropout < 1.0 and
     f"dropout must be in [0, 1), got {c.dropout}"),
    ("lr", lambda c: (c.lr <= 0 or c.min_lr < 0 or c.min_lr > c.lr) and
     f"need 0 <= min_lr <= lr and lr > 0, got lr={c.lr} min_lr={c.min_lr}"),
    ("beta1", lambda c: not (0.0 <= c.beta1 < 1.0 and 0.0 <= c.beta2 < 1.0) and
     f"--beta1 and --beta2 (AdamW's moment decays) must be in [0, 1), got {c.beta1} and "
     f"{c.beta2}"),
    ("warmup", lambda c: (c.warmup < 0 or c.grad_clip < 0 or c.weight_decay < 0) and
     "warmup, grad_clip and weight_decay must be non-negative"),
    ("task", lambda c: c.task == "text" and not c.data and
     "task 'text' needs a data file: --data PATH"),
    ("vocab_size", lambda c: c.vocab_size < 0 and f"--vocab-size must be >= 0, got {c.vocab_size}"),
    ("tokenizer", lambda c: (c.tokenizer or c.vocab_size) and c.task != "text" and
     "--tokenizer and --vocab-size are for --task text"),
    ("data", lambda c: c.data and c.task != "text" and
     f"--data is for task 'text'; task {c.task!r} is generated, drop --data or pass --task text"),
    ("density", lambda c: not 0.0 < c.density <= 1.0 and
     f"density must be in (0, 1], got {c.density}"),
    ("compress_momentum", lambda c: not 0.0 <= c.compress_momentum < 1.0 and
     f"compress_momentum must be in [0, 1), got {c.compress_momentum}"),
    ("save_every", lambda c: (c.save_every < 0 or c.density_warmup < 0 or c.compress_clip < 0
                              or c.powersgd_start < 0) and
     "save_every, density_warmup, compress_clip and powersgd_start must be non-negative"),
    ("powersgd_rank", lambda c: c.powersgd_rank < 1 and
     f"--powersgd-rank (PowerSGD's approximation rank) must be >= 1, got {c.powersgd_rank}"),
    ("save_every", lambda c: (c.save_every or c.resume or c.overwrite or c.keep_last)
     and not c.save_dir and "--save-every, --keep-last, --resume and --overwrite need --save-dir"),
    ("eval_every", lambda c: c.eval_every and c.strategy == "ps" and
     "--eval-every runs with the collective strategies; --strategy ps evaluates at the end"),
    ("mirror_every", lambda c: c.mirror_every < 0 and
     f"--mirror-every must be >= 0 (0: no mirror), got {c.mirror_every}"),
    ("keep_last", lambda c: (c.keep_last < 0 or c.eval_every < 0) and
     "--keep-last and --eval-every must be >= 0 (0: keep all, evaluate at the end only)"),
    ("overwrite", lambda c: c.resume and c.overwrite and
     "--resume continues the run in --save-dir and --overwrite moves it aside: pick one"),
    ("straggler", lambda c: c.straggler and _straggler_problem(c)),
    ("lora_rank", lambda c: _lora_problem(c)),
]


