"""Hugging Face PEFT adapter folders: ``adapter_config.json`` + ``adapter_model.safetensors``,
read by ``--adapter DIR`` (train, sample, evaluate) and written by ``checkpoint export
--format peft``. The names and layouts are nn/lora.py's; this file reads and writes."""
from __future__ import annotations

import os

import numpy as np

from ..nn.lora import LoraSpec, peft_roles
from .hf_files import read_json, read_safetensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def read(folder: str) -> tuple:
    """(LoraSpec, PEFT's tensors, the config's fields) of a PEFT LoRA folder; what hpcdist
    does not compute (another PEFT method, trained biases, DoRA, per-layer ranks, extra
    trained modules) is refused in one line naming the folder."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"--adapter {folder}: no {CONFIG} (a PEFT adapter folder, as "
                         "save_pretrained writes it)")
    c = read_json(path)
    weights = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(weights):
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
    tensors = {k: np.asarray(v) for k, v in read_safetensors(weights).items()}
    roles = peft_roles(tensors)
    if not roles:
        raise ValueError(f"--adapter {folder}: no LoRA tensor of a block's linear layer")
    spec = LoraSpec(int(c["r"]), float(c.get("lora_alpha", 8)),
                    float(c.get("lora_dropout", 0.0)), roles, bool(c.get("use_rslora")))
    return spec, tensors, c


def config_json(spec: LoraSpec, modules: list, base: str = "") -> dict:
    """adapter_config.json of ``spec`` adapting Hugging Face ``modules`` (their last names
    are PEFT's target_modules)."""
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(spec.rank),
            "lora_alpha": float(spec.alpha), "lora_dropout": float(spec.dropout),
            "use_rslora": bool(spec.rslora), "target_modules": targets, "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base or None,
            "revision": None, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None}


def write(out: str, spec: LoraSpec, tensors: dict, base: str = "") -> None:
    """A PEFT folder at ``out``: ``tensors`` (PEFT's names, float32) and their config."""
    from . import write_json_atomic
    from .tools import write_safetensors
    os.makedirs(out, exist_ok=True)
    modules = sorted({n[:n.rindex(".lora_")] for n in tensors})
    prefix = "base_model.model."
    write_safetensors(os.path.join(out, WEIGHTS),
                      {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    write_json_atomic(os.path.join(out, CONFIG),
                      config_json(spec, [m[len(prefix):] for m in modules], base))


def spec_of(meta: dict) -> LoraSpec:
    """The LoraSpec a LoRA checkpoint's meta records (checkpoint/meta.py: lora_meta)."""
    lo = meta["lora"]
    return LoraSpec(int(lo["rank"]), float(lo["alpha"]), 0.0, tuple(lo["targets"]),
                    bool(lo["rslora"]))


def adapted(base: str, spec: LoraSpec, values: dict | None = None, tensors: dict | None = None,
            where: str = ""):
    """(the model of Hugging Face folder ``base`` with LoRA adapters, its vocabulary): the
    adapters set from our logical ``values`` (a checkpoint's) or PEFT's ``tensors``."""
    from .. import nn
    from ..nn import lora
    from . import hf
    model, vocabulary = hf.load(base)
    fam = nn.family(model.config.arch)
    lora.apply(model, fam, model.config, spec, tensors, where)
    if values is not None:
        for path, a in lora.adapters(model):
            a.load_logical(values[path + ".lora.A"], values[path + ".lora.B"])
    return model, vocabulary


def checkpoint_model(meta: dict, values: dict, where: str):
    """The model a LoRA checkpoint (``meta``, its adapters' logical ``values``) stands for:
    its base folder read again, checked against the fingerprint it trained on."""
    from .errors import CheckpointError
    from .meta import base_fingerprint
    folder = meta.get("base_folder") or ""
    if not folder or not os.path.isdir(folder):
        raise CheckpointError(f"{where} holds LoRA adapters of the base {meta.get('base')} "
                              f"from {folder or 'a random initialisation'}, which is not here "
                              "to read")
    if base_fingerprint(folder) != meta.get("base"):
        raise CheckpointError(f"{where}: the base folder {folder} has changed since these "
                              f"adapters trained on it ({base_fingerprint(folder)}, they "
                              f"name {meta.get('base')})")
    return adapted(folder, spec_of(meta), values)


def merged(model) -> dict:
    """The base's parameters (our names, logical, host arrays) with every adapter's update
    added: W + s A_j B_j on each adapted piece (PEFT's merge_and_unload)."""
    from ..device import backend
    from ..nn import lora
    out = {name: backend.to_numpy(t.data).astype(np.float64) for name, t in lora.frozen(model)}
    for path, a in lora.adapters(model):
        A, B = (backend.to_numpy(p.data).astype(np.float64) for p in (a.A, a.B))
        W = out[path + ".weight"]
        cols = 0
        for j, (start, width) in enumerate(zip(a.starts, a.widths)):
            W[:, start:start + width] += a.scale * A[:, j * a.r:(j + 1) * a.r] @ \
                B[:, cols:cols + width]
            cols += width
    return out
