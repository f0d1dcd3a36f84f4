"""What every Hugging Face model folder holds, read without torch: ``config.json``, safetensors
files and the tokenizer (as hpcdist's vocabulary). The families' readers build on these
(hf.py: GPT-2 and the choice by ``model_type``; hf_llama.py: Llama, Mistral, Mixtral)."""
from __future__ import annotations

import json
import os
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



def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face model folder has "
                                "config.json and model.safetensors)")
    with open(path) as f:
        return json.load(f)


def folder_vocabulary(folder: str) -> dict | None:
    """The tokenizer of a Hugging Face folder as a vocabulary (tokenizer.json, or GPT-2's vocab.json
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
