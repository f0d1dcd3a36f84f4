"""What ``python -m hpcdist.checkpoint`` (cli.py) does: choosing a save folder's checkpoint,
verifying every one, and writing a checkpoint's parameters in other names and formats (.npz in
hpcdist's or nanoGPT's names, a Hugging Face folder with its tokenizer).

The rest of this design: docs/checkpoints.md, "hpcdist/checkpoint/tools.py"."""
from __future__ import annotations

import glob
import json
import os
import re
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


# hpcdist name -> (nanoGPT name, transpose?): our Linear stores (in, out), torch (out, in)
_NANOGPT = [
    (r"wte\.weight", "transformer.wte.weight", False),
    (r"wpe\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln_(\d)\.(weight|bias)", r"transformer.h.\1.ln_\2.\3", False),
    (r"blocks\.(\d+)\.attn\.c_attn\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"blocks\.(\d+)\.attn\.c_attn\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"blocks\.(\d+)\.attn\.c_proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"blocks\.(\d+)\.attn\.c_proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"lm_head\.weight", "lm_head.weight", True),
]


def nanogpt_names(params: dict) -> dict:
    """Our parameters under nanoGPT's names and layouts; a tied head becomes lm_head.weight."""
    out = {}
    for name, value in params.items():
        for pattern, target, transpose in _NANOGPT:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, target, name)] = value.T.copy() if transpose else value
                break
        else:
            raise ValueError(f"no nanoGPT name for {name!r}")
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])      # tied
    return out


def hf_gpt2_names(params: dict, meta: dict) -> dict:
    """Our parameters under Hugging Face GPT-2's names (its Conv1D stores (in, out), as we do;
    its untied ``lm_head`` is a torch Linear, (out, in)), in float32; biases a ``--no-bias`` model lacks are zeros (GPT-2 always has them); a tied
    head is left out (``tie_word_embeddings`` ties it on load)."""
    out = {}
    for name, value in params.items():
        for pattern, target, _ in _NANOGPT:
            if re.fullmatch(pattern, name):
                value = value.T if name == "lm_head.weight" else value
                out[re.sub(pattern, target, name)] = np.ascontiguousarray(value, np.float32)
                break
        else:
            raise ValueError(f"no GPT-2 name for {name!r}")
    C = out["transformer.wte.weight"].shape[1]
    widths = {"ln_1": C, "ln_2": C, "attn.c_attn": 3 * C, "attn.c_proj": C,
              "mlp.c_fc": 4 * C, "mlp.c_proj": C}
    for i in range(int(meta["n_layer"])):
        for part, width in widths.items():
            out.setdefault(f"transformer.h.{i}.{part}.bias", np.zeros(width, np.float32))
    out.setdefault("transformer.ln_f.bias", np.zeros(C, np.float32))
    return out


def hf_gpt2_config(params: dict, meta: dict) -> dict:
    """config.json of the same model for ``transformers.GPT2Config`` (GPT-2's tanh GELU,
    LayerNorm eps 1e-5, no dropout at inference)."""
    vocab, C = params["wte.weight"].shape
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": int(vocab), "n_positions": int(params["wpe.weight"].shape[0]),
            "n_embd": int(C), "n_layer": int(meta["n_layer"]), "n_head": int(meta["n_head"]),
            "n_inner": 4 * int(C), "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "tie_word_embeddings": bool(meta.get("tie_weights", True)),
            "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}


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


def export_hf(out: str, params: dict, meta: dict,
              vocabulary: dict | None = None) -> dict:
    """A Hugging Face folder of the checkpoint's family: GPT-2 (``export_gpt2``) or Llama /
    Mixtral (hf_llama.py's names and config), with the tokenizer."""
    if meta.get("arch", "gpt") == "gpt":
        return export_gpt2(out, params, meta, vocabulary)
    from .hf_llama import hf_llama_config, hf_llama_names
    tensors = hf_llama_names(params, meta)
    config = hf_llama_config(params, meta)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    os.makedirs(out, exist_ok=True)
    tokenizer = hf_tokenizer(vocabulary) if vocabulary else None
    if tokenizer is not None:
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": config["max_position_embeddings"]}, f, indent=1)
    config["bos_token_id"] = config["eos_token_id"] = None
    write_safetensors(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tensors


def export_gpt2(out: str, params: dict, meta: dict,
                vocabulary: dict | None = None) -> dict:
    """``out``/model.safetensors and ``out``/config.json: a GPT2LMHeadModel folder; with the
    checkpoint's vocabulary also ``tokenizer.json`` and ``tokenizer_config.json``, so that
    ``transformers.pipeline('text-generation', model=out)`` encodes, generates and decodes."""
    if int(meta.get("experts", 0)):
        raise ValueError(f"a mixture-of-experts model ({meta['experts']} experts per MoE "
                         "layer) has no GPT-2 form: Hugging Face's GPT-2 has no experts "
                         "(export refuses it; python -m hpcdist.sample reads it)")
    tensors = hf_gpt2_names(params, meta)
    config = hf_gpt2_config(params, meta)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    os.makedirs(out, exist_ok=True)
    tokenizer = hf_tokenizer(vocabulary) if vocabulary else None
    if tokenizer is not None:
        eot = tokenizer.token_to_id("<|endoftext|>")
        if eot is not None:                       # not token 0, which is a real token
            config["bos_token_id"] = config["eos_token_id"] = eot
        else:                                     # (absent, transformers assumes 50256)
            config["bos_token_id"] = config["eos_token_id"] = None
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"} \
            if eot is not None else {}
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": config["n_positions"], **special}, f, indent=1)
    write_safetensors(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tensors


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
