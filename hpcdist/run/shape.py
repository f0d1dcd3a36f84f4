"""Where a run's model shape can come from besides its flags: a published size (``--model``,
declared by the families in nn/), a pretrained Hugging Face folder (``--init-from``) and the
checkpoint a ``--resume`` continues; each fills the settings the command line left open,
before the settings are checked."""
from __future__ import annotations

import os

from .. import nn
from .errors import ConfigError
from .settings import flag


SHAPE = ("arch", "n_layer", "n_head", "n_embd", "bias", "tie_weights", "experts", "top_k",
         *nn.options())


def sized(values: dict) -> None:
    """--model NAME: the family and shape of a published size, where the settings say
    nothing else (a flag or a TOML key given wins; another --arch is refused)."""
    if not values.get("model"):
        return
    try:
        arch, shape = nn.size(values["model"])
    except ValueError as e:
        raise ConfigError(str(e), "model") from None
    if values.get("arch", arch) != arch:
        raise ConfigError(f"--model {values['model']} is a {arch} model, not --arch "
                          f"{values['arch']}: drop one", "arch")
    values["arch"] = arch
    for name, value in shape.items():
        values.setdefault(name, value)


def against_pretrained(values: dict) -> None:
    """--init-from takes its family and shape from the folder, filled in here so that every
    check before step 1 sees them (its experts for --ep, say): a shape setting given beside
    it that says otherwise is refused (one that agrees is fine)."""
    if not values.get("init_from"):
        return
    from ..checkpoint import hf
    try:
        shape = hf.shape(values["init_from"])
    except (OSError, ValueError, KeyError):
        return                                  # prepare() reports the folder itself
    for k in SHAPE:
        if k in values and k in shape and values[k] != shape[k]:
            raise ConfigError(f"{flag(k)} {values[k]} contradicts --init-from "
                              f"{values['init_from']}, whose {k} is {shape[k]}: the model's "
                              f"shape is the folder's; drop {flag(k)}", k)
    values.update({k: v for k, v in shape.items() if k in SHAPE})


# What a --resume takes from the checkpoint's meta (checkpoint/meta.py), beside SHAPE: the
# settings a resume must share, which check_meta would otherwise refuse one by one.
RUN = ("task", "length", "num_digits", "block_size", "dtype", "precision", "optimizer",
       "compress", "seed", "moe_every", "router", "shared_experts", "capacity_factor",
       "balance", "expert_hidden")
LORA = {"rank": "lora_rank", "alpha": "lora_alpha", "rslora": "rslora",
        "base_dtype": "base_dtype"}


def from_checkpoint(values: dict) -> list[str]:
    """--resume: the model's family, shape, run settings, LoRA settings and --init-from come
    from the checkpoint it continues (its latest's manifest), where the settings say nothing;
    a setting given that contradicts it is one line naming both values. Nothing to take
    (no checkpoint yet, or one that does not read: the resume reports it) changes nothing.
    Returns the notes to print."""
    if not (values.get("resume") and values.get("save_dir")):
        return []
    meta = _latest_meta(values["save_dir"])
    if meta is None:
        return []
    taken = {k: meta[k] for k in SHAPE + RUN if k in meta}
    taken.setdefault("arch", nn.DEFAULT_ARCH)       # (older checkpoints: GPT's, unnamed)
    taken.update({ours: meta["lora"][k] for k, ours in LORA.items() if k in (
        meta.get("lora") or {})})
    origin = (meta.get("source") or {}).get("folder") or meta.get("base_folder")
    for name, value in taken.items():
        if name in values and values[name] != value:
            option = flag(name)
            raise ConfigError(f"{option} {values[name]!r} contradicts --resume: "
                              f"{values['save_dir']} holds a run with {option} {value!r}; drop "
                              f"{option}, or start a new run in another --save-dir", name)
    added = sorted(k for k in taken if k not in values)
    values.update({k: v for k, v in taken.items() if k not in values})
    if origin and os.path.isdir(origin) and not values.get("init_from") and \
            not values.get("model"):
        values["init_from"] = origin
        added.append("init_from")
    if "lora" in meta and "lora_targets" not in values:
        values["lora_targets"] = ",".join(meta["lora"]["targets"])
    if not added:
        return []
    origin = f", --init-from {values['init_from']}" if "init_from" in added else ""
    return [f"note: --resume takes the run's settings from {values['save_dir']} ({len(added)} "
            f"the command leaves open: --arch {values['arch']}{origin}, its shape, task and "
            "precision)"]


def _latest_meta(save_dir: str) -> dict | None:
    """The meta of the checkpoint ``latest`` names (None: none, or one that does not read)."""
    from .. import checkpoint
    try:
        folder = checkpoint.latest(save_dir)
        return None if folder is None else checkpoint.read_manifest(folder).get("meta") or {}
    except (checkpoint.CheckpointError, OSError, ValueError):
        return None

