"""What a checkpoint must share with the run that resumes it (its meta: the task, the model's
family and shape, the precision, the data's vocabulary), and the one-line refusal of a
checkpoint written by another run."""
from __future__ import annotations

import os

from .. import nn
from .errors import CheckpointError


def checkpoint_meta(cfg, vocabulary: dict | None = None) -> dict:
    """What a checkpoint must share with the run that resumes it (checked on --resume); the
    layout (world size, DP, TP, PP, ZeRO level) may differ. ``vocabulary``: the data's
    (data/vocab.py), named by its fingerprint."""
    from ..data import vocab
    meta = {"task": cfg.task, "length": cfg.length, "num_digits": cfg.num_digits,
            "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_embd": cfg.n_embd, "bias": cfg.bias, "tie_weights": cfg.tie_weights,
            "dtype": cfg.dtype, "precision": cfg.precision, "optimizer": cfg.optimizer,
            "compress": cfg.compress,
            "seed": cfg.seed}                 # (the data's order and dropout: the run's own)
    arch = nn.arch_of(cfg)
    if arch != nn.DEFAULT_ARCH:               # (absent for it: older checkpoints compare)
        meta["arch"] = arch
    meta.update(family_settings(cfg, arch))
    if getattr(cfg, "experts", 0):            # (absent without: older checkpoints compare)
        meta.update({k: getattr(cfg, k) for k in ("experts", "top_k", "moe_every", "router",
                                                  "shared_experts", "capacity_factor",
                                                  "balance", "expert_hidden")
                     if k != "expert_hidden" or getattr(cfg, k, 0)})   # (likewise)
    if vocabulary is not None:
        meta["vocab"] = vocab.fingerprint(vocabulary)
    if getattr(cfg, "lora_rank", 0) or getattr(cfg, "adapter", ""):
        meta.update(lora_meta(cfg))
    if getattr(cfg, "init_from", ""):
        meta["source"] = source_record(cfg.init_from)
    return meta


_sources: dict = {}


def source_record(folder: str) -> dict:
    """What an export carries from the Hugging Face folder a run started from (its config,
    generation and tokenizer configs, special tokens, chat template: hf_files.source_files),
    with the folder's path; read once a process. Not compared on --resume (NOT_COMPARED):
    the model is, by its settings and digest."""
    from .hf_files import source_files
    key = os.path.abspath(folder)
    if key not in _sources:
        _sources[key] = {"folder": key, "files": source_files(folder)}
    return _sources[key]


NOT_COMPARED = ("base_folder", "source")   # where the base lies: by its digest, its shape


def lora_meta(cfg) -> dict:
    """A LoRA run's adapters (rank, alpha, scale kind, targets) and its frozen base's
    fingerprint: a resume against another base is refused (``check_meta``)."""
    from .peft import base_fingerprint, of_settings
    spec = of_settings(cfg, weights=False)[0]      # (the adapter's config, not its weights)
    return {"lora": {"rank": spec.rank, "alpha": spec.alpha, "rslora": spec.rslora,
                     "targets": list(spec.targets),
                     "base_dtype": getattr(cfg, "base_dtype", "auto")},
            "base": base_fingerprint(cfg.init_from) if cfg.init_from else f"seed {cfg.seed}",
            "base_folder": os.path.abspath(cfg.init_from) if cfg.init_from else ""}


def family_settings(cfg, arch: str) -> dict:
    """The family's own settings (nn.family.own_settings) at their values: the shape a
    resume must share beyond n_layer, n_head and n_embd."""
    return {name: getattr(cfg, name) for name in nn.own_settings(arch)
            if getattr(cfg, name, None) is not None}


def check_meta(manifest: dict, meta: dict, folder: str, vocabulary: dict | None = None) -> None:
    """Refuse, in one line, a checkpoint written by a run that differs from this one; another
    vocabulary first (ids would mean other tokens), naming both. ``vocabulary``: this run's,
    where known (a checkpoint that named it by its file's text still compares equal)."""
    from ..data import vocab
    saved = manifest.get("meta") or {}
    if vocabulary is not None and "vocab" in saved and vocab.same(saved["vocab"], vocabulary):
        saved = dict(saved, vocab=meta.get("vocab"))
    if "vocab" in saved and "vocab" in meta and saved["vocab"] != meta["vocab"]:
        raise CheckpointError(f"{folder} was trained on another vocabulary: {saved['vocab']}; "
                              f"this run's data gives {meta['vocab']}. Resume with the same "
                              "--data and --tokenizer, or start a new run in another --save-dir")
    theirs, ours = nn.arch_of(saved), nn.arch_of(meta)
    if theirs != ours:                        # the family first: the rest follows from it
        raise CheckpointError(f"{folder} holds a {nn.family(theirs).title} model (--arch "
                              f"{theirs}), this run builds --arch {ours}: resume with --arch "
                              f"{theirs}, or start a new run in another --save-dir")
    if saved.get("base", meta.get("base")) != meta.get("base") or \
            ("lora" in saved) != ("lora" in meta):
        raise CheckpointError(
            f"{folder} holds " + (f"LoRA adapters of the base {saved['base']}" if "lora" in
                                   saved else "a model trained whole") + "; this run " +
            (f"trains adapters on the base {meta['base']}" if "lora" in meta else
             "trains the whole model") + ": resume on the same --init-from with the same "
            "LoRA settings, or start a new run in another --save-dir")
    diffs = [f"{k} {saved[k]!r} there, {v!r} here" for k, v in meta.items()
             if k in saved and saved[k] != v and k not in NOT_COMPARED]
    if diffs:
        raise CheckpointError(f"{folder} was written by a different run: " + "; ".join(diffs)
                              + ". Resume with the same settings, or use another --save-dir")
