"""Vocabularies: what token ids mean, kept with every checkpoint and compared on resume.

A vocabulary is a small JSON value: the digits of a digit task, the characters of a text file,
a Hugging Face ``tokenizers`` tokenizer (its whole ``tokenizer.json``), or bare token ids of
shards that came without one. ``fingerprint`` names it in a line ("65 characters 'a..z',
sha256 3f2a..."); a checkpoint stores the whole value, and ``--resume`` with data whose
vocabulary differs is refused in one line naming both, before any rank builds a model: a
resume never continues on scrambled ids.

``Tokenizer`` turns text into ids and back for sampling and export, whatever the kind.
"""
from __future__ import annotations

import functools
import hashlib
import json


def digits(num_digits: int) -> dict:
    return {"kind": "digits", "size": int(num_digits)}


def chars(alphabet) -> dict:
    return {"kind": "chars", "size": len(alphabet), "chars": "".join(alphabet)}


def tokenizer_file(path: str) -> dict:
    """The vocabulary of a Hugging Face ``tokenizer.json``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (not UTF-8 text: {e})") \
            from None
    return tokenizer_text(text, path)


def tokenizer_text(text: str, path: str = "the tokenizer") -> dict:
    """The vocabulary of a ``tokenizer.json``'s text; text that is not one is a ValueError
    naming ``path`` and what is wrong."""
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (not valid JSON: {e})") \
            from None
    try:
        vocab = spec["model"]["vocab"]
        added = spec.get("added_tokens") or []
        size = max([len(vocab)] + [int(t["id"]) + 1 for t in added])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json (no model.vocab, or "
                         "added_tokens without ids)") from None
    return {"kind": "tokenizer", "size": int(size), "tokenizer": text}


def same(saved: str, v: dict) -> bool:
    """Whether a fingerprint a checkpoint stored names the vocabulary ``v``."""
    return saved in (fingerprint(v), fingerprint(v, written_digest))


def token_ids(vocab_size: int) -> dict:
    """Shards that came without a tokenizer: ids only."""
    return {"kind": "tokens", "size": int(vocab_size)}


def canonical(v: dict) -> dict:
    """The vocabulary as its meaning: a tokenizer's ``tokenizer.json`` parsed by ``tokenizers``
    and written back with sorted keys, without what does not change a token's id (its
    version, padding and truncation), so the same tokenizer saved by transformers (indented),
    by ``tokenizers`` or by ``prepare`` (compact) is one value; other kinds are their value."""
    if v.get("kind") != "tokenizer":
        return v
    try:
        from tokenizers import Tokenizer as HF
        spec = json.loads(HF.from_str(v["tokenizer"]).to_str())
    except Exception:                        # (not parsable by tokenizers: its JSON as written)
        spec = json.loads(v["tokenizer"])
    for key in ("version", "padding", "truncation"):
        spec.pop(key, None)
    spec["added_tokens"] = sorted(spec.get("added_tokens") or [], key=lambda t: int(t["id"]))
    return {"kind": "tokenizer", "size": v["size"],
            "tokenizer": json.dumps(spec, sort_keys=True, separators=(",", ":"))}


def digest(v: dict) -> str:
    if v.get("kind") == "tokenizer":      # (parsed once per tokenizer, not at every save)
        return _tokenizer_digest(v["tokenizer"], int(v["size"]))
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=8)
def _tokenizer_digest(text: str, size: int) -> str:
    v = canonical({"kind": "tokenizer", "size": size, "tokenizer": text})
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]


def written_digest(v: dict) -> str:
    """The digest of a tokenizer as its file was written (what checkpoints stored before
    ``canonical``): a resume of such a checkpoint on the same file still compares equal."""
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]


def fingerprint(v: dict, digest=digest) -> str:
    """One line that names a vocabulary (what a checkpoint's meta compares)."""
    kind, size = v.get("kind"), v.get("size")
    if kind == "digits":
        what = f"digits 0-{size - 1}"
    elif kind == "chars":
        text = v["chars"]
        shown = text if len(text) <= 24 else text[:12] + ".." + text[-10:]
        what = f"{size} characters {shown!r}"
    elif kind == "tokenizer":
        what = f"a tokenizer of {size:,} tokens"
    else:
        what = f"{size:,} token ids (no tokenizer)"
    return f"{what}, sha256 {digest(v)}"


class Tokenizer:
    """Text <-> ids for a vocabulary (characters or a Hugging Face tokenizer)."""

    def __init__(self, v: dict):
        self.vocabulary, self.kind = v, v.get("kind")
        if self.kind == "chars":
            self.itos = list(v["chars"])
            self.stoi = {c: i for i, c in enumerate(self.itos)}
        elif self.kind == "tokenizer":
            from tokenizers import Tokenizer as HF
            self.hf = HF.from_str(v["tokenizer"])
        else:
            raise ValueError(f"a vocabulary of {fingerprint(v)} has no text: sample with ids, "
                             "or train from text or a tokenizer")

    @property
    def size(self) -> int:
        return int(self.vocabulary["size"])

    def encode(self, text: str) -> list:
        if self.kind == "chars":
            missing = sorted({c for c in text if c not in self.stoi})
            if missing:
                raise ValueError(f"characters not in the vocabulary: {''.join(missing)!r}")
            return [self.stoi[c] for c in text]
        return self.hf.encode(text).ids

    def decode(self, ids) -> str:
        if self.kind == "chars":
            return "".join(self.itos[int(i)] for i in ids)
        return self.hf.decode([int(i) for i in ids])

    @property
    def eot(self):
        """The end-of-text id, where the tokenizer has one (None otherwise)."""
        if self.kind == "tokenizer":
            return self.hf.token_to_id("<|endoftext|>")
        return None
