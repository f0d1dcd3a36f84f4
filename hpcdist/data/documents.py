"""Documents with a loss mask: instruction data as shards, and its rows.

Beside each llm.c shard ``train_000000.bin`` lie ``train_000000.mask.npy`` (uint8 a token: 1
where the loss applies) and ``train_000000.docs.npy`` (int64: each document's start, then the
token count), all memory-mapped (O(batch) per rank); no document crosses a shard.
``Documents`` gives a padded row per document (``--packing off``), ``PackedDocuments`` rows of
several (best-fit decreasing); a longer document is truncated to the block and counted.
Targets the mask does not train are ``IGNORE``, and ``masked = True`` makes the step weigh
its micro-batches by their trained tokens (run/loop.py ``token_weights``).
"""
from __future__ import annotations

import os

import numpy as np

from . import shards


def companions(path: str) -> tuple[str, str]:
    base = path[:-4] if path.endswith(".bin") else path
    return base + ".mask.npy", base + ".docs.npy"


def has_documents(paths) -> bool:
    return bool(paths) and all(os.path.isfile(companions(p)[1]) for p in paths)


class DocumentWriter:
    """Documents in, shards of whole documents (at least one, about ``limit`` tokens) out."""

    def __init__(self, folder: str, prefix: str, limit: int, tag: int, vocab_size: int):
        self.folder, self.prefix, self.limit = folder, prefix, limit
        self.tag, self.vocab_size = tag, vocab_size
        self.ids, self.masks, self.written = [], [], []
        self.count = self.total = self.docs = self.trained = 0

    def add(self, ids, mask) -> None:
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.masks.append(np.asarray(mask, dtype=np.uint8))
        self.count += len(ids)
        self.total += len(ids)
        self.docs += 1
        self.trained += int(np.count_nonzero(mask))
        if self.count >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.ids:
            return
        path = os.path.join(self.folder, f"{self.prefix}_{len(self.written):06d}.bin")
        mask_path, docs_path = companions(path)
        starts = np.cumsum([0] + [len(i) for i in self.ids]).astype(np.int64)
        shards.write_shard(path, np.concatenate(self.ids), self.tag, self.vocab_size)
        np.save(mask_path, np.concatenate(self.masks))
        np.save(docs_path, starts)
        self.written.append(path)
        self.ids, self.masks, self.count = [], [], 0


