"""The search: every layout considered or refused with its reason, each estimated, the
fitting ones ranked."""
from __future__ import annotations

from dataclasses import asdict

from .model import GPU, Layout, Model, Settings
from .steptime import estimate


def candidates(model: Model, gpus: int, per_node: int, batch: int,
               settings: Settings = Settings()):
    """Every layout considered, and every one refused with its reason: ([Layout], [(dict,
    why)])."""
    from ..parallel import schedules as S
    ok, refused = [], []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            base = {"tp": tp, "pp": pp, "dp": dp}
            why = _mesh_problem(model, tp, pp, dp, per_node, batch, settings)
            if why:
                refused.append((base, why))
                continue
            per_replica = batch // dp
            for b in (1, 2, 4, 8):
                if per_replica % b:
                    refused.append(({**base, "micro_batch": b},
                                    f"{per_replica} sequences per replica do not split into "
                                    f"micro-batches of {b}"))
                    continue
                m = per_replica // b
                for name, v in _schedules(pp, settings.schedules):
                    if pp > 1:
                        try:
                            S.check(name, v)
                        except ValueError as e:
                            refused.append(({**base, "schedule": name}, str(e)))
                            continue
                        if v > 1 and ((model.layers // pp) % v or m % pp):
                            refused.append(({**base, "schedule": f"{name} v{v}"},
                                            f"interleaving needs layers per stage "
                                            f"({model.layers // pp}) divisible by v = {v} and "
                                            f"micro-batches ({m}) by pp"))
                            continue
                    for zero in settings.zero_stages:
                        if pp > 1 and zero > 1:
                            refused.append(({**base, "zero": zero}, f"ZeRO-{zero} shards "
                                            "gradients during backward: with a pipeline use "
                                            "ZeRO 0 or 1"))
                            continue
                        for recompute in (False, True):
                            sps = (False, True) if tp > 1 and settings.sequence_parallel \
                                else (False,)
                            for sp in sps:
                                ok.append(Layout(tp, pp, dp, zero, b, m, name, v, recompute, sp))
    return ok, refused


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_problem(model, tp, pp, dp, per_node, batch, settings) -> str | None:
    if tp > per_node and not settings.tp_across_nodes:
        return f"TP {tp} leaves the node ({per_node} GPUs): its collectives per layer would " \
               "cross the network (--tp-across-nodes to consider it)"
    if per_node % tp and tp < per_node:
        return f"TP {tp} does not divide the {per_node} GPUs of a node"
    if model.heads % tp or model.hidden % tp:
        return f"TP {tp} does not divide the heads ({model.heads}) and hidden ({model.hidden})"
    if model.layers % pp:
        return f"PP {pp} does not divide the {model.layers} layers"
    if batch % dp:
        return f"the global batch {batch} does not split over DP {dp}"
    return None


def _schedules(pp: int, allowed=None):
    if pp == 1:
        return [("none", 1)]
    return [(n, v) for n, v in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2),
                                ("interleaved", 4)) if allowed is None or n in allowed]


def plan(model: Model, gpu: GPU, gpus: int, per_node: int, batch: int,
         settings: Settings = Settings()):
    """(fitting estimates fastest first, refused [(layout dict, why)])."""
    layouts, refused = candidates(model, gpus, per_node, batch, settings)
    fits = []
    for L in layouts:
        e = estimate(model, L, gpu, gpus, per_node, batch, settings)
        if e.fits:
            fits.append(e)
        else:
            refused.append((asdict(L), e.why))
    fits.sort(key=lambda e: e.step_s)
    return fits, refused


def best_per_mesh(fits: list) -> list:
    """The fastest estimate of each DP x TP x PP, fastest first (``fits`` sorted)."""
    seen, out = set(), []
    for e in fits:
        key = (e.layout.tp, e.layout.pp, e.layout.dp)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
