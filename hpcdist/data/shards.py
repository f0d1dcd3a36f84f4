"""Token shards read by memory map: llm.c's format and raw uint16 ``.bin`` files.

llm.c's shard: a header of 256 little-endian int32 — magic 20240520, the version, the token
count — then the tokens. The version says their width, as llm.c's own writer does: 1 is
uint16 (GPT-2's vocabulary, any of at most 65,536 tokens), 2 is uint32 (Llama 3's 128,256,
Qwen2.5's 151,646, Gemma's 256,000). ``write_shard`` takes the narrowest that holds the
vocabulary, so llm.c reads both. A raw ``.bin`` (nanoGPT's ``train.bin``) is uint16 tokens
only, and says nothing of its vocabulary: ``--vocab-size`` is then required.

The rest of this design: docs/training.md, "hpcdist/data/shards.py"."""
from __future__ import annotations

import glob
import os

import numpy as np

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
WIDTHS = {1: "<u2", 2: "<u4"}          # version -> the tokens' type
MAX_VOCAB = 1 << 32                    # what uint32 ids can number


def version_for(vocab_size: int) -> int:
    """The shard version (token width) that holds ids below ``vocab_size``."""
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"a vocabulary of {vocab_size:,} does not fit uint32 token ids "
                         f"(at most {MAX_VOCAB:,})")
    return 1 if vocab_size <= 1 << 16 else 2


TAG = 3      # header int 3 (llm.c leaves 3..255 zero): the tokenizer's tag, 0 where unknown


def tokenizer_tag(vocabulary: dict) -> int:
    """A shard's mark of the tokenizer it was written with: 31 bits (never 0) of a digest of
    what decides the ids (the vocabulary, the merges, the added tokens), so that the same
    tokenizer saved with other formatting has the same tag."""
    import hashlib
    import json
    spec = json.loads(vocabulary["tokenizer"])
    model = spec.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    added = sorted((int(t["id"]), t["content"]) for t in spec.get("added_tokens") or [])
    raw = json.dumps([sorted((model.get("vocab") or {}).items()), merges, added]).encode()
    return int(hashlib.sha256(raw).hexdigest()[:8], 16) & 0x7FFFFFFF or 1


def write_shard(path: str, tokens, tag: int = 0, vocab_size: int | None = None) -> None:
    """One llm.c shard (header + tokens), written atomically: uint16 tokens (version 1) where
    ``vocab_size`` (default: the largest id + 1) is at most 65,536, uint32 (version 2) above;
    ``tag``: the tokenizer's (``tokenizer_tag``), kept in header int 3."""
    tokens = np.asarray(tokens)
    top = int(tokens.max()) + 1 if tokens.size else 0
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"token ids are non-negative, got {int(tokens.min())}")
    if vocab_size is not None and top > vocab_size:
        raise ValueError(f"token {top - 1:,} is outside the vocabulary of {vocab_size:,}")
    version = version_for(max(top, vocab_size or 0))
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = MAGIC, version, tokens.size, tag
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(WIDTHS[version]).tobytes())
        os.replace(tmp, path)
    except OSError as e:                 # a full disk: the path in the error, no partial file
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OSError(e.errno, e.strerror or str(e), e.filename or path) from None


def open_shard(path: str, vocab_size: int | None = None) -> np.memmap:
    """The tokens of one shard as a read-only memory map (llm.c's header checked; a raw
    uint16 file needs ``vocab_size``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token shard {path!r} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(min(size, HEADER_BYTES)), dtype="<i4")
    if head.size >= 3 and head[0] == MAGIC:
        if int(head[1]) not in WIDTHS:
            raise ValueError(f"{path}: llm.c shard version {head[1]}; this reader knows 1 "
                             "(uint16 tokens) and 2 (uint32)")
        width = np.dtype(WIDTHS[int(head[1])])
        count = int(head[2])
        if size != HEADER_BYTES + width.itemsize * count:
            raise ValueError(f"{path}: the header says {count:,} tokens, the file holds "
                             f"{(size - HEADER_BYTES) // width.itemsize:,} (truncated or "
                             "damaged)")
        return np.memmap(path, dtype=width, mode="r", offset=HEADER_BYTES, shape=(count,))
    if not path.endswith(".bin"):
        raise ValueError(f"{path}: not a token shard (no llm.c header, and raw uint16 files "
                         "are .bin)")
    if vocab_size is None:
        raise ValueError(f"{path} is raw uint16 tokens (no llm.c header): say the vocabulary "
                         "size with --vocab-size")
    if size % 2:
        raise ValueError(f"{path}: an odd number of bytes is not uint16 tokens")
    return np.memmap(path, dtype="<u2", mode="r", shape=(size // 2,))


def shard_tag(path: str) -> int:
    """The tokenizer tag in an llm.c shard's header (0: none, or not an llm.c shard)."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    return int(head[TAG]) if head.size == HEADER_INTS and head[0] == MAGIC else 0


