"""The planner beside published runs (``bench plan --published``): Narayanan et al.'s Table 1
(Megatron-LM on A100s) and the Llama runs of ``plan.LLAMA_PUBLISHED`` (Llama 3 405B on 16K
H100s, torchtitan's Llama 3.1 8B on 8 H100s). No runs: the planner's estimates only."""
from __future__ import annotations


def published_comparison(gpu_name: str = "a100-80g") -> list:
    """Narayanan et al.'s Table 1 beside the planner: per row the published layout's estimate
    (as they ran it: micro-batch 1, full recompute, no ZeRO, its best schedule), that mesh's
    rank among the planner's meshes — searching all of hpcdist's features, and only what
    Megatron-LM offered then (``plan.FEATURES["megatron-2021"]``) — and the best mesh."""
    from hpcdist import plan as P
    gpu, rows = P.HARDWARE[gpu_name], []
    then = P.Settings(**P.FEATURES["megatron-2021"])
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in P.NARAYANAN_TABLE_1:
        model = P.Model(layers, hidden, heads, 2048, 51200)
        ranks = {}
        for name, settings in (("all", P.Settings()), ("2021", then)):
            meshes = P.best_per_mesh(P.plan(model, gpu, gpus, 8, batch, settings)[0])
            keys = [(e.layout.tp, e.layout.pp) for e in meshes]
            ranks[name] = (keys.index((tp, pp)) + 1 if (tp, pp) in keys else None, meshes[0])
        mine = None
        m = batch // (gpus // (tp * pp))
        for schedule, v in P._schedules(pp, then.schedules):
            if v > 1 and ((layers // pp) % v or m % pp):
                continue
            e = P.estimate(model, P.Layout(tp, pp, gpus // (tp * pp), 0, 1, m, schedule, v, True,
                                       False), gpu, gpus, 8, batch)
            if e.fits and (mine is None or e.step_s < mine.step_s):
                mine = e
        best = ranks["all"][1]
        rows.append({"model": f"{billions}B", "published": f"TP {tp} x PP {pp}, {gpus} GPUs",
                     "published_tflops": tflops,
                     "estimate_tflops": mine.tflops_per_gpu / 1e12 if mine else None,
                     "rank": ranks["all"][0], "rank_2021": ranks["2021"][0],
                     "best": f"TP {best.layout.tp} x PP {best.layout.pp}",
                     "best_tflops": best.tflops_per_gpu / 1e12})
    return rows


def llama_published(gpu_name: str = "h100") -> list:
    """The Llama runs the planner is held to (``plan.LLAMA_PUBLISHED``): the published layout's
    estimate (MFU, tokens/s per GPU) beside what was published, and the planner's best."""
    from hpcdist import plan as P
    gpu, rows = P.HARDWARE[gpu_name], []
    for run in P.LLAMA_PUBLISHED:
        model = P.preset(run["preset"])
        gpus, batch, tp, pp = run["gpus"], run["batch"], run["tp"], run["pp"]
        dp = gpus // (tp * pp)
        best_fit = None
        for m, schedule, v in ((max(pp, batch // dp), "1f1b" if pp > 1 else "none", 1),
                               (max(pp, batch // dp), "interleaved", 2)):
            if pp == 1 and schedule == "interleaved":
                continue
            for recompute in (False, True):
                L = P.Layout(tp, pp, dp, run["zero"], max(1, batch // dp // m), m, schedule, v,
                             recompute, tp > 1)
                e = P.estimate(model, L, gpu, gpus, 8, batch)
                if e.fits and (best_fit is None or e.step_s < best_fit.step_s):
                    best_fit = e
        fits, _ = P.plan(model, gpu, gpus, 8, batch, P.Settings())
        best = fits[0] if fits else None
        published = (f"MFU {run['mfu'][0]:.0%}-{run['mfu'][1]:.0%}" if "mfu" in run else
                     f"{run['tokens_per_gpu_s']:,} tokens/s/GPU")
        tokens = batch * model.seq / best_fit.step_s / gpus if best_fit else None
        rows.append({"model": run["preset"], "published": published,
                     "layout": f"TP {tp} x PP {pp} x DP {dp}, ZeRO-{run['zero']}",
                     "estimate": (f"MFU {best_fit.mfu:.0%}, {tokens:,.0f} tokens/s/GPU"
                                  if best_fit else "does not fit"),
                     "best": (f"TP {best.layout.tp} x PP {best.layout.pp} x DP "
                              f"{best.layout.dp}: MFU {best.mfu:.0%}" if best else "none")})
    return rows