class Documents:
    """One padded row per document over document shards (module doc)."""

    masked = True

    def __init__(self, paths, block_size: int, vocab_size: int, vocabulary: dict,
                 split: str = "training"):
        self.block_size, self.vocab_size, self.vocabulary = block_size, vocab_size, vocabulary
        self.maps, self.masks, self.starts = [], [], []
        for p in paths:
            tokens = shards.open_shard(p)
            mask_path, docs_path = companions(p)
            mask = np.load(mask_path, mmap_mode="r")
            starts = np.load(docs_path, mmap_mode="r")
            if mask.shape != tokens.shape or starts[-1] != tokens.size:
                raise ValueError(f"{p}: its mask or document index does not match its "
                                 f"{tokens.size:,} tokens (prepare the folder again)")
            self.maps.append(tokens)
            self.masks.append(mask)
            self.starts.append(starts)
        counts = [len(s) - 1 for s in self.starts]
        self.first = np.cumsum([0] + counts)          # the first document of each shard
        if self.first[-1] == 0:
            raise ValueError(f"the {split} shards hold no document")
        lengths = np.concatenate([np.diff(s) for s in self.starts])
        self.truncated = int((lengths > block_size + 1).sum())
        if split == "training":
            self._check_trains_something()

    def _check_trains_something(self, sample: int = 4096) -> None:
        """Refuse a block that cuts every trained token off (a prompt or template longer
        than the block: the run would train on nothing), judged by the first ``sample``
        documents (a look at their masks only)."""
        seen = 0
        for mask, starts in zip(self.masks, self.starts):
            for i in range(min(len(starts) - 1, sample - seen)):
                lo, hi = int(starts[i]), int(starts[i + 1])
                if np.asarray(mask[lo + 1:min(hi, lo + self.block_size + 1)]).any():
                    return
                seen += 1
            if seen >= sample:
                break
        raise ValueError(f"--block-size {self.block_size}: none of the first {seen:,} "
                         "documents has a trained token within the block (their prompts "
                         "fill it): raise --block-size, or prepare with --train-on all")

    def __len__(self):
        return int(self.first[-1])

    def _place(self, d: int, x, y, row: int, at: int) -> int:
        """Document ``d``'s first block_size + 1 tokens into row ``row`` of (x, y) from
        position ``at`` (inputs, and the targets its mask trains); the positions it took."""
        s = int(np.searchsorted(self.first, d, side="right")) - 1
        i = d - self.first[s]
        lo, hi = int(self.starts[s][i]), int(self.starts[s][i + 1])
        hi = min(hi, lo + self.block_size + 1)
        seq = np.asarray(self.maps[s][lo:hi], dtype=np.int64)
        trained = np.asarray(self.masks[s][lo + 1:hi], dtype=bool)
        n = max(seq.size - 1, 0)
        x[row, at:at + n] = seq[:-1]
        y[row, at:at + n] = np.where(trained, seq[1:], -100)
        return n

    def _rows(self, count: int):
        T = self.block_size
        return np.zeros((count, T), dtype=np.int64), np.full((count, T), -100, dtype=np.int64)

    def _checked(self, x):
        if x.size and x.max() >= self.vocab_size:
            raise ValueError(f"token {int(x.max())} in the shards is outside the vocabulary "
                             f"of {self.vocab_size}: wrong tokenizer")
        return x

    def batch(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        x, y = self._rows(idx.size)
        for row, d in enumerate(idx):
            self._place(int(d), x, y, row, 0)
        return self._checked(x), y


class PackedDocuments(Documents):
    """Rows of several whole documents (``--packing bfd``): best-fit decreasing, as trl's
    ``bfd`` packs. A document of n tokens takes n - 1 positions of a row (its inputs; its
    last token is a target only), so no position predicts another document's token; a row's
    batch carries each position's document start (nn/packing.py ``encode``): the model
    attends inside each document alone, from position 0. The loss of a packed row is then
    the sum of its documents' losses, each computed alone."""

    packed = True

    def __init__(self, paths, block_size: int, vocab_size: int, vocabulary: dict,
                 split: str = "training"):
        super().__init__(paths, block_size, vocab_size, vocabulary, split)
        import bisect
        T = block_size
        docs = np.concatenate([np.diff(s) for s in self.starts])      # tokens of each
        used = np.minimum(docs, T + 1) - 1                              # its positions
        order = np.argsort(-used, kind="stable")
        order = order[used[order] > 0]
        free, rows = [], []                      # (room left, row) sorted; row -> documents
        for d in order:
            need = int(used[d])
            at = bisect.bisect_left(free, (need, -1))
            if at == len(free):
                rows.append([int(d)])
                bisect.insort(free, (T - need, len(rows) - 1))
            else:
                room, r = free.pop(at)
                rows[r].append(int(d))
                bisect.insort(free, (room - need, r))
        if not rows:
            raise ValueError(f"the {split} shards hold no document of two tokens or more")
        self.rows = rows
        self.positions_used = int(used.sum())
        self.padding = 1.0 - self.positions_used / (len(rows) * T)
        self.unpacked_padding = 1.0 - self.positions_used / (len(order) * T)

    def __len__(self):
        return len(self.rows)

    def batch(self, indices):
        from ..nn.packing import encode
        idx = np.asarray(indices, dtype=np.int64)
        x, y = self._rows(idx.size)
        starts = np.zeros_like(x)
        for row, r in enumerate(idx):
            at = 0
            for d in self.rows[int(r)]:
                n = self._place(d, x, y, row, at)
                starts[row, at:at + n] = at
                at += n
            starts[row, at:] = at                 # the padding: a document of its own
        return encode(self._checked(x), starts), y


def document_datasets(spec: str, block_size: int, vocab_size: int | None, vocabulary: dict,
                      source: str, packing: str = "bfd"):
    """(train, held-out) rows of the document shards of --data ``spec``: packed (``bfd``)
    or a row each (``off``)."""
    train_paths, val_paths = shards.shard_paths(spec)
    shards.check_tags(train_paths + val_paths, vocabulary, source)
    if vocab_size is None:
        raise ValueError("document shards need the vocabulary size: a tokenizer.json beside "
                         "them (prepare writes one), or --tokenizer")
    if not train_paths:
        raise ValueError(f"--data {spec!r}: only held-out (val) shards, nothing to train on")
    if not val_paths:
        raise ValueError("document shards come with held-out ones (val_*.bin): prepare "
                         "with --val FILE or a --val-fraction above 0")
    kind = PackedDocuments if packing == "bfd" else Documents
    return (kind(train_paths, block_size, vocab_size, vocabulary),
            kind(val_paths, block_size, vocab_size, vocabulary, "held-out"))
