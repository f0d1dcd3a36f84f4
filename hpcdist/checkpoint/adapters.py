"""LoRA runs' adapters out and their models back: PEFT folders written (``checkpoint export
--format peft``), a LoRA checkpoint's model rebuilt on its base (sample, export), and the
merged base (``--merge``); checkpoint/peft.py reads the folders."""
from __future__ import annotations

import os

import numpy as np

from ..nn.lora import LoraSpec
from .peft import CONFIG, WEIGHTS, base_fingerprint


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
    from ..nn.lora import PREFIX
    modules = sorted({n[:n.rindex(".lora_")] for n in tensors})
    write_safetensors(os.path.join(out, WEIGHTS),
                      {k: np.asarray(v, np.float32) for k, v in tensors.items()})
    write_json_atomic(os.path.join(out, CONFIG),
                      config_json(spec, [m[len(PREFIX):] for m in modules], base))


def spec_of(meta: dict) -> LoraSpec:
    """The LoraSpec a LoRA checkpoint's meta records (checkpoint/meta.py: lora_meta)."""
    lo = meta["lora"]
    return LoraSpec(int(lo["rank"]), float(lo["alpha"]), 0.0, tuple(lo["targets"]),
                    bool(lo["rslora"]))


def adapted(base: str, spec: LoraSpec, values: dict | None = None, tensors: dict | None = None,
            where: str = "", nf4: bool = False):
    """(the model of Hugging Face folder ``base`` with LoRA adapters, its vocabulary): the
    adapters set from our logical ``values`` (a checkpoint's) or PEFT's ``tensors``; with
    ``nf4`` the block weights in 4 bits, as a QLoRA run trained them."""
    from .. import nn
    from ..nn import lora
    from . import hf
    model, vocabulary = hf.load(base)
    fam = nn.family(model.config.arch)
    lora.apply(model, fam, model.config, spec, tensors=tensors, where=where, nf4=nf4)
    if values is not None:
        for path, a in lora.adapters(model):
            a.load_logical(values[path + ".lora.A"], values[path + ".lora.B"])
    return model, vocabulary


def checkpoint_model(meta: dict, values: dict, where: str):
    """The model a LoRA checkpoint (``meta``, its adapters' logical ``values``) stands for:
    its base folder read again, checked against the fingerprint it trained on."""
    from .errors import CheckpointError
    folder = meta.get("base_folder") or ""
    if not folder or not os.path.isdir(folder):
        raise CheckpointError(f"{where} holds LoRA adapters of the base {meta.get('base')} "
                              f"from {folder or 'a random initialisation'}, which is not here "
                              "to read")
    if base_fingerprint(folder) != meta.get("base"):
        raise CheckpointError(f"{where}: the base folder {folder} has changed since these "
                              f"adapters trained on it ({base_fingerprint(folder)}, they "
                              f"name {meta.get('base')})")
    return adapted(folder, spec_of(meta), values,
                   nf4=meta["lora"].get("base_dtype") == "nf4")


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
