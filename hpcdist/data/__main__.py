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
import fnmatch
import os
import shutil
import sys
import tempfile

import numpy as np

from ..host import folders
from . import shards, vocab
from ..host.cli import Parser

EOT = "<|endoftext|>"


class ShardWriter:
    """Tokens in, shards of at most ``limit`` tokens out (``prefix_000000.bin`` ...), as wide
    as ``vocab_size`` needs (data/shards.py)."""

    def __init__(self, folder: str, prefix: str, limit: int, tag: int = 0,
                 vocab_size: int = 1 << 16):
        self.folder, self.prefix, self.limit, self.tag = folder, prefix, limit, tag
        self.vocab_size = vocab_size
        self.parts, self.count, self.written, self.total = [], 0, [], 0

    def add(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.uint32)
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
        shards.write_shard(path, allids[:n], self.tag, self.vocab_size)
        self.written.append(path)
        self.parts, self.count = [allids[n:]], allids.size - n


def train_tokenizer(files, vocab_size: int, errors: str = "strict"):
    """A byte-level BPE of ``vocab_size`` tokens (the end-of-text token included), trained on
    the files' text as ``read_lines`` decodes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((line for f in files for chunk, _ in read_lines(f, errors)
                             for line in chunk), trainer)
    return tok


def read_lines(path: str, errors: str = "strict"):
    """(lines, byte offset after them) in pieces of a few MiB, decoded as UTF-8; a byte that is
    not UTF-8 is a ValueError naming the file and its offset (``errors="replace"``: U+FFFD)."""
    done = 0
    with open(path, "rb") as f:
        while True:
            raw = f.readlines(4 << 20)          # whole lines: a newline never splits a char
            if not raw:
                return
            try:
                text = b"".join(raw).decode("utf-8", errors)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 at byte {done + e.start:,} (0x"
                                 f"{b''.join(raw)[e.start]:02x}); convert the file, or pass "
                                 "--encoding-errors replace to read such bytes as U+FFFD") \
                    from None
            done += sum(len(r) for r in raw)
            yield text.splitlines(keepends=True), done


def corpus_files(paths, say=print, leave: str = "") -> list:
    """The text files of ``paths``: a file as given; a folder, every file below it whose first
    64 KiB hold no NUL byte, in sorted path order (names starting with "." and the folder
    ``leave``, the output, left out). The binary files passed over are counted in one line."""
    files, skipped = [], []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
            continue
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such text file or folder")
        below = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".") and not (
                leave and os.path.realpath(os.path.join(root, d)) == os.path.realpath(leave))]
            below += [os.path.join(root, n) for n in names if not n.startswith(".")]
        for f in sorted(below, key=lambda f: os.path.relpath(f, path)):
            if not os.path.isfile(f):
                continue
            with open(f, "rb") as fh:
                (skipped if b"\0" in fh.read(1 << 16) else files).append(f)
        if not below:
            raise ValueError(f"{path}: an empty folder, no text to tokenize")
    if skipped:
        say(f"note: {len(skipped)} binary file(s) left out ({skipped[0]}"
            f"{', ...' if len(skipped) > 1 else ''})")
    if not files:
        raise ValueError(f"{', '.join(paths)}: no text file there (binary files only)")
    return files


# What a prepare leaves in its --out (OUTPUT), and the folder it works in meanwhile
OUTPUT = ("tokenizer.json", *(f"{split}_*{suffix}" for split in ("train", "val")
                              for suffix in (".bin", ".mask.npy", ".docs.npy")))
PREPARED = (*OUTPUT, ".prepare-*")


def other_files_problem(out: str, inputs, others_ok: bool) -> str | None:
    """Why ``out`` is not written (None: it may be): it holds files no prepare wrote, other
    than the inputs themselves (a corpus beside its shards is fine)."""
    return None if others_ok else folders.refusal(out, "--out", PREPARED, allowed=inputs)


def earlier_files(out: str) -> list:
    """What an earlier prepare left in ``out``: its tokenizer.json and token shards."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out)
                  if any(fnmatch.fnmatchcase(n, pattern) for pattern in OUTPUT))


