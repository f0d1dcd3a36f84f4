"""The memory-bound kernels alone: ``python -m hpcdist.bench kernels [--rows 8192] [--embd 1024]
[--vocab 50304] [--dtype bf16]``.

Each elementwise and row kernel of a GPT or Llama layer at one shape (rows = batch x sequence;
GPT-2 medium at batch 8, T 1024 by default) and the loss's over the vocabulary, 16 bytes a
thread (as it runs) and one element a thread (``common.VECTORS`` off), beside a copy of the
MLP's activation (rows x 4C: what this card's memory does at best, the yardstick of the last
column). Each time is a CUDA graph of ``--calls`` calls replayed (kernels back to back: the
host's launches are not timed), the best of ``--reps``. Bytes: what the call must read and
write once. ``--device standin`` runs the same on the CPU's model of a device (its times say
nothing: a check of the command)."""
from __future__ import annotations

import json
import time

import numpy as np
from ..host.cli import Parser


def _cases(xp, rows: int, C: int, V: int, dt, rng):
    """(name, fn, bytes) of each kernel at (rows, C), the MLP 4 C wide, logits V wide."""
    from hpcdist.device import kernels
    s = np.dtype(dt).itemsize

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    x, r, w, b = arr(rows, C), arr(rows, C), arr(C), arr(C)
    h, g4, b4 = arr(rows, 4 * C), arr(rows, 4 * C), arr(4 * C)
    two = arr(rows, 8 * C)                                 # SwiGLU's [gate | up], 4 C each
    _, mean, rstd, _ = kernels.LAYERNORM_FWD(x, w, b, 1e-5)
    _, rms, _ = kernels.RMSNORM_FWD(x, w, 1e-5)
    heads = max(1, C // 64)                                # q|k|v of heads of 64
    qkv = arr(rows, 3 * C)
    cos, sin = kernels.rotary_tables(xp.arange(rows), 64, 10000.0, dt)
    z = arr(rows, V)
    t = xp.asarray(rng.integers(0, V, rows))
    lse = kernels.CROSS_ENTROPY_FWD(z, t, -100)[1]
    one = xp.asarray(1.0, dtype=dt)
    n, n4, nv = rows * C * s, rows * 4 * C * s, rows * V * s
    return [
        ("add2 (engine's gradient sum)", lambda: kernels.ADD(x, r), 3 * n),
        ("bias_residual", lambda: kernels.BIAS_RESIDUAL(x, b, r), 3 * n),
        ("bias_gelu_fwd (4C)", lambda: kernels.BIAS_GELU(h, b4), 3 * n4),
        ("gelu_bwd (4C)", lambda: kernels.GELU_BWD(h, g4), 3 * n4),
        ("gelu_bwd_colsum (4C, the bias's gradient too)",
         lambda: kernels.GELU_BWD_COLSUM(h, g4, None, xp.zeros(4 * C, dtype=dt)), 3 * n4),
        ("layernorm_fwd", lambda: kernels.LAYERNORM_FWD(x, w, b, 1e-5), 2 * n),
        ("layernorm_bwd", lambda: kernels.LAYERNORM_BWD(r, x, w, mean, rstd), 3 * n),
        ("layernorm_bwd + the residual's gradient",
         lambda: kernels.LAYERNORM_BWD(r, x, w, mean, rstd, None, None, None, x), 4 * n),
        ("rmsnorm_fwd", lambda: kernels.RMSNORM_FWD(x, w, 1e-5), 2 * n),
        ("rmsnorm_bwd", lambda: kernels.RMSNORM_BWD(r, x, w, rms), 3 * n),
        ("swiglu_fwd (4C)", lambda: kernels.SWIGLU_FWD(two), 3 * n4),
        ("swiglu_bwd (4C)", lambda: kernels.SWIGLU_BWD(two, g4), 5 * n4),
        ("geglu_fwd (4C)", lambda: kernels.GEGLU_FWD(two), 3 * n4),
        ("geglu_bwd (4C)", lambda: kernels.GEGLU_BWD(two, g4), 5 * n4),
        ("colsum_add", lambda: kernels.COLSUM_ADD(x, xp.zeros(C, dtype=dt)), n),
        ("rotary (q|k|v, heads of 64)",
         lambda: kernels.ROTARY(qkv.reshape(1, rows, 3 * C), cos, sin, heads, heads, 64, 1.0),
         2 * 3 * n),
        (f"cross_entropy_fwd (V {V})", lambda: kernels.CROSS_ENTROPY_FWD(z, t, -100), nv),
        (f"cross_entropy_bwd (V {V})",
         lambda: kernels.CROSS_ENTROPY_BWD(z, t, lse, -100, one), 2 * nv),
        ("copy (4C, the yardstick)", lambda: h.copy(), 2 * n4),
    ]


def _time(fn, calls: int, reps: int) -> tuple[float, str]:
    """(microseconds a call, how): ``calls`` calls captured as one CUDA graph and replayed,
    the best of ``reps``; eagerly, synchronized, where the capture is refused."""
    from hpcdist.device import backend, graphs
    from hpcdist.device.errors import DeviceError

    def many():
        for _ in range(calls):
            fn()
    try:
        run, how = graphs.capture(many), "graph"
    except DeviceError:
        run, how = many, "eager"
    best = float("inf")
    for _ in range(reps):
        backend.synchronize()
        t0 = time.perf_counter()
        run()
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6, how


def measure(rows: int, C: int, V: int, dtype: str, calls: int, reps: int) -> list:
    """[{kernel, bytes, us, GB/s, us one a thread, ...}] at (rows, C), logits (rows, V), in
    ``dtype``."""
    from hpcdist.device import backend
    from hpcdist.device.kernels import common
    xp = backend.xp()
    dt = backend.dtype("bfloat16") if dtype == "bf16" else np.dtype(dtype)
    out = []
    for name, fn, nbytes in _cases(xp, rows, C, V, dt, np.random.default_rng(0)):
        row = {"kernel": name, "bytes": nbytes}
        for key, vectors in (("", True), (" one a thread", False)):
            if key and name.startswith("copy"):
                continue
            common.VECTORS[0] = vectors
            try:
                us, how = _time(fn, calls, reps)
            finally:
                common.VECTORS[0] = True
            row[f"us{key}"], row[f"GB/s{key}"], row["timed as"] = us, nbytes / us / 1e3, how
        out.append(row)
    copy = out[-1]["GB/s"]
    for row in out:
        row["of copy"] = row["GB/s"] / copy
    return out


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench kernels", description=__doc__)
    ap.add_argument("--device", default="gpu", choices=("gpu", "standin"))
    ap.add_argument("--rows", type=int, default=8192, help="batch x sequence")
    ap.add_argument("--embd", type=int, default=1024, help="the model's width C")
    ap.add_argument("--vocab", type=int, default=50304, help="the logits' width (GPT-2's "
                    "50,257 padded to 64)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "float32", "float64"))
    ap.add_argument("--calls", type=int, default=20, help="calls in one timed graph")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from hpcdist.device import backend, fused
    if args.device == "gpu" and backend.gpu_count() == 0:
        print("no GPU visible: these are the GPU's kernels (--device standin checks the "
              "command on the CPU's model of one; its times say nothing)")
        return 0
    backend.init(args.device)
    rows = measure(args.rows, args.embd, args.vocab, args.dtype, args.calls, args.reps)
    print(f"{args.dtype}, {args.rows} rows x {args.embd} ({args.device}; us a call, "
          f"{rows[0]['timed as']})")
    print(f"{'kernel':32s} {'MB':>7s} {'us':>8s} {'GB/s':>7s} {'one/thread':>10s} {'GB/s':>7s}"
          f" {'of copy':>8s}")
    for r in rows:
        one = (f"{r['us one a thread']:10.1f} {r['GB/s one a thread']:7.0f}"
               if "us one a thread" in r else f"{'':10s} {'':7s}")
        print(f"{r['kernel']:32s} {r['bytes'] / 1e6:7.1f} {r['us']:8.1f} {r['GB/s']:7.0f} {one}"
              f" {r['of copy']:7.0%}")
    if fused.refusals():
        print("refused (ran the twin):", fused.refusals())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "rows": args.rows,
                       "embd": args.embd, "vocab": args.vocab, "kernels": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
