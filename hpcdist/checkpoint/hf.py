"""Hugging Face folders in: ``config.json`` + ``model.safetensors`` (read here, without torch)
and the tokenizer beside them, as hpcdist's parameter names, model shape and vocabulary — GPT-2
here, the Llama family (Llama, Mistral, Mixtral) in hf_llama.py; ``family``, ``shape``,
``params`` and ``load`` choose by the folder's ``model_type``.

The names follow the same table as the export (tools.py, ``_NANOGPT``): GPT-2's Conv1D
weights are stored (in, out) as ours are; an untied ``lm_head`` is a torch Linear (out, in).
"""
from __future__ import annotations

import os
import re

import numpy as np

from .hf_files import check_weights, folder_vocabulary, read_config, read_safetensors  # noqa: F401

gpt2_vocabulary = folder_vocabulary       # (the name other modules used)


def gpt2_shape(folder: str) -> dict:
    """The model shape of a GPT-2 ``config.json`` in hpcdist's words."""
    c = read_config(folder)
    if c.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{folder}: model_type {c.get('model_type')!r}, only gpt2 loads")
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{folder}: activation {c['activation_function']!r}; hpcdist's GELU "
                         "is the tanh approximation (gelu_new)")
    return {"n_layer": int(c["n_layer"]), "n_head": int(c["n_head"]),
            "n_embd": int(c["n_embd"]), "vocab_size": int(c["vocab_size"]),
            "block_size": int(c.get("n_positions", c.get("n_ctx", 1024))),
            "tie_weights": bool(c.get("tie_word_embeddings", True)), "bias": True,
            "eps": float(c.get("layer_norm_epsilon", 1e-5))}


def gpt2_params(folder: str, names) -> dict:
    """hpcdist name -> array for the parameter ``names`` of an nn.GPT of the folder's shape."""
    from .tools import _NANOGPT
    path = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no model.safetensors")
    theirs = read_safetensors(path)
    out = {}
    for name in names:
        for pattern, target, _ in _NANOGPT:
            if re.fullmatch(pattern, name):
                hf = re.sub(pattern, target, name)
                break
        else:
            raise ValueError(f"no GPT-2 name for {name!r}")
        value = theirs.get(hf, theirs.get(hf.replace("transformer.", "", 1)))
        if value is None:
            raise ValueError(f"{path} has no {hf} (for {name})")
        out[name] = np.ascontiguousarray(value.T if name == "lm_head.weight" else value)
    return out


def load_gpt2(folder: str):
    """(nn.GPT with the folder's weights, its vocabulary or None), on the active device."""
    from .. import nn
    shape = gpt2_shape(folder)
    eps = shape.pop("eps")
    model = nn.GPT(nn.GPTConfig(**shape))
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = eps
    model.load_state_dict(gpt2_params(folder, [n for n, _ in model.named_parameters()]))
    return model, gpt2_vocabulary(folder)


def family(folder: str) -> str:
    """hpcdist's family (``--arch``) for a Hugging Face folder: gpt or llama; an unknown
    architecture is refused in one line."""
    from .hf_llama import ARCHS
    kind = read_config(folder).get("model_type", "gpt2")
    if kind == "gpt2":
        return "gpt"
    if kind in ARCHS:
        return "llama"
    raise ValueError(f"{folder}: model_type {kind!r} is not a family hpcdist reads (gpt2, "
                     f"{', '.join(sorted(ARCHS))})")


def shape(folder: str) -> dict:
    """The folder's model as TrainConfig fields: arch and the family's shape (the same keys a
    flag would set)."""
    arch = family(folder)
    if arch == "gpt":
        out = gpt2_shape(folder)
        out.pop("eps")
    else:
        from .hf_llama import llama_shape
        out = llama_shape(folder)
    return {"arch": arch, **out}


def params(folder: str, arch: str, names, n_layer: int, experts: int = 0) -> dict:
    """hpcdist name -> array of the folder's weights for a model of ``arch``."""
    if arch == "gpt":
        return gpt2_params(folder, names)
    from .hf_llama import llama_params
    return llama_params(folder, names, n_layer, experts)


def load(folder: str):
    """(the folder's model with its weights, its vocabulary or None), on the active device."""
    if family(folder) == "gpt":
        return load_gpt2(folder)
    from .hf_llama import load_llama
    return load_llama(folder)
