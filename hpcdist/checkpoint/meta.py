"""What a checkpoint must share with the run that resumes it (its meta: the task, the model's
family and shape, the precision, the data's vocabulary), and the one-line refusal of a
checkpoint written by another run."""
from __future__ import annotations

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
    return meta


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
    diffs = [f"{k} {saved[k]!r} there, {v!r} here" for k, v in meta.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise CheckpointError(f"{folder} was written by a different run: " + "; ".join(diffs)
                              + ". Resume with the same settings, or use another --save-dir")
