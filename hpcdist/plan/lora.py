"""LoRA in the planner: its flags, the Settings they make, and the trainer's flags back
(the memory a LoRA stage holds: memory.lora_state)."""
from __future__ import annotations

NF4_BITS = 4.127            # nn/nf4.py: 4 + 8/64 + 32/(64 x 256) bits a block weight


def add_flags(add) -> None:
    add("--lora-rank", type=int, default=0, help="plan LoRA: adapters of this rank on every "
        "block linear, the base frozen (no gradients, no optimizer state; whole on every "
        "rank); 0: full training")
    add("--base-dtype", default="auto", choices=("auto", "nf4"),
        help="with --lora-rank: the frozen base in the compute dtype, or its block weights "
             f"in 4-bit NormalFloat (QLoRA: {NF4_BITS} bits)")


def settings(args, ap) -> dict:
    """Settings' LoRA fields for the command line (a bad combination: ``ap.error``)."""
    if args.lora_rank < 0 or (args.base_dtype == "nf4" and not args.lora_rank):
        ap.error("--lora-rank must be >= 0, and --base-dtype nf4 plans LoRA: add --lora-rank")
    return {"lora_rank": args.lora_rank,
            "base_bits": NF4_BITS if args.base_dtype == "nf4" else 0.0}


def train_flags(settings) -> list:
    """hpcdist.train's flags for the planned LoRA (none for full training)."""
    out = ["--lora-rank", settings.lora_rank] if settings.lora_rank else []
    return out + (["--base-dtype", "nf4"] if settings.base_bits else [])
