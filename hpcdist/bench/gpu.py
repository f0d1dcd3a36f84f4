"""The GPU step: ``python -m hpcdist.bench gpu [--count] [--layers 12 --embd 768 --heads 12
--seq 256 --batch 16]``, hpcdist beside PyTorch eager (its math attention and SDPA's flash
kernels), autocast and torch.compile: ms, tokens/s, TFLOP/s, MFU, peak memory, ratio to each.

``--count`` (any machine): the device operations one GPT training step issues — forward,
backward, the gradient's norm and clipping, AdamW — counted on the GPU stand-in, where every
array operation is one launch and a fused kernel (hpcdist/device/kernels/) counts as its own
launches: once with the fused kernels (``HPCDIST_FUSED=1``, the default) and once with their
twins op by op, side by side.

The rest of this design: docs/gpu.md, "hpcdist/bench/gpu.py"."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from hpcdist.bench.gpu_peers import PEERS, peer_rows, said, timed
from ..host.cli import Parser

ARCH = ["gpt"]          # the family the bench times (--arch; llama: a quarter kv heads)
PAD = [0]               # --vocab-multiple (0: as the trainer pads, 64 on a GPU, 1 on the CPU)
CLIP = [1.0]            # --grad-clip (the trainer's default; 0: no norm, no clipping)


def _config(L, C, T, B, V, H=0):
    from hpcdist import nn
    from hpcdist.parallel.strategy import vocab_multiple
    heads = H or max(1, C // 64)
    pad = vocab_multiple({"vocab_multiple": PAD[0]})      # (0: the trainer's rule)
    if ARCH[0] == "llama":
        return nn.LlamaConfig(block_size=T, vocab_size=V, n_layer=L, n_head=heads,
                              n_kv_head=max(1, heads // 4), n_embd=C, vocab_multiple=pad)
    return nn.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=heads, n_embd=C,
                        vocab_multiple=pad)


def _family() -> str:
    return {"gpt": "GPT", "llama": "Llama"}[ARCH[0]]


def _step_fn(L, C, T, B, V, H=0, *, seed=0, precision="fp32", graph=False):
    """One training step as the trainer's data-parallel path takes it on one rank: forward,
    backward, (mixed precision: the compute gradient into the fp32 master's, as DDP's
    buckets do), the gradient's norm, AdamW clipping by it (``CLIP``), the compute copy of
    the weights. ``graph``: the whole step replayed as one CUDA graph (device/graphs.py),
    AdamW's step count and learning rate on the device (optim.DeviceSchedule, here a
    constant 1e-4), as the trainer's --cuda-graph on one replica."""
    from hpcdist.device import backend, graphs, kernels
    from hpcdist import nn, optim
    from hpcdist.parallel.mixed_precision import MixedPrecision
    nn.manual_seed(seed)
    cfg = _config(L, C, T, B, V, H)
    model = nn.FAMILIES[cfg.arch].model(cfg)
    mp = MixedPrecision(model.parameters(), precision)
    opt = optim.AdamW(mp.master, lr=1e-4)
    mp.attach(opt)
    rng = np.random.default_rng(seed)
    idx = backend.to_device(rng.integers(0, V, (B, T)))

    def one_step():
        mp.zero_grad()
        _, loss = model(idx, idx)
        loss.backward()
        if mp.mixed:
            kernels.WIDEN(mp.compute.grad, mp.master.grad)     # (master.grad[...] = ...)
        opt.step(clipping=(optim.grad_norm(mp.master.grad), CLIP[0]) if CLIP[0] else None)
        mp.after_step()
        return loss.data

    captured = None
    if graph:
        opt.schedule = optim.DeviceSchedule(1e-4, 0, 1 << 40, min_lr=1e-4)   # (constant)
        captured = graphs.capture(one_step)

    def step():
        if captured is None:
            return one_step()
        loss = captured()
        if captured.replayed:                 # (the host's count: Python ran at capture only)
            opt.step_count += 1
        return loss
    # what a caller may reach: the graph, the tokens the step reads (write a new batch into
    # them), the fp32 master weights
    step.graph, step.idx, step.master = captured, idx, mp.master
    return step, model


