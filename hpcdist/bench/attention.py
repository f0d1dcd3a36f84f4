"""Attention alone, forward + backward: ``python -m hpcdist.bench attention [--device gpu]
[--shapes 8x16x1024x64,...] [--kinds exact,bf16,tf32]``.

Each shape (batch x heads x T x head size, causal, one fused q|k|v) through hpcdist's tiled
kernels in each kind of arithmetic, through the GEMM path (GPU: cuBLAS around the fused
softmax, the (T, T) probabilities kept) and through PyTorch's ``scaled_dot_product_attention``
(on a GPU its flash backend; fp32, TF32 and bf16 inputs as the kinds). Prints ms, TFLOP/s
(causal: 2 B H T^2 hs a product, 2 forward and 5 backward products, FlashAttention-2's count
without the recomputed one) and peak memory the call added."""
from __future__ import annotations

import json
import sys
import time

import numpy as np
from ..host.cli import Parser

DEFAULT_SHAPES = "8x16x1024x64,16x12x256x64,1x12x8192x64,2x32x2048x128"


def _flops(B, H, T, hs) -> float:
    return 7 * 2 * B * H * T * T * hs / 2          # causal: half the products


def _time(fn, reps: int) -> float:
    from hpcdist.device import backend
    fn()
    backend.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _hpcdist(B, H, T, hs, kind, path, *, reps):
    from hpcdist.device import backend, kernels
    xp = backend.xp()
    rng = np.random.default_rng(0)
    backend.reset_precision()
    kernels.configure(kind == "tf32")
    kernels.attention.configure(path)
    # bf16: bf16 arrays where it runs natively (the tensor-core kernels, cuDNN), else float32
    # arrays under bf16 emulation (the same kernels, rounding q, k, v first)
    dt = backend.compute_dtype("bf16") if kind == "bf16" else np.dtype(np.float32)
    qkv = xp.asarray(rng.standard_normal((B, T, 3 * H * hs)).astype(np.float32)).astype(dt)
    dy = xp.asarray(rng.standard_normal((B, T, H * hs)).astype(np.float32)).astype(dt)
    scale = 1.0 / hs ** 0.5

    def run():
        y, lse, att = kernels.attention_fwd(qkv, H, H, scale)
        kernels.attention_bwd(qkv, y, dy, lse, H, H, scale, att)
    pool = xp.get_default_memory_pool() if backend.device_label() == "gpu" else None
    if pool is not None:                     # (what the pool holds after: this row's peak)
        pool.free_all_blocks()
    try:
        ms = _time(run, reps)
        ran = kernels.attention.choice()     # (a refused path runs flash: the row says so)
    finally:
        backend.reset_precision()
        kernels.configure(False)
        kernels.attention.configure("auto")
    return ms, (pool.total_bytes() - qkv.nbytes - dy.nbytes if pool else 0), ran


def _torch(B, H, T, hs, kind, reps, *, device):
    import torch
    F = torch.nn.functional
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    dt = torch.bfloat16 if kind == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, hs, generator=g).to(device, dt).requires_grad_()
               for _ in range(3))
    dy = torch.randn(B, H, T, hs, generator=g).to(device, dt)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    from hpcdist.device import backend
    ms = _time(run, reps) if backend.device_label() == "gpu" else _time_cpu(run, reps)
    torch.backends.cuda.matmul.allow_tf32 = False
    return ms, (torch.cuda.max_memory_allocated() if device == "cuda" else 0)


def _time_cpu(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench attention", description=__doc__)
    ap.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help="comma-separated BxHxTxhs (batch, heads, sequence, head size)")
    ap.add_argument("--kinds", default="exact,bf16,tf32")
    ap.add_argument("--paths", default="flash,gemms,cudnn",
                    help="hpcdist's: flash, gemms, cudnn (cudnn: bf16 only)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from hpcdist.device import backend, fused, kernels
    if args.device == "gpu" and backend.gpu_count() == 0:
        print("no GPU visible: --device cpu times the CPU kernels")
        return 0
    backend.init(args.device)
    kinds = [k for k in args.kinds.split(",") if args.device == "gpu" or k != "tf32"]
    rows = []
    for shape in args.shapes.split(","):
        B, H, T, hs = (int(x) for x in shape.split("x"))
        flops = _flops(B, H, T, hs)
        for kind in kinds:
            cells = {}
            for path in args.paths.split(","):
                if path == "gemms" and (args.device != "gpu" or B * H * T * T * 4 > 16 << 30):
                    continue                    # (the GEMM path's probabilities: 16 GiB cap)
                if path == "cudnn" and (kind != "bf16" or kernels.cudnn_attention.why_not()):
                    continue
                ms, mem, ran = _hpcdist(B, H, T, hs, kind, path, reps=args.reps)
                if path not in ran:
                    print(f"{shape:>16s} {kind:5s} hpcdist {path}: not run ({ran}; refused: "
                          f"{fused.refusals()})", flush=True)
                    continue
                cells[f"hpcdist {path}"] = ms, mem
            if not args.no_torch:
                try:
                    cells["torch sdpa"] = _torch(B, H, T, hs, kind, args.reps,
                                                 device="cuda" if args.device == "gpu" else "cpu")
                except ImportError:
                    pass
            for name, (ms, mem) in cells.items():
                row = {"shape": shape, "kind": kind, "who": name, "ms": round(ms, 3),
                       "tflops": round(flops / ms / 1e9, 1), "memory_gib": round(mem / 2**30, 2)}
                rows.append(row)
                print(f"{shape:>16s} {kind:5s} {name:15s} {ms:9.3f} ms {row['tflops']:7.1f} "
                      f"TFLOP/s {row['memory_gib']:6.2f} GiB", flush=True)
    refused = fused.refusals()
    print("refused:", refused or "none")
    if args.device == "gpu":
        print("cuDNN:", kernels.cudnn_attention.why_not() or "in use")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "refused": refused}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
