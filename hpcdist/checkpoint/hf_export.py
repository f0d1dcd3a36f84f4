"""A checkpoint as a Hugging Face folder of its family, one that can replace the folder it
started from: model.safetensors at the source's dtype (or ``--dtype``), config.json,
generation_config.json, and the tokenizer with its config. A model started from a folder
(--init-from) carries that folder's files (the meta's ``source``, checkpoint/meta.py): its
special-token ids, generation and tokenizer configs, special tokens, chat template, its
positions (a sliding window's context stays the context) and its dtype; a model trained from
scratch takes its ids from its training tokenizer's end-of-text token."""
from __future__ import annotations

import json
import os

import numpy as np

from .tools import write_safetensors

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}    # --dtype -> theirs
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPE_KEYS = ("torch_dtype", "dtype")            # transformers 4's spelling, and 5's


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


def export_dtype(choice: str, source_config: dict | None) -> str:
    """The weights' dtype (its name in config.json): ``choice`` (a --dtype), else the source
    folder's, else float32."""
    if choice:
        return DTYPES[choice]
    given = next((source_config[k] for k in DTYPE_KEYS if (source_config or {}).get(k)), "")
    return given if given in DTYPES.values() else "float32"


def cast(tensors: dict, dtype: str) -> tuple[dict, dict]:
    """(the float32 ``tensors`` at ``dtype``, the safetensors dtype of those not NumPy's):
    bfloat16 as its bits, rounded to nearest even (NaN kept NaN), needing no ml_dtypes."""
    if dtype == "float32":
        return tensors, {}
    if dtype == "float16":
        return {n: t.astype(np.float16) for n, t in tensors.items()}, {}
    out = {}
    for name, t in tensors.items():
        bits = np.ascontiguousarray(t, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out[name] = np.where(np.isnan(t), np.uint16(0x7FC0), rounded).astype(np.uint16)
    return out, {n: "BF16" for n in out}


def carried_config(adapter, ours: dict, source: dict | None, dtype: str, learned: bool,
                   where: str) -> dict:
    """config.json: the source's where the model still has its shape (the fields the family
    reads from both are the same: every key of theirs kept as written), else ours over it;
    the source's token ids, and its positions where no learned table fixes them; ``dtype``."""
    if source is None:
        return {**ours, "torch_dtype": dtype}
    mine, theirs = adapter.fields(ours, where), adapter.fields(source, where)
    if not learned:         # rotary: the run's block (and a window it does not reach, which
        for key in ("block_size", "sliding_window"):   # it drops) are the run's, not the model's
            mine.pop(key, None)
            theirs.pop(key, None)
    out = dict(source)
    if mine != theirs:
        out.update({k: v for k, v in ours.items() if k not in TOKEN_IDS + DTYPE_KEYS and not (
            k in ("max_position_embeddings", "sliding_window") and not learned)})
    for key in [k for k in DTYPE_KEYS if k in source] or ["torch_dtype"]:
        out[key] = dtype
    return out


def _special(tokenizer) -> tuple[dict, dict]:
    """(config.json's token ids, tokenizer_config's special tokens) of a training tokenizer:
    its end-of-text token as both ends (None: it has none; not token 0, a real token)."""
    eot = tokenizer.token_to_id("<|endoftext|>") if tokenizer is not None else None
    if eot is None:
        return {"bos_token_id": None, "eos_token_id": None}, {}
    return ({"bos_token_id": eot, "eos_token_id": eot},
            {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})


def export_hf(out: str, params: dict, meta: dict, vocabulary: dict | None = None,
              positions: int | None = None, dtype: str = "") -> dict:
    """``out``: model.safetensors, config.json, generation_config.json and, with the
    checkpoint's vocabulary, the tokenizer: ``transformers.pipeline('text-generation',
    model=out)`` encodes, generates and decodes. ``dtype``: a --dtype (default: the
    source's). Returns the tensors written (their names)."""
    from .. import nn
    cfg = export_config(params, meta, positions)
    family = nn.family(cfg.arch)
    files = (meta.get("source") or {}).get("files") or {}
    name = export_dtype(dtype, files.get("config.json"))
    tensors = family.hf.to_theirs(cfg, params)
    learned = family.model.PARTS.get("positions") is not None
    config = carried_config(family.hf, family.hf.config_json(cfg), files.get("config.json"),
                            name, learned, f"{out}/config.json")
    tokenizer = hf_tokenizer(vocabulary) if vocabulary else None
    ids, special = _special(tokenizer)
    if "config.json" not in files:
        config.update(ids)
    os.makedirs(out, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        _write(os.path.join(out, "tokenizer_config.json"), files.get(
            "tokenizer_config.json") or {"tokenizer_class": "PreTrainedTokenizerFast",
                                         "model_max_length": int(cfg.block_size), **special})
        for kept in ("special_tokens_map.json", "chat_template.jinja"):
            if kept in files:
                _write(os.path.join(out, kept), files[kept])
    _write(os.path.join(out, "generation_config.json"), files.get(
        "generation_config.json") or {"_from_model_config": True, **{
            k: config[k] for k in TOKEN_IDS if config.get(k) is not None}})
    weights, kinds = cast(tensors, name)
    write_safetensors(os.path.join(out, "model.safetensors"), weights, {"format": "pt"},
                      dtypes=kinds)
    _write(os.path.join(out, "config.json"), config)
    return tensors


def _write(path: str, value) -> None:
    """``value`` into ``path``: a text as it is, a JSON object indented."""
    with open(path, "w", encoding="utf-8") as f:
        if isinstance(value, str):
            f.write(value)
        else:
            json.dump(value, f, indent=1)


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