COUNTS = (("op by op", "0", "fp32"), ("fused", "1", "fp32"), ("fused bf16", "1", "bf16"))


def count(L, C, T, B, V, H=0, *, which=COUNTS) -> dict:
    """Launches of one step: op by op and fused in fp32, fused in bf16 (on the GPU stand-in,
    where bf16 runs natively: bf16 weights, activations and gradients)."""
    from hpcdist.device import backend, standin
    backend.init("standin")
    out, before = {}, os.environ.get("HPCDIST_FUSED")
    try:
        for name, fused, precision in which:
            os.environ["HPCDIST_FUSED"] = fused
            print(f"counting the launches of two {_family()} {L}x{C} steps on the standin "
                  f"GPU, {name} (about a minute each)...", file=sys.stderr, flush=True)
            backend.reset_precision()
            step, _ = _step_fn(L, C, T, B, V, H, precision=precision)
            step()                                        # first step: buffers made once
            standin.LAUNCHES.count = 0
            step()
            out[name] = standin.LAUNCHES.count
    finally:
        backend.reset_precision()
        if before is None:                                  # as the caller had it
            os.environ.pop("HPCDIST_FUSED", None)
        else:
            os.environ["HPCDIST_FUSED"] = before
    if "op by op" in out and "fused" in out:
        out["ratio"] = out["op by op"] / max(out["fused"], 1)
    if "fused bf16" in out and "fused" in out:
        out["bf16 ratio"] = out["fused bf16"] / max(out["fused"], 1)
    return out


def _hpcdist_mode(shape, mode: str, attention: str = "auto"):
    """(step, model) of ``mode``: fp32, tf32, bf16 or fp8 (the linear layers' GEMMs on fp8's
    values: device/fp8.py), each with "+graph" (a CUDA graph)."""
    from hpcdist.device import backend, kernels
    precision, graph = mode.removesuffix("+graph"), mode.endswith("+graph")
    backend.reset_precision()
    kernels.configure(precision == "tf32")
    kernels.attention.configure(attention, graphs=graph)
    # bf16: native where this CuPy computes in bf16 (backend.native_bf16), else fp32 storage
    # with bf16 GEMMs
    return _step_fn(*shape, precision=precision if precision in ("bf16", "fp8") else "fp32",
                    graph=graph)


def activations(step, model, shape, mode: str) -> tuple[int, float]:
    """(the activations one more ``step`` holds when its backward begins, measured:
    autograd.memtrace, the pool's bytes in use on a GPU; the planner's count of hpcdist's
    layers for this shape, precision and padded vocabulary), in bytes: the issue's T 8192
    check compares these, where CuPy's pool (the peak column) also keeps freed blocks."""
    from hpcdist import plan as P
    from hpcdist.autograd import memtrace
    from hpcdist.device import backend, kernels
    L, C, T, B, V, H = shape
    memtrace.enable()
    try:
        memtrace.start()
        step()
        held = memtrace.finish()["activations"]
    finally:
        memtrace.enable(False)
    cfg = model.config
    two = mode in ("bf16", "fp8") and not backend.bf16_emulated()   # bf16 activations
    planned = P.Model.of(cfg, seq=T, vocab=V)
    want = P.activations(planned, P.Layout(1, 1, 1, 0, B, 1, "none", 1, False, False),
                         P.Settings(param_bytes=2 if two else 4, activations="hpcdist",
                                    attention_probs="gemms" in kernels.attention.choice()),
                         stage="first")
    return held, want


