"""What every Hugging Face model folder holds, read without torch: ``config.json``, safetensors
files and the tokenizer (as hpcdist's vocabulary). The families' readers build on these
(hf.py: the family by ``model_type``, its adapter for the rest)."""
from __future__ import annotations

import json
import os
import struct

import numpy as np

_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4",
           "BF16": "bf16"}
_ITEMSIZE = {"F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "BF16": 2}
_HEADER_MAX = 100 << 20          # the safetensors format's own limit on the header


class DamagedFile(ValueError):
    """A file that does not hold what its format says: the message names the file and the
    damage, the same in every command that reads it."""


def safetensors_header(path: str) -> tuple[dict, int]:
    """(the header's tensors, the offset of the data) of a safetensors file, every entry
    checked against the file: a dtype hpcdist reads, a shape whose bytes are the entry's
    span, spans inside the file. Raises DamagedFile naming the file and the fault."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DamagedFile(f"{path}: damaged safetensors file: {size} bytes, shorter "
                                  "than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_HEADER_MAX, size - 8):
                raise DamagedFile(f"{path}: damaged safetensors file: its header length says "
                                  f"{n:,} bytes, the file has {size - 8:,} after it")
            text = f.read(n)
    except OSError as e:
        raise DamagedFile(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        header = json.loads(text)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedFile(f"{path}: damaged safetensors file: its header is not JSON ({e})") \
            from None
    data = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], [int(d) for d in info["shape"]], \
                [int(o) for o in info["data_offsets"]]
        except (KeyError, TypeError, ValueError):
            raise DamagedFile(f"{path}: damaged safetensors file: tensor {name!r} lacks a "
                              "dtype, shape or data_offsets") from None
        if dtype not in _DTYPES:
            raise DamagedFile(f"{path}: tensor {name} has dtype {dtype}, not one of "
                              f"{sorted(_DTYPES)}")
        want = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        if not 0 <= a <= b or b - a != want:
            raise DamagedFile(f"{path}: damaged safetensors file: tensor {name} {dtype} "
                              f"{tuple(shape)} needs {want:,} bytes, its offsets {a:,}..{b:,} "
                              f"give {b - a:,}")
        if b > data:
            raise DamagedFile(f"{path}: damaged safetensors file (truncated?): tensor {name} "
                              f"ends at byte {b:,} of the data, the file holds {data:,}")
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": (a, b)}
    return tensors, 8 + n


def read_safetensors(path: str) -> dict:
    """name -> array of a safetensors file (memory-mapped, copied on use), checked first
    (``safetensors_header``)."""
    header, offset = safetensors_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset) if header else None
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dt = _DTYPES[info["dtype"]]
        if dt == "bf16":                                  # bfloat16: the high half of fp32
            half = np.frombuffer(raw[a:b], dtype="<u2").astype(np.uint32) << 16
            arr = half.view(np.float32)
        else:
            arr = np.frombuffer(raw[a:b], dtype=dt)
        out[name] = arr.reshape(info["shape"])
    return out


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder: model.safetensors, or the shards its index
    names."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{folder}: no model.safetensors (nor an index of shards)")
    try:
        names = sorted(set(read_json(index)["weight_map"].values()))
    except (KeyError, AttributeError, TypeError):
        raise DamagedFile(f"{index}: not a safetensors index (no weight_map of names to "
                          "files)") from None
    return [os.path.join(folder, n) for n in names]


def check_weights(folder: str) -> None:
    """Every weight file of the folder read as far as its header, each entry checked against
    the file's size (``safetensors_header``): a damaged file is one line before any work."""
    for path in weight_files(folder):
        safetensors_header(path)


def read_json(path: str, what: str = "") -> dict:
    """A JSON object from ``path``; a file that does not parse is one DamagedFile line naming
    it and where."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise DamagedFile(f"{path}: cannot be read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedFile(f"{path}: not valid JSON{what} ({e})") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path}: not valid JSON{what} (a {type(value).__name__}, not an "
                          "object)")
    return value


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json (a Hugging Face model folder has "
                                "config.json and model.safetensors)")
    return read_json(path)


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


# What an export carries from the folder a run started from, beside the weights it writes
SOURCE_JSON = ("config.json", "generation_config.json", "tokenizer_config.json",
               "special_tokens_map.json")
SOURCE_TEXT = ("chat_template.jinja",)


def source_files(folder: str) -> dict:
    """file name -> contents (parsed JSON; text for the chat template) of the files of
    ``folder`` that an export of a model started from it carries over (SOURCE_JSON,
    SOURCE_TEXT), those present."""
    out = {}
    for name in SOURCE_JSON:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            out[name] = read_json(path)
    for name in SOURCE_TEXT:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                out[name] = f.read()
    return out

