"""``python -m hpcdist.data prepare TEXT... --vocab-size N --out DIR``: a corpus as token shards.

Trains a byte-level BPE tokenizer on the text files with Hugging Face ``tokenizers`` (nothing
is downloaded; ``--tokenizer tokenizer.json`` uses a given one instead), then encodes every
file in pieces of a few MiB and writes llm.c shards (data/shards.py) of at most
``--shard-tokens`` tokens: ``DIR/train_000000.bin`` ..., and the last ``--val-fraction`` of
each file to ``DIR/val_000000.bin`` ...; an end-of-text token separates the files. The
tokenizer is copied to ``DIR/tokenizer.json``. Train on it with
``mpirun -n 8 python -m hpcdist.train --task text --data DIR``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from . import shards

EOT = "<|endoftext|>"


class ShardWriter:
    """Tokens in, shards of at most ``limit`` tokens out (``prefix_000000.bin`` ...)."""

    def __init__(self, folder: str, prefix: str, limit: int):
        self.folder, self.prefix, self.limit = folder, prefix, limit
        self.parts, self.count, self.written, self.total = [], 0, [], 0

    def add(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.uint16)
        self.parts.append(ids)
        self.count += ids.size
        self.total += ids.size
        while self.count >= self.limit:
            self.flush(self.limit)

    def flush(self, n: int | None = None) -> None:
        if not self.count:
            return
        allids = np.concatenate(self.parts)
        n = self.count if n is None else n
        path = os.path.join(self.folder, f"{self.prefix}_{len(self.written):06d}.bin")
        shards.write_shard(path, allids[:n])
        self.written.append(path)
        self.parts, self.count = [allids[n:]], allids.size - n


def train_tokenizer(files, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens (the end-of-text token included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(files, trainer)
    return tok


def prepare(files, out: str, vocab_size: int = 0, tokenizer: str = "",
            shard_tokens: int = 100_000_000, val_fraction: float = 0.05,
            say=print) -> dict:
    """Tokenizer + shards of ``files`` in ``out``; returns counts."""
    from tokenizers import Tokenizer
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f}: no such text file")
    if tokenizer:
        tok = Tokenizer.from_file(tokenizer)
    else:
        if vocab_size < 257:
            raise ValueError("--vocab-size must be at least 257 (the 256 bytes and the "
                             "end-of-text token), or pass --tokenizer")
        tok = train_tokenizer(files, vocab_size)
    size = tok.get_vocab_size()
    if size > 1 << 16:
        raise ValueError(f"a vocabulary of {size:,} does not fit llm.c's uint16 shards")
    eot = tok.token_to_id(EOT)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str())
    train = ShardWriter(out, "train", shard_tokens)
    val = ShardWriter(out, "val", shard_tokens)
    for path in files:
        total = os.path.getsize(path)
        cut = total * (1 - val_fraction)                 # bytes before it train
        done = 0
        with open(path, encoding="utf-8") as f:
            while True:
                lines = f.readlines(4 << 20)
                if not lines:
                    break
                ends = np.cumsum([len(line.encode()) for line in lines]) + done
                done = int(ends[-1])
                split = int(np.searchsorted(ends, cut, side="right")) if val_fraction else \
                    len(lines)                           # lines ending before the cut train
                for part, writer in ((lines[:split], train), (lines[split:], val)):
                    if part:
                        writer.add([i for enc in tok.encode_batch(part) for i in enc.ids])
        (val if val_fraction else train).add([eot] if eot is not None else [])
    train.flush()
    val.flush()
    say(f"{out}: tokenizer.json ({size:,} tokens); {train.total:,} training tokens in "
        f"{len(train.written)} shard(s), {val.total:,} held-out in {len(val.written)}")
    return {"vocab_size": size, "train_tokens": train.total, "val_tokens": val.total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.data",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="text files -> tokenizer.json + token shards")
    p.add_argument("files", nargs="+", help="UTF-8 text files")
    p.add_argument("--out", required=True, help="folder for tokenizer.json and the shards")
    p.add_argument("--vocab-size", type=int, default=0, help="BPE vocabulary to train")
    p.add_argument("--tokenizer", default="", help="use this tokenizer.json instead")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens per shard (default 100,000,000)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="the last fraction of each file held out (default 0.05)")
    args = ap.parse_args(argv)
    try:
        prepare(args.files, args.out, args.vocab_size, args.tokenizer, args.shard_tokens,
                args.val_fraction)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        print(f"python -m hpcdist.data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
