"""The GPU step: ``python -m hpcdist.bench gpu [--count] [--layers 12 --embd 768 --seq 256]``.

``--count`` (any machine): the device operations one GPT training step issues — forward,
backward, AdamW — counted on the device double, where every array operation is one launch and
a fused kernel (hpcdist/kernels/) counts as its own launches: once with the fused kernels
(``HPCDIST_FUSED=1``, the default) and once with their twins op by op, side by side.

Without ``--count`` (a GPU): ms per step of the same step on the GPU at fp32 beside PyTorch
eager fp32 (when torch is installed), with TFLOP/s and MFU from hpcdist.mfu.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _step_fn(L, C, T, B, V, seed=0):
    from hpcdist import backend, nn, optim
    nn.manual_seed(seed)
    model = nn.GPT(nn.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=max(1, C // 64),
                                n_embd=C))
    flat = optim.FlatParams(model.parameters())
    opt = optim.AdamW(flat, lr=1e-4)
    rng = np.random.default_rng(seed)
    idx = backend.to_device(rng.integers(0, V, (B, T)))

    def step():
        flat.grad[...] = 0
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        return loss
    return step, model


def count(L, C, T, B, V) -> dict:
    """Launches of one step, fused and op by op (on the device double)."""
    from hpcdist import backend, device_double
    backend.init("double")
    out, before = {}, os.environ.get("HPCDIST_FUSED")
    for fused in ("0", "1"):
        os.environ["HPCDIST_FUSED"] = fused
        step, _ = _step_fn(L, C, T, B, V)
        step()                                        # first step: buffers made once
        device_double.LAUNCHES.count = 0
        step()
        out["fused" if fused == "1" else "op by op"] = device_double.LAUNCHES.count
    if before is None:                                  # as the caller had it
        os.environ.pop("HPCDIST_FUSED", None)
    else:
        os.environ["HPCDIST_FUSED"] = before
    out["ratio"] = out["op by op"] / max(out["fused"], 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.bench gpu", description=__doc__)
    ap.add_argument("--count", action="store_true", help="count launches on the device double")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    shape = (args.layers, args.embd, args.seq, args.batch, args.vocab)
    if args.count:
        res = {"model": f"GPT {args.layers}x{args.embd}, T {args.seq}, batch {args.batch}",
               **count(*shape)}
        print(f"{res['model']}: launches per training step, op by op {res['op by op']:,}, "
              f"fused {res['fused']:,} ({res['ratio']:.2f}x fewer)")
    else:
        from hpcdist import backend, fused, mfu
        if backend.gpu_count() == 0:
            print("no GPU visible: run with --count to count launches on the device double")
            return 0
        backend.init("gpu")
        step, model = _step_fn(*shape)
        for _ in range(2):
            step()
        backend.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        backend.synchronize()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        tokens = args.batch * args.seq / (ms / 1e3)
        per_token = mfu.flops_per_token(model.num_parameters() - model.wpe.weight.size,
                                        args.layers, args.embd, args.seq)
        peak, source = mfu.gpu_peak("fp32")
        res = {"ms_per_step": ms, "tflops": per_token * tokens / 1e12,
               "mfu": per_token * tokens / peak if peak else None, "peak_from": source,
               "refused": fused.refusals()}
        print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