def load_tokenizer(files, vocab_size: int, tokenizer: str, errors: str, say):
    """The given tokenizer.json, or one trained on ``files`` (saying when the corpus gives a
    smaller vocabulary than asked)."""
    from tokenizers import Tokenizer
    if tokenizer:
        if os.path.isdir(tokenizer):                 # a model folder: its tokenizer
            tokenizer = os.path.join(tokenizer, "tokenizer.json")
        if not os.path.isfile(tokenizer):
            raise FileNotFoundError(f"--tokenizer {tokenizer}: no such file")
        try:
            return Tokenizer.from_file(tokenizer)
        except Exception as e:                    # the Rust side raises its own kinds
            raise ValueError(f"--tokenizer {tokenizer}: not a Hugging Face tokenizer.json "
                             f"({str(e)[:120]})") from None
    if vocab_size < 257:
        raise ValueError("--vocab-size must be at least 257 (the 256 bytes and the "
                         "end-of-text token), or pass --tokenizer")
    # every merge joins two tokens of the corpus: it cannot give more than 257 + its bytes
    # (asking the trainer for more allocates the whole ask: 1e9 aborted it)
    tok = train_tokenizer(files, min(vocab_size, 257 + sum(os.path.getsize(f) for f in files)),
                          errors)
    if tok.get_vocab_size() < vocab_size:
        say(f"note: --vocab-size {vocab_size:,} asked, the corpus gives {tok.get_vocab_size():,}"
            " tokens (no pair of tokens is left to merge): the vocabulary is "
            f"{tok.get_vocab_size():,}")
    return tok


def _encode(files, tok, train, val, val_fraction: float, errors: str) -> None:
    """Every file's lines into the two writers: the last ``val_fraction`` of its bytes held out."""
    eot = tok.token_to_id(EOT)
    for path in files:
        cut = os.path.getsize(path) * (1 - val_fraction)        # bytes before it train
        before = 0
        for lines, done in read_lines(path, errors):
            ends = np.cumsum([len(line.encode("utf-8", errors)) for line in lines]) + before
            before = done
            split = int(np.searchsorted(ends, cut, side="right")) if val_fraction else \
                len(lines)                                       # lines ending before the cut
            for part, writer in ((lines[:split], train), (lines[split:], val)):
                if part:
                    writer.add([i for enc in tok.encode_batch(part) for i in enc.ids])
        (val if val_fraction else train).add([eot] if eot is not None else [])


def _move_in(work: str, out: str, earlier) -> bool:
    """The new set is complete: an earlier prepare's files out, the new ones moved in."""
    for name in earlier:
        os.remove(os.path.join(out, name))
    for name in sorted(os.listdir(work)):
        os.replace(os.path.join(work, name), os.path.join(out, name))
    return True


def _encode_chats(files, val_files, encoder, train, val, val_fraction: float) -> None:
    """Chat records (data/chat.py) into the two document writers: ``val_files`` held out, or
    without them the last ``val_fraction`` of each file's records."""
    from . import chat
    for path, writer in [(f, None) for f in files] + [(f, val) for f in val_files]:
        encoded = [encoder.encode(rec, where) for where, rec in chat.records(path)]
        if not encoded:
            raise ValueError(f"{path}: no records")
        held = 0 if writer is not None or val_files or not val_fraction else \
            min(len(encoded) - 1, max(1, round(len(encoded) * val_fraction)))
        for i, (ids, mask) in enumerate(encoded):
            (writer or (val if i >= len(encoded) - held else train)).add(ids, mask)


