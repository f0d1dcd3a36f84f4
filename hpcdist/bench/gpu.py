"""The GPU step: ``python -m hpcdist.bench gpu [--count] [--layers 12 --embd 768 --seq 256]``.

``--count`` (any machine): the device operations one GPT training step issues — forward,
backward, AdamW — counted on the device double, where every array operation is one launch and
a fused kernel (hpcdist/device/kernels/) counts as its own launches: once with the fused kernels
(``HPCDIST_FUSED=1``, the default) and once with their twins op by op, side by side.

The rest of this design: docs/gpu.md, "hpcdist/bench/gpu.py"."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _step_fn(L, C, T, B, V, seed=0):
    from hpcdist.device import backend
    from hpcdist import nn, optim
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
    from hpcdist.device import backend, double as device_double
    backend.init("double")
    out, before = {}, os.environ.get("HPCDIST_FUSED")
    for fused in ("0", "1"):
        os.environ["HPCDIST_FUSED"] = fused
        print(f"counting the launches of two GPT {L}x{C} steps on the device double, "
              f"{'fused' if fused == '1' else 'op by op'} (about a minute each)...",
              file=sys.stderr, flush=True)
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


def _timed(step, steps: int) -> float:
    """ms per step after two warm-up steps, the device waited for at both ends."""
    from hpcdist.device import backend
    for _ in range(2):
        step()
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    backend.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def _hpcdist_mode(shape, mode: str):
    from hpcdist.device import backend, kernels
    backend.reset_precision()
    kernels.configure(mode == "tf32")
    if mode == "bf16":
        backend.compute_dtype("bf16")          # this CuPy: fp32 storage, bf16 GEMMs
    return _step_fn(*shape)


def _torch_steps(shape, modes):
    """PyTorch on the same network and weights: {name: (step, precision)}."""
    import torch
    from hpcdist import nn
    from hpcdist.bench.autograd import torch_gpt
    L, C, T, B, V = shape
    cfg = nn.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=max(1, C // 64), n_embd=C)
    nn.manual_seed(0)
    sd = {k: np.asarray(v) for k, v in nn.GPT(cfg).state_dict().items()}
    idx = torch.tensor(np.random.default_rng(0).integers(0, V, (B, T)), device="cuda")
    out = {}
    for name, prec in modes:
        p, forward = torch_gpt(cfg, sd, B, device="cuda")
        opt = torch.optim.AdamW(list(p.values()), lr=1e-4, fused=True)
        fwd = torch.compile(forward) if "compile" in name else forward
        bf16 = prec == "bf16"

        def step(fwd=fwd, opt=opt, bf16=bf16):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = fwd(idx, idx)
            loss.backward()
            opt.step()
        out[name] = (step, prec)
    return out


def _said(name, rows):
    """Each row on stderr as it is timed (a run cut short keeps what it measured)."""
    print(f"  {name}: {rows[name][0]:.2f} ms/step", file=sys.stderr, flush=True)


def _peer_rows(shape, steps: int) -> dict:
    """PyTorch's step, eager and compiled, in each precision (none without torch)."""
    try:
        import torch
    except ImportError:
        return {}
    rows = {}
    torch_modes = [("torch eager fp32", "fp32"), ("torch eager tf32", "tf32"),
                   ("torch eager bf16 autocast", "bf16"), ("torch.compile fp32", "fp32"),
                   ("torch.compile bf16 autocast", "bf16")]
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, (step, prec) in _torch_steps(shape, torch_modes).items():
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        rows[name] = (_timed(step, steps), prec)
        _said(name, rows)
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def measure(shape, steps: int, modes, peers: bool = True) -> dict:
    """hpcdist's step in each mode beside PyTorch's (``peers``): ms, TFLOP/s, MFU, ratios."""
    from hpcdist.device import backend, fused
    from hpcdist.run import mfu
    backend.init("gpu")
    L, C, T, B, V = shape
    rows = {}
    flops = None
    for mode in modes:
        step, model = _hpcdist_mode(shape, mode)
        flops = mfu.flops_per_token(model.num_parameters() - model.wpe.weight.size, L, C, T)
        rows[f"hpcdist {mode}"] = (_timed(step, steps), mode)
        _said(f"hpcdist {mode}", rows)
    backend.reset_precision()
    if peers:
        rows.update(_peer_rows(shape, steps))
    res = {"model": f"GPT {L}x{C}, T {T}, batch {B}", "refused": fused.refusals(), "rows": {}}
    for name, (ms, prec) in rows.items():
        peak, source = mfu.gpu_peak(prec)
        rate = flops * B * T / (ms / 1e3)
        eager = rows.get(f"torch eager {prec}" + (" autocast" if prec == "bf16" else ""))
        res["rows"][name] = {"ms_per_step": round(ms, 2), "tflops": round(rate / 1e12, 2),
                             "mfu": round(rate / peak, 4) if peak else None,
                             "peak_from": source,
                             "vs_torch_eager": round(ms / eager[0], 3) if eager else None}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.bench gpu", description=__doc__)
    ap.add_argument("--count", action="store_true", help="count launches on the device double")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="fp32,tf32,bf16",
                    help="hpcdist's precisions to time: fp32, tf32, bf16")
    ap.add_argument("--no-torch", action="store_true", help="time hpcdist only")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    shape = (args.layers, args.embd, args.seq, args.batch, args.vocab)
    if args.count:
        res = {"model": f"GPT {args.layers}x{args.embd}, T {args.seq}, batch {args.batch}",
               **count(*shape)}
        print(f"{res['model']}: launches per training step, op by op {res['op by op']:,}, "
              f"fused {res['fused']:,} ({res['ratio']:.2f}x fewer)")
    else:
        from hpcdist.device import backend
        if backend.gpu_count() == 0:
            print("no GPU visible: run with --count to count launches on the device double")
            return 0
        res = measure(shape, args.steps, args.modes.split(","), peers=not args.no_torch)
        print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
