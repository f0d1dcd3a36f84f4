"""LoRA and QLoRA against full fine-tuning and PEFT + PyTorch on the CPU: ``python -m
hpcdist.bench lora [--steps 30] [--batch 8] [--block 256] [--rank 16]``.

One Hugging Face folder (bench sft's random Llama 4 x 128, GQA 4/2, a BPE of 2,048) and one
text corpus tokenized with its tokenizer; rows of ``--block`` tokens, ``--batch`` rows a
step, AdamW, fp32, adapters of ``--rank`` (alpha 2 x rank) on every block linear. Rows:
hpcdist full fine-tuning, LoRA, QLoRA (``--base-dtype nf4``), and PEFT + PyTorch LoRA and
PyTorch full fine-tuning, each in its own process with the machine's cores. Per rank: the
median step's time, and the model state: parameters (the frozen base as held), gradients,
optimizer state (hpcdist: the run's own count; PyTorch: the tensors' bytes after a step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from hpcdist.bench.common import run_job
from hpcdist.bench.sft import make_folder, records
from ..host.cli import Parser


def hpcdist_run(folder: str, tok: str, args, out: str, extra: list) -> dict:
    run = os.path.join(out, "run-" + "-".join(extra).replace("--", "") or "full")
    cmd = [sys.executable, "-m", "hpcdist.train", "--init-from", folder, "--data", tok,
           "--block-size", str(args.block), "--batch-size", str(args.batch), "--steps",
           str(args.steps), "--lr", "1e-3", "--min-lr", "1e-3", "--warmup", "0",
           "--weight-decay", "0", "--log-every", str(args.steps), "--eval-tokens", "1",
           "--out-dir", run, *extra]
    r = run_job(cmd, env=dict(os.environ, HPCDIST_THREADS=str(args.threads)))
    if r.returncode != 0:
        raise RuntimeError(f"hpcdist failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        final = [json.loads(x) for x in f][-1]
    mem = final["memory_peak"]
    return {"step_ms": final["step_ms_median"], "params": mem["params"] + mem.get("frozen", 0),
            "grads": mem["grads"], "optimizer": mem["optimizer"]}


def torch_run(folder: str, args, lora: bool) -> dict:
    """PyTorch (with PEFT's LoRA where ``lora``): ``main --worker peft`` / ``torch``."""
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.0)
    V = model.config.vocab_size
    times = []
    for _ in range(args.steps):
        ids = torch.randint(0, V, (args.batch, args.block + 1))
        t0 = time.perf_counter()
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)   # noqa: E731
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"step_ms": 1e3 * statistics.median(times),
            "params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in trained),
            "optimizer": nbytes(state)}


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench lora",
                description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--records", type=int, default=600)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker in ("peft", "torch"):
        print("RESULT " + json.dumps(torch_run(args.folder, args, args.worker == "peft")))
        return 0
    with tempfile.TemporaryDirectory() as out:
        recs = records(args.records)
        folder = make_folder(out, recs)
        corpus = os.path.join(out, "corpus.txt")
        with open(corpus, "w") as f:
            f.writelines(m["content"] + "\n" for r in recs for m in r["messages"])
        tok = os.path.join(out, "tok")
        r = run_job([sys.executable, "-m", "hpcdist.data", "prepare", corpus, "--tokenizer",
                     os.path.join(folder, "tokenizer.json"), "--out", tok])
        if r.returncode != 0:
            raise RuntimeError(f"prepare failed:\n{r.stderr[-2000:]}")
        lora = ["--lora-rank", str(args.rank), "--lora-alpha", str(2 * args.rank)]
        rows = [("hpcdist full fine-tuning", hpcdist_run(folder, tok, args, out, [])),
                ("hpcdist LoRA", hpcdist_run(folder, tok, args, out, lora)),
                ("hpcdist QLoRA (nf4 base)", hpcdist_run(folder, tok, args, out,
                                                         lora + ["--base-dtype", "nf4"]))]
        for worker, name in (("peft", "PEFT + PyTorch LoRA"), ("torch", "PyTorch full")):
            r = run_job([sys.executable, "-m", "hpcdist.bench", "lora", "--worker", worker,
                         "--folder", folder, "--steps", str(args.steps), "--batch",
                         str(args.batch), "--block", str(args.block), "--rank", str(args.rank),
                         "--threads", str(args.threads)])
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                raise RuntimeError(f"{worker} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            rows.append((name, json.loads(line[-1][len("RESULT "):])))
    print(f"lora: Llama 4x128 (GQA 4/2, vocabulary 2,048), rows of {args.block}, batch "
          f"{args.batch}, {args.steps} steps, rank {args.rank} on every block linear, AdamW, "
          f"fp32, {args.threads} threads; per rank, MiB")
    print(f"  {'':28s} {'step ms':>8s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'total':>8s}")
    mib = 2 ** 20
    for name, r in rows:
        total = r["params"] + r["grads"] + r["optimizer"]
        print(f"  {name:28s} {r['step_ms']:8.1f} {r['params'] / mib:8.3f} "
              f"{r['grads'] / mib:8.3f} {r['optimizer'] / mib:8.3f} {total / mib:8.3f}")
    ours, peft_ = rows[1][1], rows[3][1]
    print(f"  hpcdist LoRA / PEFT step time: {ours['step_ms'] / peft_['step_ms']:.2f}x")
    return 0