def prepare_chats(files, out: str, folder: str, val_files=(), shard_tokens: int = 100_000_000,
                  val_fraction: float = 0.05, *, train_on: str = "answers",
                  replace: bool = False, others_ok: bool = False, say=print) -> dict:
    """Chat data (JSON Lines, Parquet) as document shards with loss masks
    (data/documents.py), tokenized and rendered with the model folder ``folder``."""
    from . import chat, documents
    if not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ValueError(f"--tokenizer {folder}: chat data needs a model folder with "
                         "tokenizer.json (and its chat template)")
    for f in list(files) + list(val_files):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f}: no such file")
    problem = other_files_problem(out, list(files) + list(val_files), others_ok)
    if problem:
        raise ValueError(problem)
    earlier = earlier_files(out)
    if earlier and not replace:
        raise ValueError(f"{out} holds an earlier prepare's files ({', '.join(earlier[:3])}"
                         f"{', ...' if len(earlier) > 3 else ''}); pass --replace, or --out "
                         "another folder")
    encoder = chat.Encoder(folder, train_on)
    size = encoder.tok.get_vocab_size()
    text = encoder.tok.to_str()
    tag = shards.tokenizer_tag(vocab.tokenizer_text(text))
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".prepare-", dir=out)
    done = False
    try:
        with open(os.path.join(work, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(text)
        train = documents.DocumentWriter(work, "train", shard_tokens, tag, size)
        val = documents.DocumentWriter(work, "val", shard_tokens, tag, size)
        _encode_chats(files, val_files, encoder, train, val, val_fraction)
        train.flush()
        val.flush()
        if not train.docs or not val.docs:
            raise ValueError("the records give no " + ("training" if not train.docs else
                             "held-out") + " example: add records, or pass --val FILE")
        done = _move_in(work, out, earlier)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not done:
            shutil.rmtree(out, ignore_errors=True)
    say(f"{out}: {train.docs:,} training examples ({train.total:,} tokens, {train.trained:,} "
        f"trained), {val.docs:,} held-out ({val.total:,} tokens, {val.trained:,} trained); "
        f"loss on {'the answers' if train_on == 'answers' else 'every token'}")
    return {"vocab_size": size, "train_docs": train.docs, "val_docs": val.docs,
            "train_tokens": train.total, "trained_tokens": train.trained}


def prepare(files, out: str, vocab_size: int = 0, tokenizer: str = "",
            shard_tokens: int = 100_000_000, val_fraction: float = 0.05, *, replace: bool = False,
            errors: str = "strict", others_ok: bool = False, say=print) -> dict:
    """Tokenizer + shards of ``files`` in ``out``; returns counts. Everything is written to a
    folder beside the shards first and moved in only once complete: a failure leaves ``out``
    as it was. A folder holding an earlier prepare's files is refused unless ``replace``."""
    if vocab_size > shards.MAX_VOCAB:                 # before any file is read
        raise ValueError(f"--vocab-size {vocab_size:,}: token ids are at most uint32 "
                         f"({shards.MAX_VOCAB:,} tokens)")
    files = corpus_files(files, say, leave=out)
    if not sum(os.path.getsize(f) for f in files):
        raise ValueError(f"the corpus is empty ({', '.join(files)}): nothing to tokenize")
    problem = other_files_problem(out, files, others_ok)
    if problem:
        raise ValueError(problem)
    earlier = earlier_files(out)
    if earlier and not replace:
        raise ValueError(f"{out} holds an earlier prepare's files ({len(earlier)}: "
                         f"{', '.join(earlier[:3])}{', ...' if len(earlier) > 3 else ''}); "
                         "training would mix them with the new ones. Pass --replace to "
                         "replace them, or --out another folder")
    tok = load_tokenizer(files, vocab_size, tokenizer, errors, say)
    size = tok.get_vocab_size()
    shards.version_for(size)
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".prepare-", dir=out)
    done = False
    try:
        text = tok.to_str()
        tag = shards.tokenizer_tag(vocab.tokenizer_text(text))
        try:
            with open(os.path.join(work, "tokenizer.json"), "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise OSError(e.errno, e.strerror, os.path.join(work, "tokenizer.json")) from None
        train = ShardWriter(work, "train", shard_tokens, tag, size)
        val = ShardWriter(work, "val", shard_tokens, tag, size)
        _encode(files, tok, train, val, val_fraction, errors)
        train.flush()
        val.flush()
        if not train.total:
            raise ValueError(f"the corpus gives no training tokens ({', '.join(files)}); "
                             "lower --val-fraction or add text")
        done = _move_in(work, out, earlier)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not done:                  # a folder made for a failed prepare goes
            shutil.rmtree(out, ignore_errors=True)
    if earlier:
        say(f"replaced {len(earlier)} file(s) of an earlier prepare in {out}")
    say(f"{out}: tokenizer.json ({size:,} tokens, uint{16 * shards.version_for(size)} "
        f"shards); {train.total:,} training tokens in {len(train.written)} shard(s), "
        f"{val.total:,} held-out in {len(val.written)}")
    return {"vocab_size": size, "train_tokens": train.total, "val_tokens": val.total}


def parser() -> Parser:
    """The command line: ``prepare`` and its flags."""
    ap = Parser(prog="python -m hpcdist.data",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="text files -> tokenizer.json + token shards")
    p.add_argument("files", nargs="+", help="UTF-8 text files, or folders of them (every "
                   "text file below, in sorted path order)")
    p.add_argument("--out", required=True, help="folder for tokenizer.json and the shards")
    p.add_argument("--vocab-size", type=int, default=0, help="BPE vocabulary to train")
    p.add_argument("--tokenizer", default="", help="use this tokenizer.json instead")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens per shard (default 100,000,000)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="the last fraction of each file held out (default 0.05)")
    p.add_argument("--replace", action="store_true",
                   help="replace an earlier prepare's tokenizer and shards in --out")
    p.add_argument(folders.FLAG, dest="others_ok", action="store_true",
                   help="write into an --out that holds files prepare did not write "
                        "(refused without it, naming one)")
    p.add_argument("--encoding-errors", choices=("strict", "replace"), default="strict",
                   help="bytes that are not UTF-8: strict refuses the file naming the byte "
                        "(default), replace reads them as U+FFFD")
    p.add_argument("--val", action="append", default=[], metavar="FILE",
                   help="chat data (.jsonl, .parquet): a held-out file (instead of "
                        "--val-fraction of each file's records)")
    p.add_argument("--train-on", choices=("answers", "all"), default="answers",
                   help="chat data: the loss on the assistant's answers (and a completion) "
                        "only (default), or on every token")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not 1 <= args.shard_tokens < 1 << 31 or not 0 <= args.val_fraction < 1:
        ap.error("--shard-tokens must be in [1, 2**31) (the header's count is an int32) and "
                 "--val-fraction in [0, 1)")
    from .chat import is_chat_file
    chats = [is_chat_file(f) for f in args.files + args.val]
    if any(chats) and not all(chats):
        ap.error("chat data (.jsonl, .parquet) and text files are prepared apart")
    if args.val and not any(chats):
        ap.error("--val takes chat data (.jsonl, .parquet); text files hold out "
                 "--val-fraction")
    try:
        if any(chats):
            if not args.tokenizer:
                ap.error("chat data needs --tokenizer MODEL_FOLDER (its tokenizer.json and "
                         "chat template)")
            prepare_chats(args.files, args.out, args.tokenizer, args.val, args.shard_tokens,
                          args.val_fraction, train_on=args.train_on, replace=args.replace,
                          others_ok=args.others_ok)
        else:
            prepare(args.files, args.out, args.vocab_size, args.tokenizer, args.shard_tokens,
                    args.val_fraction, replace=args.replace, errors=args.encoding_errors,
                    others_ok=args.others_ok)
    except OSError as e:
        what = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        print(f"python -m hpcdist.data: error: {what}; nothing was written to {args.out}",
              file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"python -m hpcdist.data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
