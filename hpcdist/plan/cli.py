"""``python -m hpcdist.plan``: the command line (the package's docstring is its help)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from .model import FEATURES, GB, GPU, HARDWARE, Model, Settings
from .search import best_per_mesh, plan


def calibrated(gpu: GPU, settings: Settings, path: str) -> tuple:
    """The card and settings with what our benchmarks measured: a JSON object (or the
    ``calibration`` inside ``bench plan``'s ``bench_plan.json``) with any of ``efficiency``,
    ``nvlink`` / ``network`` as [alpha s, bytes/s], ``layer_overhead_s``, ``byte_cost_s``,
    ``call_overhead_s``, ``ranks_per_core`` (a byte cost counts hpcdist's own layers)."""
    doc = json.load(open(path))
    doc = doc.get("calibration", doc)
    if "efficiency" in doc:
        settings = replace(settings, efficiency=float(doc["efficiency"]))
    for level in ("nvlink", "network"):
        if level in doc:
            alpha, bw = doc[level]
            gpu = replace(gpu, **{level: float(bw), f"{level}_alpha": float(alpha)})
    for key, name in (("layer_overhead_s", "layer_overhead"), ("byte_cost_s", "byte_cost"),
                      ("call_overhead_s", "call_overhead"), ("ranks_per_core", "ranks_per_core")):
        if key in doc:
            settings = replace(settings, **{name: float(doc[key])})
    if settings.byte_cost:
        settings = replace(settings, activations="hpcdist")
    return gpu, settings


def main(argv=None) -> int:
    doc = sys.modules[__package__].__doc__
    ap = argparse.ArgumentParser(prog="python -m hpcdist.plan",
                                 description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
    ap.add_argument("--model", default="gpt", choices=("gpt",))
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="a100-80g", choices=sorted(HARDWARE) + ["custom"])
    ap.add_argument("--peak-tflops", type=float, help="custom: dense TFLOP/s of --dtype")
    ap.add_argument("--memory-gb", type=float, help="custom: memory per GPU")
    ap.add_argument("--nvlink-gbs", type=float, help="custom: NVLink GB/s each way")
    ap.add_argument("--network-gbs", type=float, help="custom: network GB/s per GPU")
    ap.add_argument("--efficiency", type=float, default=Settings.efficiency,
                    help="fraction of the peak the layers' matmuls reach")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tp-across-nodes", action="store_true")
    ap.add_argument("--no-sequence-parallel", action="store_true",
                    help="leave sequence parallelism out (a framework without it)")
    ap.add_argument("--features", default="all", choices=sorted(FEATURES),
                    help="what the framework offers: all of hpcdist's, or megatron-2021 (no "
                         "ZeRO, no sequence parallelism, 1F1B and interleaved only)")
    ap.add_argument("--calibrate", help="JSON of measured efficiency, links and overheads "
                    "(bench plan's runs/bench/bench_plan.json)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="the ranked list as JSON")
    args = ap.parse_args(argv)
    if args.gpu == "custom":
        if not (args.peak_tflops and args.memory_gb and args.nvlink_gbs and args.network_gbs):
            ap.error("--gpu custom needs --peak-tflops, --memory-gb, --nvlink-gbs, --network-gbs")
        gpu = GPU("custom", {args.dtype: args.peak_tflops * 1e12}, args.memory_gb * GB,
                  args.nvlink_gbs * GB, args.network_gbs * GB)
    else:
        gpu = HARDWARE[args.gpu]
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        ap.error(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    settings = Settings(efficiency=args.efficiency, dtype=args.dtype,
                        tp_across_nodes=args.tp_across_nodes,
                        **FEATURES[args.features])
    if args.no_sequence_parallel:
        settings = replace(settings, sequence_parallel=False)
    if args.calibrate:
        gpu, settings = calibrated(gpu, settings, args.calibrate)
    model = Model(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    fits, refused = plan(model, gpu, args.gpus, args.gpus_per_node, args.global_batch,
                         settings)
    if args.json:
        print(json.dumps([e.row() for e in fits[:args.top]], indent=1))
        return 0 if fits else 1
    print(f"GPT {model.layers} layers x {model.hidden} hidden ({model.heads} heads), "
          f"{model.parameters / 1e9:.1f} B parameters, seq {model.seq}, global batch "
          f"{args.global_batch} on {args.gpus} x {gpu.name} ({args.gpus_per_node} per node); "
          f"{len(fits)} layouts fit, {len(refused)} refused")
    if not fits:
        reasons = {}
        for _, why in refused:
            reasons[why.split(" (")[0]] = why
        print("nothing fits; e.g. " + "; ".join(list(reasons.values())[:3]))
        return 1
    cols = ["tp", "pp", "dp", "zero", "micro_batch", "micro_batches", "schedule", "recompute",
            "sp", "memory_gb", "step_s", "tflops_per_gpu", "mfu", "bubble", "comm_share"]
    meshes = best_per_mesh(fits)
    print(f"the {min(args.top, len(meshes))} fastest meshes (DP x TP x PP), each with its best "
          f"settings (--json: every layout, ranked):")
    print(" ".join(f"{c:>14s}" for c in cols))
    for e in meshes[:args.top]:
        r = e.row()
        print(" ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{str(r[c]):>14s}"
                       for c in cols))
    best = fits[0]
    p = best.parts
    print(f"best: TP {best.layout.tp} x PP {best.layout.pp} x DP {best.layout.dp}: "
          f"{best.step_s:.2f} s per step = pipeline {p['pipeline']:.2f} s (bubble "
          f"{best.bubble * 100:.1f}%, TP collectives {p['tp']:.2f} s inside it) + DP gradient "
          f"reduction {p['dp']:.2f} s + optimizer {p['optimizer']:.3f} s; "
          f"{best.memory['total'] / GB:.1f} GB per GPU")
    return 0
