"""What ``python -m hpcdist.checkpoint`` (cli.py) does: choosing a save folder's checkpoint,
verifying every one, and writing a checkpoint's parameters in other names and formats (.npz in
hpcdist's or nanoGPT's names, a Hugging Face folder with its tokenizer).

The rest of this design: docs/checkpoints.md, "hpcdist/checkpoint/tools.py"."""
from __future__ import annotations

import glob
import json
import os
import struct
import sys

import numpy as np

from . import LATEST, MANIFEST, CheckpointError, Reader, _latest_name, newest_verified


def _is_save_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST)) or not os.path.isfile(
        os.path.join(path, MANIFEST))


def choose(path: str, say=None) -> str:
    """The checkpoint a tool reads for ``path``: ``path`` itself, or a save folder's newest
    that verifies; where a newer one is damaged, ``say`` is told which step is used and why."""
    if not _is_save_folder(path):
        return path
    folder, problems = newest_verified(path)
    if folder is None:
        raise CheckpointError(f"{path}: " + ("no checkpoint verifies: " + "; ".join(problems)
                                             if problems else "no checkpoint here"))
    if problems and say is not None:
        say(f"note: using {folder}, the newest checkpoint that verifies, not the newest: "
            + "; ".join(problems))
    return folder


def verify_all(path: str) -> int:
    """``verify``: every checkpoint of a save folder (or the one named), a line each; 1 when
    any is damaged or ``latest`` names none that verifies, naming them."""
    save_folder = _is_save_folder(path)
    folders = sorted(glob.glob(os.path.join(path, "step_*"))) if save_folder else [path]
    if not folders:
        raise CheckpointError(f"{path}: no checkpoint here")
    damaged = []
    for folder in folders:
        try:
            reader = Reader(folder)
            reader.verify()
            for name in reader.tensors:                  # every tensor assembles
                reader.tensor(name)
            m = reader.manifest
            print(f"{folder}: step {m['step']}, {len(m['files'])} files and "
                  f"{len(m['tensors'])} tensors verified")
        except CheckpointError as e:
            damaged.append(os.path.basename(folder))
            print(f"{folder}: DAMAGED: {e}", file=sys.stderr)
    if save_folder:
        for stage in sorted(glob.glob(os.path.join(path, "partial.*"))):
            print(f"note: {stage}: an interrupted save, not a checkpoint (the next run in this "
                  "folder removes it)", file=sys.stderr)
        name = _latest_name(path)                     # a pointer to nothing is damage too
        if name is not None and not os.path.isdir(os.path.join(path, name)):
            print(f"{os.path.join(path, LATEST)} names {name!r}, which does not exist",
                  file=sys.stderr)
            damaged.append(f"'latest' -> {name}")
        good = [f for f in folders if os.path.basename(f) not in damaged]
        if damaged and good:                           # newest_verified's choice, from the above
            chosen = os.path.join(path, name) if name and os.path.join(path, name) in good \
                else good[-1]
            print(f"note: a resume or a tool would use {chosen}", file=sys.stderr)
    if damaged:
        steps = [d for d in damaged if not d.startswith("'latest'")]
        print(f"python -m hpcdist.checkpoint: error: {len(steps)} of {len(folders)} "
              f"checkpoint(s) damaged: {', '.join(damaged)}", file=sys.stderr)
        return 1
    return 0


_SAFETENSORS_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
                       "int32": "I32", "bfloat16": "BF16"}


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header (name ->
    dtype, shape, [begin, end) in the data), then the tensors' little-endian bytes, C order;
    written atomically."""
    header, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype.name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: no safetensors dtype for {t.dtype}")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype.name], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                 # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).astype(
                tensors[name].dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def export_config(params: dict, meta: dict, positions: int | None = None):
    """The model config (its family's dataclass) of a checkpoint's parameters and meta;
    ``positions``: the positions the model was built for (a learned table's rows; else the
    checkpoint's record, which an --init-from run took from its folder; else the block)."""
    from .. import nn
    parts = nn.family(nn.arch_of(meta)).model.PARTS
    vocab = params[parts["tokens"] + ".weight"]
    table = parts.get("positions")
    block = params[table + ".weight"].shape[0] if table else \
        positions or meta.get("block_size", 1024)
    return nn.config_of(meta, vocab_size=int(vocab.shape[0]), block_size=int(block))


def export_hf(out: str, params: dict, meta: dict, vocabulary: dict | None = None,
              positions: int | None = None) -> dict:
    """``out``/model.safetensors and ``out``/config.json: a Hugging Face folder of the
    checkpoint's family (its adapter's names and config.json); with the checkpoint's
    vocabulary also ``tokenizer.json`` and ``tokenizer_config.json``, so that
    ``transformers.pipeline('text-generation', model=out)`` encodes, generates and decodes."""
    from .. import nn
    cfg = export_config(params, meta, positions)
    adapter = nn.family(cfg.arch).hf
    tensors = adapter.to_theirs(cfg, params)
    config = adapter.config_json(cfg)
    os.makedirs(out, exist_ok=True)
    tokenizer = hf_tokenizer(vocabulary) if vocabulary else None
    config["bos_token_id"] = config["eos_token_id"] = None
    special = {}
    if tokenizer is not None:
        eot = tokenizer.token_to_id("<|endoftext|>")
        if eot is not None:                       # not token 0, which is a real token
            config["bos_token_id"] = config["eos_token_id"] = eot
            special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": int(cfg.block_size), **special}, f, indent=1)
    write_safetensors(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tensors


def export_names(params: dict, meta: dict, names: str) -> dict:
    """The parameters under another project's names (``--names``): one the checkpoint's
    family declares (nn.Family.exports), else a one-line refusal."""
    from .. import nn
    f = nn.family(nn.arch_of(meta))
    exports = dict(f.exports)
    if names not in exports:
        raise ValueError(f"--names {names}: a {f.title} checkpoint exports "
                         f"{', '.join(['hpcdist', *exports])} names")
    return exports[names](params)


def hf_tokenizer(vocabulary: dict):
    """A ``tokenizers.Tokenizer`` for a checkpoint's vocabulary: its own tokenizer, or for
    characters one that maps each character to its id and joins them back (None for
    vocabularies without text: digits, bare ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if vocabulary.get("kind") == "tokenizer":
        return Tokenizer.from_str(vocabulary["tokenizer"])
    if vocabulary.get("kind") != "chars":
        return None
    chars = vocabulary["chars"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok
