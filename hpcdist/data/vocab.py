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

import hashlib
import json


def digits(num_digits: int) -> dict:
    return {"kind": "digits", "size": int(num_digits)}


def chars(alphabet) -> dict:
    return {"kind": "chars", "size": len(alphabet), "chars": "".join(alphabet)}


def tokenizer_file(path: str) -> dict:
    """The vocabulary of a Hugging Face ``tokenizer.json``."""
    with open(path, encoding="utf-8") as f:
        return tokenizer_text(f.read(), path)


def tokenizer_text(text: str, path: str = "the tokenizer") -> dict:
    """The vocabulary of a ``tokenizer.json``'s text."""
    try:
        vocab = json.loads(text)["model"]["vocab"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a Hugging Face tokenizer.json") from None
    added = json.loads(text).get("added_tokens") or []
    size = max([len(vocab)] + [int(t["id"]) + 1 for t in added])
    return {"kind": "tokenizer", "size": int(size), "tokenizer": text}


def token_ids(vocab_size: int) -> dict:
    """Shards that came without a tokenizer: ids only."""
    return {"kind": "tokens", "size": int(vocab_size)}


def digest(v: dict) -> str:
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]


def fingerprint(v: dict) -> str:
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
