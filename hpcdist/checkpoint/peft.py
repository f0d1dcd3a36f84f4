"""Hugging Face PEFT adapter folders read: ``adapter_config.json`` +
``adapter_model.safetensors`` (``--adapter DIR``: train, sample), and the digest that names a
LoRA run's base. The names and layouts are nn/lora.py's; checkpoint/adapters.py writes the
folders and rebuilds the models."""
from __future__ import annotations

import os

import numpy as np

from ..nn.lora import LoraSpec, peft_roles
from .hf_files import read_json, read_safetensors, safetensors_header

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def read(folder: str, weights: bool = True) -> tuple:
    """(LoraSpec, PEFT's tensors) of a PEFT LoRA folder (``weights`` False: the spec alone,
    the tensors' names read off the file's header, None for them); what hpcdist does not
    compute (another PEFT method, trained biases, DoRA, per-layer ranks, extra trained
    modules) is refused in one line naming the folder."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"--adapter {folder}: no {CONFIG} (a PEFT adapter folder, as "
                         "save_pretrained writes it)")
    c = read_json(path)
    file = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(file):
        raise ValueError(f"--adapter {folder}: no {WEIGHTS} (adapter_model.bin, pickled, "
                         "is not read: save with safe_serialization=True)")
    kind = c.get("peft_type", "LORA")
    refusals = [(kind != "LORA", f"peft_type {kind}: only LORA"),
                (c.get("bias", "none") != "none", f"bias {c.get('bias')!r}: trained biases"),
                (bool(c.get("use_dora")), "use_dora: DoRA"),
                (bool(c.get("rank_pattern")) or bool(c.get("alpha_pattern")),
                 "rank_pattern / alpha_pattern: ranks that differ by layer"),
                (bool(c.get("modules_to_save")), "modules_to_save: fully trained modules"),
                (c.get("layers_to_transform") is not None, "layers_to_transform"),
                (bool(c.get("lora_bias")), "lora_bias: a bias on lora_B"),
                (bool(c.get("target_parameters")), "target_parameters"),
                (bool(c.get("trainable_token_indices")), "trainable_token_indices"),
                (bool(c.get("layer_replication")), "layer_replication")]
    for refused, what in refusals:
        if refused:
            raise ValueError(f"--adapter {folder}: {what} is not one hpcdist computes")
    tensors = {k: np.asarray(v) for k, v in read_safetensors(file).items()} if weights \
        else None
    roles = peft_roles(tensors if weights else safetensors_header(file)[0])
    if not roles:
        raise ValueError(f"--adapter {folder}: no LoRA tensor of a block's linear layer")
    spec = LoraSpec(int(c["r"]), float(c.get("lora_alpha", 8)),
                    float(c.get("lora_dropout", 0.0)), roles, bool(c.get("use_rslora")))
    return spec, tensors


def of_settings(cfg, weights: bool = True) -> tuple:
    """(LoraSpec, PEFT's tensors or None, their folder) of a run's LoRA settings: the
    ``--adapter`` folder's (its tensors where ``weights``), or ``--lora-rank`` and the rest."""
    from ..nn.lora import targets_of
    if cfg.adapter:
        spec, tensors = read(cfg.adapter, weights)
        return spec, tensors, cfg.adapter
    return LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                    targets_of(cfg.lora_targets), cfg.rslora), None, ""


_DIGESTS: dict = {}     # (the files' paths, sizes and mtimes) -> digest: a save each step


def base_fingerprint(folder: str) -> str:
    """The weights of a Hugging Face folder named by a digest of each file's size, header
    and 64 KiB at 16 places (reads about 1 MiB a file, whatever its size; again only once
    a file has changed)."""
    import hashlib
    from .hf_files import weight_files
    paths = weight_files(folder)
    key = tuple((p, os.path.getsize(p), os.path.getmtime(p)) for p in paths)
    if key in _DIGESTS:
        return _DIGESTS[key]
    h = hashlib.sha256()
    for path, size, _ in key:
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(16):
                f.seek(size * i // 16)
                h.update(f.read(65536))
    _DIGESTS[key] = "sha256:" + h.hexdigest()[:16]
    return _DIGESTS[key]
