"""The search: every layout considered or refused with its reason, each estimated, the
fitting ones ranked."""
from __future__ import annotations

from dataclasses import asdict

from .facts import GPU
from .model import Layout, Model, Settings, stage_splits
from .steptime import estimate


def candidates(model: Model, gpus: int, per_node: int, batch: int,
               settings: Settings = Settings()):
    """Every layout considered, and every one refused with its reason: ([Layout], [(dict,
    why)])."""
    ok, refused = [], []
    for base, split, why in meshes(model, gpus, per_node, batch, settings):
        if why:
            refused.append((base, why))
            continue
        per_replica = batch // base["dp"]
        for b in (1, 2, 4, 8):
            if per_replica % b:
                refused.append(({**base, "micro_batch": b},
                                f"{per_replica} sequences per replica do not split into "
                                f"micro-batches of {b}"))
                continue
            for name, v in _schedules(base["pp"], settings.schedules):
                why = _schedule_problem(model, base, split, name, v, per_replica // b)
                if why:
                    refused.append(({**base, "schedule": f"{name} v{v}"}, why))
                    continue
                ok.extend(_variants(model, base, split, b, per_replica // b, name, v=v,
                                    settings=settings, refused=refused))
    return ok + _hybrid(ok, per_node), refused


def _hybrid(layouts, per_node: int) -> list:
    """ZeRO layouts of plain data parallelism across nodes, sharded inside each node and
    replicated across them instead (what hpcdist.train's --shard-group node runs)."""
    from dataclasses import replace
    return [replace(L, shard=per_node) for L in layouts
            if L.zero and L.tp == L.pp == L.cp == L.ep == 1 and L.dp > per_node and
            L.dp % per_node == 0]


def meshes(model: Model, gpus: int, per_node: int, batch: int, settings: Settings):
    """(mesh dict, pipeline split, why it is refused or None) for every DP x CP x TP x PP
    and every split of the layers the search considers."""
    for tp in _divisors(gpus):
        for cp in [c for c in settings.cp_sizes if (gpus // tp) % c == 0 and tp * c <= gpus]:
            for pp in _divisors(gpus // (tp * cp)):
                base = {"tp": tp, "cp": cp, "pp": pp, "dp": gpus // (tp * pp * cp)}
                why = _mesh_problem(model, tp, pp, base["dp"], cp, per_node, batch=batch,
                                    settings=settings)
                splits = stage_splits(model.layers, pp)
                if not settings.uneven_splits:
                    splits = [s for s in splits if s == ()][:1]
                if not why and not splits:
                    why = (f"PP {pp} does not divide the {model.layers} layers (uneven splits "
                           "are off)" if model.layers >= pp else
                           f"PP {pp} is more stages than the {model.layers} layers")
                for split in splits if not why else [()]:
                    yield ({**base, "split": split} if split else base), split, why


def _expert_sizes(model, dp: int) -> list:
    """The EP sizes for a DP size: each divides DP and the experts (1 without experts)."""
    return [e for e in _divisors(dp) if model.experts % e == 0] if model.experts else [1]


def _variants(model, base, split, b, m, name, *, v, settings, refused) -> list:
    """The layouts of one mesh, micro-batch and schedule: ZeRO level, recompute, sequence
    parallelism, the context-parallel variant, the expert-parallel size."""
    out = []
    tp, pp, dp, cp = base["tp"], base["pp"], base["dp"], base["cp"]
    if model.experts and tp > 1 and settings.sequence_parallel:
        refused.append(({**base, "sp": True}, "sequence parallelism with experts: hpcdist runs "
                        "the experts whole on every tensor-parallel rank, over all its tokens"))
    for zero in settings.zero_levels:
        if pp > 1 and zero > 1:
            refused.append(({**base, "zero": zero}, f"ZeRO-{zero} with a pipeline would "
                            "reduce-scatter each stage's gradients every micro-batch: with a "
                            "pipeline use ZeRO 0 or 1 (as Megatron-LM and DeepSpeed do)"))
            continue
        for impl in settings.cp_impls if cp > 1 else ("ring",):
            for recompute in (False, True):
                for sp in (False, True) if tp > 1 and settings.sequence_parallel and \
                        not model.experts else (False,):
                    for ep in _expert_sizes(model, dp):
                        out.append(Layout(tp, pp, dp, zero, b, m, name, v, recompute, sp,
                                          cp, impl, split, ep=ep))
    return out


def _schedule_problem(model, base, split, name, v, m) -> str | None:
    from ..parallel import schedules as S
    pp = base["pp"]
    if pp == 1:
        return None
    try:
        S.check(name, v)
    except ValueError as e:
        return str(e)
    if v > 1 and (split or (model.layers // pp) % v or m % pp):
        return (f"interleaving needs an even split with layers per stage "
                f"({model.layers // pp}) divisible by v = {v} and micro-batches ({m}) by pp")
    return None


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh_problem(model, tp, pp, dp, cp, per_node, *, batch, settings) -> str | None:
    if tp > per_node and not settings.tp_across_nodes:
        return f"TP {tp} leaves the node ({per_node} GPUs): its collectives per layer would " \
               "cross the network (--tp-across-nodes to consider it)"
    if per_node % tp and tp < per_node:
        return f"TP {tp} does not divide the {per_node} GPUs of a node"
    if model.heads % tp or model.hidden % tp:
        return f"TP {tp} does not divide the heads ({model.heads}) and hidden ({model.hidden})"
    kv = model.kv_heads or model.heads
    if kv % tp:
        return f"TP {tp} does not divide the {kv} kv heads (each rank takes whole ones)"
    if model.mlp_width % tp:
        return f"TP {tp} does not divide the MLP's width {model.mlp_width}"
    if model.seq < 2 * cp:
        return f"CP {cp} cuts each sequence into {2 * cp} chunks; it has {model.seq} positions"
    if batch % dp:
        return f"the global batch {batch} does not split over DP {dp}"
    return None


def _schedules(pp: int, allowed=None):
    """(name, v) of every registered schedule (parallel/schedules.py) the settings allow
    (None: all), at each virtual-stage count its record asks the planner to try."""
    from ..parallel import schedules as S
    if pp == 1:
        return [("none", 1)]
    return [(n, v) for n, record in S.REGISTRY.items() for v in record.plan_v
            if allowed is None or n in allowed]


def plan(model: Model, gpu: GPU, gpus: int, per_node: int, batch: int,
         settings: Settings = Settings()):
    """(fitting estimates fastest first, refused [(layout dict, why)])."""
    layouts, refused = candidates(model, gpus, per_node, batch, settings)
    fits = []
    for L in layouts:
        kv = (model.kv_heads or model.heads) // L.tp
        if L.cp_impl == "ulysses" and kv % L.cp:
            refused.append((asdict(L), f"ulysses splits the {kv} kv heads a TP rank holds "
                            f"over CP {L.cp}: it must divide them"))
            continue
        e = estimate(model, L, gpu, gpus, per_node, batch, settings=settings)
        if e.fits:
            fits.append(e)
        else:
            refused.append((asdict(L), e.why))
    fits.sort(key=lambda e: e.step_s)
    return fits, refused


def best_per_mesh(fits: list) -> list:
    """The fastest estimate of each DP x CP x TP x PP, fastest first (``fits`` sorted)."""
    seen, out = set(), []
    for e in fits:
        key = (e.layout.tp, e.layout.pp, e.layout.dp, e.layout.cp, e.layout.ep)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