def check_tags(paths, vocabulary: dict | None, source: str) -> None:
    """Refuse a shard written with another tokenizer than ``vocabulary`` (from ``source``)."""
    if not vocabulary or vocabulary.get("kind") != "tokenizer":
        return
    want = tokenizer_tag(vocabulary)
    for p in paths:
        got = shard_tag(p)
        if got and got != want:
            raise ValueError(f"{p} was written with another tokenizer than {source} (tag "
                             f"{got:08x}, {source} gives {want:08x}): its ids would mean other "
                             "tokens. Remove it, or prepare the folder again with --replace")


def is_token_data(spec: str) -> bool:
    """Whether --data names token shards (a prepared folder, a glob of .bin, a .bin)."""
    if os.path.isdir(spec):
        return bool(glob.glob(os.path.join(spec, "*.bin")))
    return spec.endswith(".bin") or any(ch in spec for ch in "*?[")


def shard_paths(spec: str) -> tuple[list[str], list[str]]:
    """(training shards, held-out shards) of --data: a folder's or a glob's ``*val*`` files
    are held out; without any, the caller holds out the last shard's tail."""
    paths = sorted(glob.glob(os.path.join(spec, "*.bin"))) if os.path.isdir(spec) else \
        sorted(glob.glob(spec))
    if not paths:
        raise FileNotFoundError(f"--data {spec!r}: no token shards there")
    val = [p for p in paths if "val" in os.path.basename(p)]
    return [p for p in paths if p not in val], val


class TokenShards:
    """Windows of ``block_size + 1`` tokens over memory-mapped shards (see the module doc).
    ``pieces``: (shard index, first token, last token) ranges of the shards this split uses."""

    def __init__(self, maps, pieces, block_size: int, vocab_size: int, vocabulary: dict,
                 split: str = "training"):
        self.maps, self.block_size, self.vocab_size = maps, block_size, vocab_size
        self.vocabulary = vocabulary
        self.pieces = [(s, lo, hi) for s, lo, hi in pieces if hi - lo > block_size]
        counts = [(hi - lo - 1) // block_size for _, lo, hi in self.pieces]
        self.starts = np.cumsum([0] + counts)
        if self.starts[-1] == 0:
            raise ValueError(f"the {split} token shards hold no window of block_size + 1 = "
                             f"{block_size + 1} tokens ({sum(hi - lo for _, lo, hi in pieces):,} "
                             f"tokens in all); lower --block-size"
                             + (", or prepare with a larger --val-fraction" if split ==
                                "held-out" else ""))

    def __len__(self):
        return int(self.starts[-1])

    def batch(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        piece = np.searchsorted(self.starts, idx, side="right") - 1
        T = self.block_size
        seq = np.empty((idx.size, T + 1), dtype=np.int64)
        for p in np.unique(piece):                     # one shard's windows at a time
            rows = np.flatnonzero(piece == p)
            s, lo, _ = self.pieces[p]
            first = lo + (idx[rows] - self.starts[p]) * T
            seq[rows] = self.maps[s][first[:, None] + np.arange(T + 1)]
        if seq.size and seq.max() >= self.vocab_size:
            raise ValueError(f"token {int(seq.max())} in the shards is outside the vocabulary "
                             f"of {self.vocab_size}: wrong --vocab-size or tokenizer")
        return seq[:, :-1], seq[:, 1:]


def token_datasets(spec: str, block_size: int, vocab_size: int | None, vocabulary: dict,
                   test_fraction: float = 0.05, source: str = "the tokenizer given"):
    """(train, test) TokenShards of --data ``spec``."""
    train_paths, val_paths = shard_paths(spec)
    if not train_paths:
        raise ValueError(f"--data {spec!r}: only held-out (val) shards, nothing to train on")
    paths = train_paths + val_paths
    maps = [open_shard(p, vocab_size) for p in paths]
    check_tags(paths, vocabulary, source)
    if vocab_size is None:
        raise ValueError("token shards need the vocabulary size: a tokenizer.json beside them "
                         "(python -m hpcdist.data prepare writes one), --tokenizer, or "
                         "--vocab-size")
    n_train = len(train_paths)
    if val_paths:
        train = [(i, 0, len(m)) for i, m in enumerate(maps[:n_train])]
        test = [(i, 0, len(maps[i])) for i in range(n_train, len(maps))]
    else:                                       # the last shard's tail is held out
        last = n_train - 1
        cut = len(maps[last]) - max(block_size + 1, int(len(maps[last]) * test_fraction))
        train = [(i, 0, len(m)) for i, m in enumerate(maps[:last])] + [(last, 0, cut)]
        test = [(last, cut, len(maps[last]))]
    return (TokenShards(maps, train, block_size, vocab_size, vocabulary),
            TokenShards(maps, test, block_size, vocab_size, vocabulary, "held-out"))
