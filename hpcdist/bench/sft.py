"""Instruction fine-tuning against trl's SFTTrainer on the CPU: ``python -m hpcdist.bench sft
[--steps 40] [--batch 8] [--block 256] [--records 1500]``.

One Hugging Face folder (a random Llama 4 x 128, GQA, saved by transformers with a Llama-3
style chat template marking the answers with ``{% generation %}``; a BPE of 2,048 trained on
the data) and one JSON Lines of generated conversations for both; the loss on the answers
only, best-fit-decreasing packing into rows of ``--block`` (trl: ``packing_strategy="bfd",
assistant_only_loss=True``; and trl with a padded row each), ``--batch`` rows a step, AdamW
at a constant rate, fp32. Each in its own process with the machine's cores; tokens/s counts
the documents' tokens (not padding), over the median step and the whole loop.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from hpcdist.bench.common import run_job
from ..host.cli import Parser

TEMPLATE = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + "
            "message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message['role'] == "
            "'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
            "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}"
            "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>"
            "assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
WORDS = ("the of and to in is was he for it with as his on be at by had are but from or "
         "have an they which one you were all we her she there would their will when who "
         "him been has more if no out so said what up its about than into them can only "
         "other time new some could these two may first then do any like my now over such "
         "our man me even most made after also did many off before must well back through").split()


def records(n: int, seed: int = 0) -> list:
    import numpy as np
    rng = np.random.default_rng(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": words(4, 12)}] if i % 3 == 0 else []
        for _ in range(int(rng.integers(1, 3))):
            msgs += [{"role": "user", "content": words(5, 30) + "?"},
                     {"role": "assistant", "content": words(3, 60) + "."}]
        out.append({"messages": msgs})
    return out


def make_folder(out: str, recs: list) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for r in recs for m in r["messages"]]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=2048, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                                bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    folder = os.path.join(out, "llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def hpcdist_run(folder: str, chats: str, args, out: str) -> dict:
    tok = os.path.join(out, "tok")
    r = run_job([sys.executable, "-m", "hpcdist.data", "prepare", chats, "--tokenizer", folder,
                 "--out", tok, "--val-fraction", "0.02"])
    if r.returncode != 0:
        raise RuntimeError(f"prepare failed:\n{r.stderr[-2000:]}")
    run = os.path.join(out, "run")
    cmd = [sys.executable, "-m", "hpcdist.train", "--init-from", folder, "--data", tok,
           "--block-size", str(args.block), "--batch-size", str(args.batch), "--steps",
           str(args.steps), "--lr", str(args.lr), "--min-lr", str(args.lr), "--warmup", "0",
           "--weight-decay", "0", "--grad-clip", "1.0", "--log-every", str(args.steps),
           "--eval-tokens", "1", "--out-dir", run]
    r = run_job(cmd, env=dict(os.environ, HPCDIST_THREADS=str(args.threads)))
    if r.returncode != 0:
        raise RuntimeError(f"hpcdist failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f]
    steps = [x for x in recs if "step" in x and "loss" in x]
    final = recs[-1]
    from hpcdist import data
    train, _ = data.make_task("text", data=tok, block_size=args.block)
    tokens = args.batch * args.block * (1 - train.padding)        # a step's, on average
    return {"tokens_per_s": tokens * args.steps / final["train_seconds"],
            "median_tokens_per_s": tokens / (final["step_ms_median"] / 1e3),
            "loss": sum(x["loss"] for x in steps[-5:]) / 5, "padding": train.padding,
            "padding_unpacked": train.unpacked_padding, "seconds": final["train_seconds"]}


def trl_run(folder: str, chats: str, args, out: str, packing: bool = True) -> dict:
    """trl's SFTTrainer (in its own process: ``main --worker trl`` / ``trl-padded``)."""
    import datasets
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer
    torch.set_num_threads(args.threads)
    rows = [json.loads(x) for x in open(chats)]
    train = datasets.Dataset.from_list(rows[:len(rows) - max(1, round(0.02 * len(rows)))])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                              attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    losses, times = [], []

    class Losses(transformers.TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_step_begin(self, a, state, control, **kw):
            times.append(-time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            times[-1] += time.perf_counter()
    config = SFTConfig(output_dir=os.path.join(out, "trl"), packing=packing,
                       packing_strategy="bfd", assistant_only_loss=True,
                       max_length=args.block, per_device_train_batch_size=args.batch,
                       max_steps=args.steps, learning_rate=args.lr,
                       lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                       max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True,
                       save_strategy="no", dataloader_num_workers=0, seed=0, bf16=False,
                       disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=train,
                         processing_class=tokenizer, callbacks=[Losses()])
    tokens = [0]
    collate = trainer.data_collator

    def counting(batch):
        out_ = collate(batch)
        tokens[0] += int(out_["input_ids"].numel() if "attention_mask" not in out_ else
                         out_["attention_mask"].sum())
        return out_
    trainer.data_collator = counting
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    import statistics
    return {"tokens_per_s": tokens[0] / seconds, "loss": sum(losses[-5:]) / 5,
            "median_tokens_per_s": tokens[0] / args.steps / statistics.median(times),
            "seconds": seconds}


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench sft",
                description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--records", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker in ("trl", "trl-padded"):
        result = trl_run(args.folder, os.path.join(args.out, "chats.jsonl"), args, args.out,
                         packing=args.worker == "trl")
        print("RESULT " + json.dumps(result))
        return 0
    with tempfile.TemporaryDirectory() as out:
        recs = records(args.records)
        chats = os.path.join(out, "chats.jsonl")
        with open(chats, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        folder = make_folder(out, recs)
        ours = hpcdist_run(folder, chats, args, out)
        peers = {}
        for worker in ("trl", "trl-padded"):
            r = run_job([sys.executable, "-m", "hpcdist.bench", "sft", "--worker", worker,
                         "--folder", folder, "--out", out, "--steps", str(args.steps),
                         "--batch", str(args.batch), "--block", str(args.block), "--lr",
                         str(args.lr), "--threads", str(args.threads)])
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                raise RuntimeError(f"{worker} failed:\n{r.stdout[-2000:]}\n"
                                   f"{r.stderr[-3000:]}")
            peers[worker] = json.loads(line[-1][len("RESULT "):])
    print(f"sft: Llama 4x128 (GQA 4/2), {args.records} conversations, rows of {args.block}, "
          f"batch {args.batch}, {args.steps} steps, {args.threads} threads, answers-only "
          "loss; tokens/s: the documents' tokens (padding not counted), over the median step "
          "and over the whole loop")
    print(f"  {'':28s} {'median step':>12s} {'whole loop':>11s}   loss (last 5)")
    rows = [("hpcdist, packed (bfd)", ours), ("trl, packed (bfd, padding-free)", peers["trl"]),
            ("trl, a padded row each", peers["trl-padded"])]
    for name, r in rows:
        print(f"  {name:28s} {r['median_tokens_per_s']:12,.0f} {r['tokens_per_s']:11,.0f}   "
              f"{r['loss']:.4f}")
    for name, r in rows[1:]:
        print(f"  hpcdist / {name}: {ours['median_tokens_per_s'] / r['median_tokens_per_s']:.2f}x"
              f" (median step), {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x (whole loop); "
              f"losses {abs(ours['loss'] / r['loss'] - 1):.1%} apart")
    print(f"  packing leaves {ours['padding']:.1%} padding (a row per document: "
          f"{ours['padding_unpacked']:.1%})")
    return 0
