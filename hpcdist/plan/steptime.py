"""Step time of a layout: FLOPs at a fraction of the peak, tensor-parallel collectives,
stage sends, the pipeline's makespan from our schedule simulator, the data-parallel
reduction, and the CPU terms ``bench plan`` calibrates."""
from __future__ import annotations

import math
from dataclasses import replace

from .memory import hpcdist_layer, memory
from .model import GB, GPU, Estimate, Layout, Model, Settings


_SIM: dict = {}


def pipeline_makespan(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """(makespan, bubble) of one step's pipeline with per-chunk forward ``f`` and backward
    ``b`` seconds: hpcdist's schedule simulator (schedules.verify) where the list is small
    enough, closed forms beyond (checked against the simulator in tests)."""
    from ..parallel import schedules as S
    if P == 1:
        return m * (f + b), 0.0
    ratio = round(b / f, 2) if f else 2.0
    key = (name, P, m, v, ratio)
    if key not in _SIM:
        if P * m * v <= 4096:
            costs = {"F": 1.0, "B": ratio, "I": ratio / 2, "W": ratio / 2}
            sched = S.make(name, P, m, v, {"F": 1.0, "I": ratio / 2, "W": ratio / 2}
                           if S.get(name).replan else None)
            r = S.verify(sched, P, m, v, costs=costs)
            _SIM[key] = (r.makespan, r.bubble)
        else:
            _SIM[key] = closed_form(name, P, m, v, 1.0, ratio)
    unit, bubble = _SIM[key]
    return unit * f, bubble


def closed_form(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """Makespan and bubble for uniform op costs: GPipe and 1F1B (m + P - 1)(f + b);
    interleaved (mv + P - 1)(f + b) with per-chunk costs; ZB-H1 m(f + b) + (P - 1) f
    (Qi et al.: the bubble (P - 1)(T_F + T_I - T_W), with I = W = b/2)."""
    if name == "zb-h1":
        total = m * (f + b) + (P - 1) * f
        busy = m * (f + b)
    else:
        total = (m * v + P - 1) * (f + b)
        busy = m * v * (f + b)
    return total, 1 - busy / total


def _allreduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def estimate(model: Model, L: Layout, gpu: GPU, gpus: int, per_node: int, batch: int,
             settings: Settings = Settings()) -> Estimate:
    e = Estimate(L)
    e.memory = memory(model, L, settings)
    usable = gpu.memory * settings.memory_headroom
    if e.memory["total"] > usable:
        e.fits = False
        e.why = (f"needs {e.memory['total'] / GB:.1f} GB per GPU, {usable / GB:.1f} GB usable "
                 f"({(e.memory['total'] - usable) / GB:.1f} GB over)")
    s, h, V, t, b = model.seq, model.hidden, model.vocab, L.tp, L.micro_batch
    peak = gpu.flops[settings.dtype] * settings.efficiency
    layers = model.layers // L.pp
    layer_fwd = 24 * b * s * h * h * (1 + s / (6 * h)) / t
    tp_bw, tp_alpha = (gpu.nvlink, gpu.nvlink_alpha) if t <= per_node else \
        (gpu.network, gpu.network_alpha)
    act_bytes = settings.param_bytes * b * s * h
    call = settings.call_overhead
    tp_fwd = 2 * (_allreduce(act_bytes, t, tp_bw, tp_alpha) + call) if t > 1 else 0.0
    over = settings.layer_overhead
    if settings.byte_cost:
        written = hpcdist_layer(model, replace(L, recompute=False), settings, "first")[0]
        over += settings.byte_cost * written
    f = layers * (layer_fwd / peak + tp_fwd + over)
    bwd = layers * (2 * layer_fwd / peak + tp_fwd + 2 * over)
    if L.recompute:
        bwd += layers * (layer_fwd / peak + tp_fwd + over)
    logits = 2 * b * s * h * V / t / peak                          # on the last stage
    f_last, b_last = f + logits, bwd + 2 * logits
    # rank = (pp * DP + dp) * TP + tp, a node's ranks consecutive: neighbouring stages are
    # TP x DP ranks apart, a data-parallel group's ranks TP apart
    pp_send = 0.0
    if L.pp > 1:                        # scatter/gather over TP: each rank sends 1/t
        across = t * L.dp >= per_node
        pp_send = act_bytes / t / (gpu.network if across else gpu.nvlink) \
            + (gpu.network_alpha if across else gpu.nvlink_alpha) + call
    fc = max(f, f_last) / L.virtual + pp_send       # each chunk sends its own activations
    bc = max(bwd, b_last) / L.virtual + pp_send
    schedule = L.schedule if L.pp > 1 else "1f1b"
    pipe, bubble = pipeline_makespan(schedule, L.pp, L.micro_batches, L.virtual, fc, bc)
    if settings.ranks_per_core > 1 and L.pp > 1:
        busy = L.micro_batches * L.virtual * (fc + bc)
        pipe = max(busy, pipe / settings.ranks_per_core)
        bubble = 1 - busy / pipe
    psi = (layers * 12 * h * h * (1 + 13 / (12 * h)) + V * h + s * h) / t
    grad_bytes = settings.grad_bytes * psi
    inside = t * L.dp <= per_node
    dp = _allreduce(grad_bytes, L.dp, gpu.nvlink if inside else gpu.network,
                    gpu.nvlink_alpha if inside else gpu.network_alpha) \
        * (1.5 if L.zero == 3 else 1)
    if L.dp > 1:                   # a call per 25 MB bucket; ZeRO-3 gathers every block twice
        calls = max(1, math.ceil(grad_bytes / 25e6)) + (3 * layers if L.zero == 3 else 0)
        dp += calls * call
    optimizer = 16 * psi / (L.dp if L.zero else 1) / 2e12     # a memory-bound pass over state
    e.step_s = pipe + dp + optimizer
    tp_total = L.micro_batches * layers * tp_fwd * (3 if L.recompute else 2)
    e.parts = {"pipeline": pipe, "tp": tp_total,
               "pp": 2 * L.micro_batches * L.virtual * pp_send,
               "dp": dp, "optimizer": optimizer}
    e.bubble = bubble
    executed = model.flops(batch, L.recompute)
    e.tflops_per_gpu = executed / e.step_s / gpus
    e.mfu = model.flops(batch, False) / e.step_s / gpus / gpu.flops[settings.dtype]
    return e
