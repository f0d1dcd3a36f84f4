"""``python -m hpcdist.bench gpu --quality``: fp8's held-out loss against bf16's at the same
tokens, on real text — the standard library's docstrings (bench/moe_quality.py's corpus and
tokenizer: BPE of 2,048 tokens), GPT 4x128, block 128, batch 16, AdamW with warm-up and
cosine decay, the same seed and batches for both; each run in its own process on
``--quality-device`` (a GPU, or the CPU and the GPU stand-in, where fp8 runs the same
emulation: device/fp8.py). Writes runs/fp8_quality/results.json and prints a markdown table;
the issue's bar is fp8 within 1% of bf16."""
from __future__ import annotations

import os

from hpcdist.bench.common import write_json
from hpcdist.bench.moe_quality import prepared, run

CONTENDERS = {"bf16": ["--precision", "bf16"], "fp8": ["--precision", "fp8"]}


def markdown(rows: list) -> str:
    base = rows[0]["held_out"]
    out = ["| precision | held-out loss | vs bf16 | median step ms |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['contender']} | {r['held_out']:.4f} | "
                   f"{(r['held_out'] - base) / base:+.2%} | {r['step_ms']:.0f} |")
    return "\n".join(out)


def quality(args) -> int:
    out = args.quality_out
    os.makedirs(out, exist_ok=True)
    data = prepared(out)
    rows = [run(name, flags + ["--device", args.quality_device], data, args, out)
            for name, flags in CONTENDERS.items()]
    write_json(os.path.join(out, "results.json"), rows)
    print(markdown(rows))
    print(f"wrote {out}/results.json")
    return 0
