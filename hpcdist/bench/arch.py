"""GPT-2-style against Llama-style on real text, the same parameters, the same tokens:
``python -m hpcdist.bench arch [--steps 800]``.

The corpus and the run: ``bench moe --quality``'s (the standard library's docstrings, BPE
2,048, blocks of 128, batch 16, AdamW, the same schedule and seed, one rank each). The
contenders, 4 blocks of width 128 and 4 heads, within 1% of one parameter count: GPT-2's
(LayerNorm, learned positions, GELU MLP 512, biases, tied head); Llama's as the field runs it
(RMSNorm, rotary positions, 2 kv heads, SwiGLU 224, no biases, untied head); and Llama's
block with GPT's embedding choices (4 kv heads, tied head: SwiGLU 352), which isolates the
block's recipe from the untied head's parameters. Prints held-out loss and tokens/s each;
writes runs/arch/results.json."""
from __future__ import annotations

import argparse
import os
import sys

from hpcdist.bench.common import write_json
from hpcdist.bench.moe_quality import MODEL, prepared, run
from ..host.cli import Parser

CONTENDERS = {
    "GPT-2 (LayerNorm, learned positions, GELU 512, tied)": [],
    "Llama (RMSNorm, rotary, GQA 2, SwiGLU 224, untied)":
        ["--arch", "llama", "--n-kv-head", "2", "--ffn-hidden", "224"],
    "Llama block, tied head (MHA, SwiGLU 352)":
        ["--arch", "llama", "--n-kv-head", "4", "--ffn-hidden", "352", "--tie-weights"],
}


def parameters(flags: list, vocab: int) -> int:
    """The contender's parameter count (the model built on one process, no data)."""
    from hpcdist import nn
    from hpcdist.run.config import parse_config
    from hpcdist.parallel.strategy import model_fields
    cfg = parse_config([*MODEL, "--data", os.devnull, *flags])
    model = nn.build(cfg.arch, **model_fields(cfg, cfg.arch, block_size=128, vocab_size=vocab))
    return model.num_parameters()


def markdown(rows: list) -> str:
    base = rows[0]
    out = ["| contender | parameters | held-out loss | vs GPT-2 | tokens/s |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['contender']} | {r['parameters']:,} | {r['held_out']:.4f} | "
                   f"{r['held_out'] - base['held_out']:+.4f} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench arch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--out", default="runs/arch")
    args = ap.parse_args(argv)
    data = prepared(args.out)
    rows = []
    for name, flags in CONTENDERS.items():
        r = run(name, flags, data, args, args.out)
        r["parameters"] = parameters(flags, 2048)
        r["tokens_per_s"] = 16 * 128 / (r["step_ms"] / 1e3)
        rows.append(r)
        print(f"  {name}: held-out {r['held_out']:.4f}, {r['parameters']:,} parameters, "
              f"{r['tokens_per_s']:,.0f} tokens/s", flush=True)
    print(markdown(rows))
    write_json(os.path.join(args.out, "results.json"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