def _hpcdist_rows(shape, steps, modes, attention) -> tuple[dict, float, dict]:
    from hpcdist.device import backend, kernels
    from hpcdist.device.errors import DeviceError
    from hpcdist.run import mfu
    pool = backend.xp().get_default_memory_pool()
    free = getattr(pool, "free_all_blocks", lambda: None)     # (the GPU stand-in's pool: none)
    rows, flops, acts = {}, 0.0, {}
    L, C, T = shape[:3]
    for mode in modes:
        free()
        step, model = _hpcdist_mode(shape, mode, attention)
        table = model.part("positions")
        flops = mfu.flops_per_token(model.logical_parameters() -
                                    (table.weight.size if table is not None else 0), L,
                                    model.config.attention_shape().out_width, T)
        name, precision = f"hpcdist {mode}", mode.removesuffix("+graph")
        try:
            ms = timed(step, steps)
        except DeviceError as e:           # a step a graph cannot hold: said, the rest timed
            print(f"  {name}: {e}", file=sys.stderr, flush=True)
            del step, model
            continue
        graph = step.graph.pool_bytes() if step.graph else 0      # (its pool: activations)
        rows[name] = (ms, precision, getattr(pool, "total_bytes", lambda: 0)() + graph)
        said(name, rows)
        if step.graph:             # a replay runs no Python: memtrace sees nothing of it
            print(f"    attention: {kernels.attention.choice()}; the graph's own pool "
                  f"{graph / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        else:
            acts[name] = activations(step, model, shape, precision)
            print(f"    attention: {kernels.attention.choice()}; activations "
                  f"{acts[name][0] / 2**30:.2f} GiB, the planner's "
                  f"{acts[name][1] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        del step, model
    backend.reset_precision()
    free()
    return rows, flops, acts


def measure(shape, steps: int, modes, peers=("eager", "sdpa", "compile"),
            attention: str = "auto", peer_modes=None) -> dict:
    """hpcdist's step in each mode beside PyTorch's (``peers``): ms, tokens/s, TFLOP/s, MFU,
    peak memory (hpcdist: CuPy's pool; PyTorch: its allocator's reserved high-water mark) and
    each hpcdist row's ratio to every peer of its precision (> 1: hpcdist is slower)."""
    from hpcdist.device import backend, fused
    from hpcdist.run import mfu
    backend.init("gpu")
    L, C, T, B, V, H = shape
    rows, flops, acts = _hpcdist_rows(shape, steps, modes, attention)
    rows.update(peer_rows(shape, _config(*shape), steps, peers, peer_modes,
                          grad_clip=CLIP[0]))
    res = {"model": f"{_family()} {L}x{C}, "
                    f"{H or max(1, C // 64)} heads, T {T}, batch {B}, vocab {V}",
           "refused": fused.refusals(), "rows": {}}
    for name, (ms, prec, peak_bytes) in rows.items():
        peak, source = mfu.gpu_peak(prec)
        rate = flops * B * T / (ms / 1e3)
        row = {"ms_per_step": round(ms, 2), "tokens_per_s": round(B * T / (ms / 1e3)),
               "tflops": round(rate / 1e12, 2),
               "mfu": round(rate / peak, 4) if peak and rate <= peak else None,
               "peak_from": source, "peak_memory_gib": round(peak_bytes / 2**30, 2)}
        if name.startswith("hpcdist"):          # (fp8 against bf16's peers and fp8's)
            row["vs"] = {other: round(ms / o[0], 3) for other, o in rows.items()
                         if not other.startswith("hpcdist") and
                         o[1] in (("bf16", "fp8") if prec == "fp8" else (prec,))}
        if name in acts:
            held, want = acts[name]
            row.update(activations_gib=round(held / 2**30, 3),
                       planner_activations_gib=round(want / 2**30, 3),
                       activations_vs_planner=round(held / want, 3) if want else None)
        res["rows"][name] = row
    return res


PRECISIONS = ("fp32", "tf32", "bf16", "fp8")       # --modes (each also with +graph)


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="python -m hpcdist.bench gpu", description=__doc__)
    ap.add_argument("--count", action="store_true", help="count launches on the GPU stand-in")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=0, help="attention heads (0: embd / 64)")
    ap.add_argument("--arch", default="gpt", choices=("gpt", "llama"),
                    help="the family (llama: a quarter of the heads kv heads; its PyTorch twin "
                         "runs SDPA)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--vocab-multiple", type=int, default=0,
                    help="hpcdist's table and head padded to a multiple of this (0: as the "
                         "trainer does, 64 on a GPU; 1: unpadded)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--grad-clip", type=float, default=1.0,
                    help="every step clips the gradient's global norm to this, on both sides, "
                         "as the trainer does (0: no norm, no clipping)")
    ap.add_argument("--modes", default="fp32,tf32,bf16",
                    help="hpcdist's precisions to time: fp32, tf32, bf16, fp8; each with +graph: "
                    "the whole step (AdamW included) replayed as one CUDA graph")
    ap.add_argument("--no-torch", action="store_true", help="time hpcdist only")
    ap.add_argument("--peers", default="eager,sdpa,compile",
                    help="PyTorch's rows: eager (math attention), sdpa, compile, fp8 "
                         "(torchao's tensorwise float8 through torch._scaled_mm)")
    ap.add_argument("--peer-modes", default="fp32,tf32,bf16,fp8",
                    help="the precisions PyTorch's rows run at")
    ap.add_argument("--attention", default="auto", choices=("auto", "flash", "gemms", "cudnn"),
                    help="hpcdist's attention (auto: the fastest on this shape, measured; "
                    "one that cannot run a row runs flash, and the row says so)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--quality", action="store_true",
                    help="fp8's held-out loss against bf16's on real text (bench/fp8_quality.py;"
                    " --steps counts training steps there)")
    ap.add_argument("--quality-device", default="gpu", choices=("gpu", "cpu", "standin"))
    ap.add_argument("--eval-every", type=int, default=100, help="--quality: held-out every N")
    ap.add_argument("--quality-out", default=os.path.join("runs", "fp8_quality"))
    return ap


