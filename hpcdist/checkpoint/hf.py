"""Hugging Face GPT-2 folders in: ``config.json`` + ``model.safetensors`` (read here, without
torch) and the tokenizer beside them, as hpcdist's parameter names, model shape and vocabulary.

The names follow the same table as the export (tools.py, ``_NANOGPT``): GPT-2's Conv1D
weights are stored (in, out) as ours are; an untied ``lm_head`` is a torch Linear (out, in).
"""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np

_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4",
           "BF16": "bf16"}


def read_safetensors(path: str) -> dict:
    """name -> array of a safetensors file (memory-mapped, copied on use)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not one of "
                             f"{sorted(_DTYPES)}")
        if dt == "bf16":                                  # bfloat16: the high half of fp32
            half = np.frombuffer(raw[a:b], dtype="<u2").astype(np.uint32) << 16
            arr = half.view(np.float32)
        else:
            arr = np.frombuffer(raw[a:b], dtype=dt)
        out[name] = arr.reshape(info["shape"])
    return out


def gpt2_shape(folder: str) -> dict:
    """The model shape of a GPT-2 ``config.json`` in hpcdist's words."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face GPT-2 folder has "
                                "config.json and model.safetensors)")
    with open(path) as f:
        c = json.load(f)
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


def gpt2_vocabulary(folder: str) -> dict | None:
    """The tokenizer of a GPT-2 folder as a vocabulary (tokenizer.json, or GPT-2's vocab.json
    + merges.txt), None when the folder has none."""
    from ..data import vocab
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return vocab.tokenizer_file(path)
    v, m = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if os.path.isfile(v) and os.path.isfile(m):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.BPE.from_file(v, m))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return {"kind": "tokenizer", "size": tok.get_vocab_size(), "tokenizer": tok.to_str()}
    return None


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
