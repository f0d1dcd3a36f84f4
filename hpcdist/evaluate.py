"""The held-out loss of a model: ``python -m hpcdist.evaluate MODEL --data TOK``.

MODEL is a Hugging Face folder, an hpcdist save folder or a checkpoint (any layout wrote
it); TOK a folder of token shards from ``python -m hpcdist.data prepare`` (text, or chat
data with its answers-only mask). It prints the loss per scored token of the held-out
shards (``val_*.bin``: on chat data the answers' tokens alone, one row per document, as
training scores them) and its perplexity. Under ``mpirun -n N`` the rows are split over
the ranks and the sums added: the same numbers at any N.
"""
from __future__ import annotations

import argparse
import math
import sys


from . import checkpoint, data
from .device import backend
from .host.cli import Parser


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.evaluate",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    ap.add_argument("model", help="a Hugging Face folder, a save folder or a checkpoint")
    ap.add_argument("--data", required=True, help="token shards (a prepared folder)")
    ap.add_argument("--adapter", default="", help="a PEFT LoRA adapter folder on MODEL (a "
                    "Hugging Face folder)")
    ap.add_argument("--block-size", type=int, default=0,
                    help="tokens per row (default: the model's context, at most 1,024)")
    ap.add_argument("--dtype", choices=("fp32", "fp64"), default="fp32")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per forward (default 8)")
    ap.add_argument("--split", choices=("val", "train"), default="val",
                    help="the held-out shards (default) or the training ones")
    ap.add_argument("--packing", choices=("bfd", "off"), default="bfd",
                    help="chat shards: documents packed into rows, each attending to itself "
                         "(default, as training packs them), or a row each")
    args = ap.parse_args(argv)
    if args.block_size < 0 or args.batch_size < 1:
        ap.error("--block-size must be >= 0 and --batch-size >= 1")
    from mpi4py import MPI
    from .comm import Communicator
    comm = Communicator(MPI.COMM_WORLD)
    try:
        loss, tokens = evaluate_model(args, comm)
    except (OSError, ValueError, KeyError, checkpoint.CheckpointError) as e:
        if comm.rank == 0:
            print(f"python -m hpcdist.evaluate: error: {e}", file=sys.stderr)
        return 2
    if comm.rank == 0:
        print(f"{args.model} on {args.data} ({args.split}): loss {loss:.4f} per scored token "
              f"({tokens:,} tokens), perplexity {math.exp(min(loss, 700)):.3f}")
    return 0


def evaluate_model(args, comm) -> tuple[float, int]:
    """(loss per scored token, tokens scored) of ``args.model`` on ``args.data``."""
    from .run.evaluate import evaluate
    from .sample import load
    backend.init("cpu")
    backend.set_default_float("float64" if args.dtype == "fp64" else "float32")
    try:
        model, _ = load(args.model, args.adapter)
        block = args.block_size or min(model.config.block_size, 1024)
        if block > model.config.block_size and model.PARTS.get("positions"):
            raise ValueError(f"--block-size {block} is past the model's "
                             f"{model.config.block_size} positions")
        train, held = data.make_task("text", data=args.data, block_size=block,
                                     packing=args.packing)
        rows = held if args.split == "val" else train
        model.packed = getattr(rows, "packed", False)
        if rows.vocab_size > model.config.vocab_size:
            raise ValueError(f"{args.data} has a vocabulary of {rows.vocab_size:,}, the model "
                             f"{model.config.vocab_size:,}: tokenized for another model")
        _, loss, tokens = evaluate(model, rows, args.batch_size, comm, max_examples=len(rows))
    finally:
        backend.set_default_float("float32")
    return float(loss), int(tokens)


if __name__ == "__main__":
    sys.exit(main())