def lists(args) -> tuple[list, list, list]:
    """(hpcdist's modes, PyTorch's peers, their precisions) from the flags; ValueError naming
    a word none of them knows (a misspelt mode would otherwise run as fp32)."""
    modes, peers, peer_modes = ([w for w in text.split(",") if w] for text in
                                (args.modes, args.peers, args.peer_modes))
    for flag, words, known in (("--modes", [m.removesuffix("+graph") for m in modes],
                                PRECISIONS), ("--peers", peers, tuple(PEERS)),
                               ("--peer-modes", peer_modes, PRECISIONS)):
        bad = [w for w in words if w not in known]
        if bad:
            raise ValueError(f"{flag}: {', '.join(bad)} (known: {', '.join(known)}"
                             f"{'; each may end in +graph' if flag == '--modes' else ''})")
    return modes, peers, peer_modes


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        modes, peers, peer_modes = lists(args)
    except ValueError as e:
        ap.error(str(e))
    if args.quality:
        from hpcdist.bench.fp8_quality import quality
        return quality(args)
    shape = (args.layers, args.embd, args.seq, args.batch, args.vocab, args.heads)
    ARCH[0] = args.arch
    PAD[0] = args.vocab_multiple
    CLIP[0] = args.grad_clip
    if args.count:
        res = {"model": f"{_family()} {args.layers}x{args.embd}, T {args.seq}, batch {args.batch}",
               **count(*shape)}
        print(f"{res['model']}: launches per training step, op by op {res['op by op']:,}, "
              f"fused {res['fused']:,} ({res['ratio']:.2f}x fewer); bf16 (native, fused) "
              f"{res['fused bf16']:,} ({res['bf16 ratio']:.3f}x the fp32 step's)")
    else:
        from hpcdist.device import backend
        if backend.gpu_count() == 0:
            print("no GPU visible: run with --count to count launches on the GPU stand-in")
            return 0
        res = measure(shape, args.steps, modes, () if args.no_torch else peers,
                      args.attention, peer_modes)
        print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
