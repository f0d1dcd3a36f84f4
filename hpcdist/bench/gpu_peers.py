"""PyTorch's rows of ``bench gpu``: the same network and weights as hpcdist's step, eager
(math attention or SDPA), autocast, torch.compile and torchao's float8 recipe
(bench/float8_peer.py), each timed as hpcdist's is (``timed``: the device waited for at both
ends)."""
from __future__ import annotations

import sys
import time

import numpy as np


def timed(step, steps: int) -> float:
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


# PyTorch's rows: (name, precision, attention: "math" (eager's unfused) or "sdpa",
# torch.compile's mode: None eager, "default", "max-autotune-no-cudagraphs")
PEERS = {"eager": [("torch eager fp32", "fp32", "math", None),
                   ("torch eager tf32", "tf32", "math", None),
                   ("torch eager bf16 autocast", "bf16", "math", None)],
         "sdpa": [("torch sdpa fp32", "fp32", "sdpa", None),
                  ("torch sdpa tf32", "tf32", "sdpa", None),
                  ("torch sdpa bf16 autocast", "bf16", "sdpa", None)],
         "compile": [("torch.compile fp32", "fp32", "sdpa", "default"),
                     ("torch.compile bf16 autocast", "bf16", "sdpa", "default"),
                     ("torch.compile max-autotune-no-cudagraphs bf16 autocast", "bf16", "sdpa",
                      "max-autotune-no-cudagraphs")],
         # torchao's tensorwise float8 recipe (bench/float8_peer.py), eager and compiled
         "fp8": [("torch fp8 tensorwise bf16 autocast", "fp8", "sdpa", None),
                 ("torch.compile fp8 tensorwise bf16 autocast", "fp8", "sdpa", "default")]}


def torch_steps(shape, cfg, modes, grad_clip: float = 0.0):
    """PyTorch on the same network (``cfg``, bench.gpu's) and weights: (name, step,
    precision), made one at a time (a generator: the last one's memory goes before the next
    is built); each step clips to ``grad_clip`` (0: not) as nanoGPT's loop does, outside
    torch.compile's forward."""
    import torch
    from hpcdist import nn
    from hpcdist.bench.autograd import torch_gpt, torch_llama
    from hpcdist.bench.float8_peer import float8_matmul
    L, C, T, B, V, H = shape
    nn.manual_seed(0)
    sd = {k: np.asarray(v) for k, v in nn.FAMILIES[cfg.arch].model(cfg).state_dict().items()}
    idx = torch.tensor(np.random.default_rng(0).integers(0, V, (B, T)), device="cuda")
    for name, prec, attention, compiled in modes:
        mm = float8_matmul if prec == "fp8" else None
        if cfg.arch == "llama":
            if attention != "sdpa":
                continue                       # (its twin has SDPA's attention only)
            p, forward = torch_llama(cfg, sd, B, device="cuda", mm=mm)
        else:
            p, forward = torch_gpt(cfg, sd, B, device="cuda", sdpa=attention == "sdpa", mm=mm)
        opt = torch.optim.AdamW(list(p.values()), lr=1e-4, fused=True)
        fwd = torch.compile(forward, mode=compiled) if compiled else forward
        bf16 = prec in ("bf16", "fp8")

        def step(fwd=fwd, opt=opt, bf16=bf16, params=list(p.values())):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = fwd(idx, idx)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
        yield name, step, prec


def said(name, rows):
    """Each row on stderr as it is timed (a run cut short keeps what it measured)."""
    ms, _, peak = rows[name]
    print(f"  {name}: {ms:.2f} ms/step, peak memory {peak / 2**30:.2f} GiB", file=sys.stderr,
          flush=True)


def peer_rows(shape, cfg, steps: int, peers, precisions=None, *, grad_clip=0.0) -> dict:
    """PyTorch's step in each of ``peers`` (eager, sdpa, compile; none without torch), at
    each of ``precisions`` (None: all three), clipping to ``grad_clip`` (0: not)."""
    if not peers:
        return {}
    try:
        import torch
    except ImportError:
        return {}
    rows = {}
    modes = [m for p in peers for m in PEERS[p] if precisions is None or m[1] in precisions]
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, step, prec in torch_steps(shape, cfg, modes, grad_clip):
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        torch.cuda.reset_peak_memory_stats()
        try:
            ms = timed(step, steps)
        except torch.OutOfMemoryError:
            print(f"  {name}: out of GPU memory", file=sys.stderr, flush=True)
            continue
        except RuntimeError as e:
            if prec != "fp8":
                raise
            # (torch._scaled_mm needs FP8 tensor cores: compute capability 8.9 or later)
            print(f"  {name}: refused by PyTorch: {str(e).splitlines()[0][:160]}",
                  file=sys.stderr, flush=True)
            continue
        finally:
            del step
        rows[name] = (ms, prec, torch.cuda.max_memory_reserved())
        said(name, rows)
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows
