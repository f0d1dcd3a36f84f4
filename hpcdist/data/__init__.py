"""Datasets and the sampler: embedded digit tasks, a character-level text loader, and
``DistributedSampler`` (each rank its own shard, every rank the same number of batches).

Every dataset is a list of examples ``0 .. len-1`` and ``batch(indices) -> (x, y)`` as host
int64 arrays: ``x`` (B, T) tokens in, ``y`` (B, T) next tokens, ``IGNORE`` where no loss applies.
"""
from __future__ import annotations

import os

import numpy as np

from . import vocab

IGNORE = -100  # target value that the loss skips (matches ops.cross_entropy's default)


class DigitTask:
    """Sort or reverse a sequence of ``length`` digits in ``[0, num_digits)``.

    Example (sort, length 4): input 3 1 2 1 -> output 1 1 2 3. The model reads the input and
    the output so far, and predicts the output (minGPT's sort demo format, no separator):
    x = 3 1 2 1 1 1 2, y = - - - 1 1 2 3 (positions marked - are not scored).
    All ``num_digits**length`` sequences are enumerated; a seeded permutation puts
    ``test_fraction`` of them in a held-out split that training never sees.
    """

    kinds = ("sort", "reverse")

    def __init__(self, kind: str = "sort", length: int = 6, num_digits: int = 4,
                 split: str = "train", test_fraction: float = 0.25, seed: int = 1234):
        if kind not in self.kinds:
            raise ValueError(f"unknown digit task {kind!r}: choose one of {', '.join(self.kinds)}")
        if length < 2 or num_digits < 2:
            raise ValueError("a digit task needs length >= 2 and num_digits >= 2")
        total = num_digits ** length
        if total > 10_000_000:
            raise ValueError(f"{num_digits}**{length} sequences is too many to enumerate; "
                             "lower length or num_digits")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.kind, self.length, self.num_digits = kind, length, num_digits
        self.vocab_size = num_digits
        self.vocabulary = vocab.digits(num_digits)
        self.block_size = 2 * length - 1
        order = np.random.default_rng(seed).permutation(total)
        n_test = max(1, int(round(total * test_fraction)))
        self.ids = order[:n_test] if split == "test" else order[n_test:]

    def __len__(self):
        return len(self.ids)

    def batch(self, indices):
        ids = self.ids[np.asarray(indices)]
        n, V = self.length, self.num_digits
        digits = (ids[:, None] // V ** np.arange(n - 1, -1, -1)[None, :]) % V   # (B, n)
        out = np.sort(digits, axis=1) if self.kind == "sort" else digits[:, ::-1]
        seq = np.concatenate([digits, out], axis=1)                           # (B, 2n)
        x = seq[:, :-1].astype(np.int64)
        y = seq[:, 1:].astype(np.int64)
        y[:, :n - 1] = IGNORE
        return x, y


def read_text(path: str, encoding: str = "utf-8") -> str:
    """The text of a data file, strictly decoded: a directory, a binary file or bytes that are
    not ``encoding`` are refused with what to do (never replaced silently)."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory; pass a text file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"data file {path!r} is empty")
    if b"\0" in raw[:1 << 16] and not encoding.lower().startswith("utf-16"):
        raise ValueError(f"data file {path!r} looks binary (it has NUL bytes); pass a text file")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {path!r} is not valid {encoding} (byte 0x{raw[e.start]:02x} "
                         f"at offset {e.start}); pass --data-encoding with the file's encoding, "
                         "e.g. --data-encoding latin-1") from None
    except LookupError:
        raise ValueError(f"unknown --data-encoding {encoding!r}") from None


class CharText:
    """Character-level language modelling on a user's text file.

    The first ``1 - test_fraction`` of the text trains, the rest is held out; example i is the
    window ``text[i : i + block_size + 1]``.
    """

    def __init__(self, path: str, block_size: int = 64, split: str = "train",
                 test_fraction: float = 0.1, encoding: str = "utf-8"):
        text = read_text(path, encoding)
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.itos = chars
        self.vocab_size = len(chars)
        self.vocabulary = vocab.chars(chars)
        self.block_size = block_size
        codes = np.fromiter((self.stoi[c] for c in text), dtype=np.int64, count=len(text))
        cut = int(len(codes) * (1 - test_fraction))
        self.codes = codes[:cut] if split == "train" else codes[cut:]
        if len(self.codes) < block_size + 1:
            raise ValueError(f"data file {path!r}: the {split} split has {len(self.codes)} "
                             f"characters, fewer than block_size + 1 = {block_size + 1}; "
                             "use a longer file or a smaller --block-size")

    def __len__(self):
        return len(self.codes) - self.block_size

    def batch(self, indices):
        idx = np.asarray(indices)[:, None] + np.arange(self.block_size + 1)[None, :]
        seq = self.codes[idx]
        return seq[:, :-1], seq[:, 1:]


class DistributedSampler:
    """Batches of example indices for one rank: a seeded shuffle per epoch, split over ranks.

    Every rank gets the same number of batches per epoch, so no rank waits in a collective for
    a batch that never comes: with ``drop_last`` the tail that does not fill a global batch is
    dropped; otherwise the permutation is padded by wrapping around. Rank r takes every
    world-th example starting at r, as torch's DistributedSampler does.
    """

    def __init__(self, n: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = 0,
                 shuffle: bool = True, *, drop_last: bool = True):
        if n <= 0:
            raise ValueError("the dataset is empty")
        if batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        global_batch = batch_size * world
        if drop_last and n < global_batch:
            raise ValueError(f"dataset of {n} examples is smaller than one global batch "
                             f"({batch_size} x {world} ranks = {global_batch})")
        self.n, self.batch_size, self.rank, self.world = n, batch_size, rank, world
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch (checkpointed)
        self._cache = (None, None)  # (epoch, this rank's indices for it)
        per_epoch = n // global_batch if drop_last else -(-n // global_batch)
        self.batches_per_epoch = per_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    # Up to this many examples an epoch's order is a materialised permutation (8 bytes an
    # example per rank: 128 MiB at the limit); beyond it (token corpora of billions of
    # tokens) a Feistel bijection computes each batch's examples alone: O(batch) memory, and
    # a 1 GB corpus starts in seconds instead of shuffling half a billion indices first.
    PERMUTE_MAX = 1 << 24

    def _epoch_indices(self):
        if self._cache[0] == self.epoch:
            return self._cache[1]
        order = (np.random.default_rng((self.seed, self.epoch)).permutation(self.n)
                 if self.shuffle else np.arange(self.n))
        need = self.batches_per_epoch * self.batch_size * self.world
        if need > self.n:                                  # pad by wrapping around
            order = np.concatenate([order, order[:need - self.n]])
        mine = order[:need][self.rank::self.world]         # (batches_per_epoch * batch_size,)
        self._cache = (self.epoch, mine)
        return mine

    def next_batch(self):
        """Indices of this rank's next batch; moves to the next epoch when one ends."""
        if self.position >= self.batches_per_epoch:
            self.set_epoch(self.epoch + 1)
        b = self.position
        self.position += 1
        if self.n > self.PERMUTE_MAX and self.drop_last:
            k = b * self.batch_size + np.arange(self.batch_size, dtype=np.int64)
            j = k * self.world + self.rank                 # as order[rank::world] takes them
            return feistel(j, self.n, (self.seed, self.epoch)) if self.shuffle else j
        mine = self._epoch_indices()
        return mine[b * self.batch_size:(b + 1) * self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


def feistel(j, n: int, key) -> np.ndarray:
    """A seeded bijection of [0, n) applied to the indices ``j``: a 4-round Feistel network
    on the smallest even number of bits that covers n, cycle-walking the values that land
    past n (fewer than half do, so it ends in a few rounds)."""
    bits = max(2, (int(n) - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(int(k)) for k in np.random.default_rng(key).integers(
        0, 2 ** 63, size=4)]

    def rounds(x):
        left, right = x >> half, x & mask
        for k in keys:
            z = (right + k) * np.uint64(0x9E3779B97F4A7C15)
            z ^= z >> np.uint64(31)
            z *= np.uint64(0xBF58476D1CE4E5B9)
            z ^= z >> np.uint64(29)
            left, right = right, left ^ (z & mask)
        return (left << half) | right

    out = rounds(np.asarray(j, dtype=np.uint64))
    bad = out >= np.uint64(n)
    while bad.any():
        out[bad] = rounds(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


def make_task(task: str, *, length=6, num_digits=4, data=None, block_size=64, seed=1234,
              encoding="utf-8", tokenizer="", vocab_size=0, packing="bfd"):
    """(train, test) datasets for a task name: 'sort', 'reverse' or 'text' (needs ``data``:
    a text file, or token shards — a folder from ``python -m hpcdist.data prepare``, a glob,
    a ``.bin``). ``tokenizer``: a tokenizer.json to encode a text file with, or the one the
    shards were made with (default: the shards' folder's); ``vocab_size``: for raw shards."""
    if task in DigitTask.kinds:
        return (DigitTask(task, length, num_digits, "train", seed=seed),
                DigitTask(task, length, num_digits, "test", seed=seed))
    if task == "text":
        if not data:
            raise ValueError("task 'text' needs a data file: --data PATH")
        from . import shards
        if shards.is_token_data(data):
            if not tokenizer and os.path.isdir(data) and \
                    os.path.isfile(os.path.join(data, "tokenizer.json")):
                tokenizer = os.path.join(data, "tokenizer.json")
            v = vocab.tokenizer_file(tokenizer) if tokenizer else \
                vocab.token_ids(vocab_size) if vocab_size else None
            if v is not None and vocab_size and v["size"] != vocab_size:
                raise ValueError(f"--vocab-size {vocab_size} but {tokenizer} has {v['size']} "
                                 "tokens: drop --vocab-size")
            from . import documents
            if documents.has_documents(sum(shards.shard_paths(data), [])):   # chat data
                return documents.document_datasets(data, block_size, v and v["size"], v,
                                                   tokenizer or "--vocab-size", packing)
            return shards.token_datasets(data, block_size, v and v["size"], v,
                                         source=tokenizer or "--vocab-size")
        if tokenizer:
            v = vocab.tokenizer_file(tokenizer)
            ids = np.asarray(vocab.Tokenizer(v).encode(read_text(data, encoding)),
                             dtype=np.int64)
            cut = max(block_size + 1, int(len(ids) * 0.9))
            return (shards.TokenShards([ids], [(0, 0, cut)], block_size, v["size"], v),
                    shards.TokenShards([ids], [(0, cut, len(ids))], block_size, v["size"], v,
                                       "held-out"))
        return (CharText(data, block_size, "train", encoding=encoding),
                CharText(data, block_size, "test", encoding=encoding))
    raise ValueError(f"unknown task {task!r}: choose one of sort, reverse, text")


def datasets_of(cfg):
    """(train, test) of a run's settings (a TrainConfig, or anything with its fields)."""
    if cfg.tokenizer and not os.path.isfile(cfg.tokenizer):
        raise FileNotFoundError(f"--tokenizer {cfg.tokenizer}: no such file" + (
            " (a folder: pass its tokenizer.json)" if os.path.isdir(cfg.tokenizer) else ""))
    return make_task(cfg.task, length=cfg.length, num_digits=cfg.num_digits,
                     data=cfg.data or None, block_size=cfg.block_size,
                     encoding=cfg.data_encoding, tokenizer=cfg.tokenizer,
                     vocab_size=cfg.vocab_size, packing=getattr(cfg, "packing", "bfd"))
