"""Step time of a layout: FLOPs at a fraction of the peak, tensor-parallel collectives,
stage sends, the pipeline's makespan from our schedule simulator, the data-parallel
reduction, and the CPU terms ``bench plan`` calibrates."""
from __future__ import annotations

import math
from dataclasses import replace

from .memory import hpcdist_layer, memory, moe_block, schedule_order, zero_level
from .facts import GB, GPU
from .model import Estimate, Layout, Model, Settings


_SIM: dict = {}


def pipeline_makespan(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """(makespan, bubble) of one step's pipeline with per-chunk forward ``f`` and backward
    ``b`` seconds: the schedule's own closed form (its registry record's ``makespan``, exact
    for uniform costs: checked against the simulator in tests) where its order does not
    depend on the costs; else hpcdist's schedule simulator (schedules.verify) on the plan
    made from these costs, where the list is small enough."""
    from ..parallel import schedules as S
    if P == 1:
        return m * (f + b), 0.0
    ratio = round(b / f * 10) / 10 if f else 2.0    # the shape, to 0.1 (a cache key)
    record = S.get(name)
    if not record.replan and record.makespan is not None:
        total, bubble = closed_form(name, P, m, v, 1.0, ratio)
        return total * f, bubble
    key = (name, P, m, v, ratio)
    if key not in _SIM:
        if P * m * v <= 4096 or record.makespan is None:
            costs = {"F": 1.0, "B": ratio, "I": ratio / 2, "W": ratio / 2}
            sched = schedule_order(name, P, m, v, {"F": 1.0, "I": ratio / 2, "W": ratio / 2}
                                   if record.replan else None)
            r = S.verify(S.add_communication(sched, P, v), P, m, v, costs=costs)
            _SIM[key] = (r.makespan, r.bubble)
        else:
            _SIM[key] = closed_form(name, P, m, v, 1.0, ratio)
    unit, bubble = _SIM[key]
    return unit * f, bubble


def closed_form(name: str, P: int, m: int, v: int, f: float, b: float) -> tuple:
    """(makespan, bubble) for uniform op costs, from the schedule's record (``makespan``):
    the work is m v (f + b) per stage; the rest is bubble."""
    from ..parallel import schedules as S
    total = S.get(name).makespan(P, m, v, f, b)
    busy = m * v * (f + b)
    return total, 1 - busy / total


def _allreduce(nbytes: float, n: int, bw: float, alpha: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def estimate(model: Model, L: Layout, gpu: GPU, gpus: int, per_node: int, batch: int,
             *, settings: Settings = Settings()) -> Estimate:
    e = Estimate(L)
    e.memory = memory(model, L, settings)
    usable = gpu.memory * settings.memory_headroom
    if e.memory["total"] > usable:
        e.fits = False
        e.why = (f"needs {e.memory['total'] / GB:.1f} GB per GPU, {usable / GB:.1f} GB usable "
                 f"({(e.memory['total'] - usable) / GB:.1f} GB over)")
        return e                        # refused: no time needed
    f, bwd, tp_fwd, cp_fwd, ep_fwd = layer_times(model, L, gpu, per_node, settings)
    sizes = L.stages(model.layers)
    logits = 2 * L.micro_batch * (model.seq / L.cp) * model.hidden * model.vocab_rows(L.tp) / \
        (gpu.flops[settings.dtype] * settings.efficiency)          # on the last stage
    # each stage's blocks (the last with the head); the slowest stage sets the pace
    fs = [n * f + (logits if k == len(sizes) - 1 else 0) for k, n in enumerate(sizes)]
    bs = [n * bwd + (2 * logits if k == len(sizes) - 1 else 0) for k, n in enumerate(sizes)]
    # rank = ((pp * DP + dp) * CP + cp) * TP + tp, a node's ranks consecutive: neighbouring
    # stages are TP x CP x DP ranks apart, a data-parallel group's ranks TP apart
    call = settings.call_overhead
    act_bytes = settings.param_bytes * L.micro_batch * model.seq / L.cp * model.hidden
    pp_send = 0.0
    if L.pp > 1:                        # scatter/gather over TP: each rank sends 1/t
        across = L.tp * L.cp * L.dp >= per_node
        pp_send = act_bytes / L.tp / (gpu.network if across else gpu.nvlink) \
            + (gpu.network_alpha if across else gpu.nvlink_alpha) + call
    fc = max(fs) / L.virtual + pp_send              # each chunk sends its own activations
    bc = max(bs) / L.virtual + pp_send
    schedule = L.schedule if L.pp > 1 else "1f1b"
    pipe, bubble = pipeline_makespan(schedule, L.pp, L.micro_batches, L.virtual, fc, bc)
    if settings.ranks_per_core > 1 and L.pp > 1:
        busy = L.micro_batches * L.virtual * (fc + bc)
        pipe = max(busy, pipe / settings.ranks_per_core)
        bubble = 1 - busy / pipe
    dp, optimizer = data_parallel_time(model, L, gpu, per_node, settings, max(sizes))
    e.step_s = pipe + dp + optimizer
    layers = max(sizes)
    e.parts = {"pipeline": pipe, "tp": L.micro_batches * layers * tp_fwd * (3 if L.recompute
                                                                               else 2),
               "cp": L.micro_batches * layers * cp_fwd * (4 if L.recompute else 3),
               "ep": L.micro_batches * layers * ep_fwd * (3 if L.recompute else 2),
               "pp": 2 * L.micro_batches * L.virtual * pp_send,
               "dp": dp, "optimizer": optimizer}
    e.bubble = bubble
    e.tflops_per_gpu = model.flops(batch, L.recompute) / e.step_s / gpus
    e.mfu = model.flops(batch, False) / e.step_s / gpus / gpu.flops[settings.dtype]
    return e


def layer_times(model: Model, L: Layout, gpu: GPU, per_node: int, settings: Settings):
    """(forward s, backward s, the tensor-parallel and the context-parallel part of a
    forward) of one layer on one micro-batch: FLOPs at a fraction of the peak (the rank's s/c
    tokens against the whole sequence), the TP collectives, the CP messages (ring: only what
    the block in hand does not hide; ulysses: two all-to-alls, not overlapped), the
    calibrated CPU terms."""
    s, h, t, b, c = model.seq, model.hidden, L.tp, L.micro_batch, L.cp
    peak = gpu.flops[settings.dtype] * settings.efficiency
    d = model.attention_width                   # heads x head size
    layer_fwd = (2 * b * s * model.matmul_weights + 4 * b * s * s * d) / t / c
    tp_bw, tp_alpha = (gpu.nvlink, gpu.nvlink_alpha) if t <= per_node else \
        (gpu.network, gpu.network_alpha)
    token_bytes = settings.param_bytes * b * s / c  # a rank's tokens, one element each
    act_bytes = token_bytes * h
    call = settings.call_overhead
    tp_fwd = 2 * (_allreduce(act_bytes, t, tp_bw, tp_alpha) + call) if t > 1 else 0.0
    cp_fwd = 0.0
    if c > 1:
        bw, alpha = (gpu.nvlink, gpu.nvlink_alpha) if t * c <= per_node else \
            (gpu.network, gpu.network_alpha)
        kv = model.kv_width                      # (grouped-query attention: fewer than d)
        if L.cp_impl == "ring":         # c - 1 hops of K and V, each beside a block's attention
            hop = alpha + call + 2 * token_bytes * kv / t / bw
            block = 4 * b * (s / c) ** 2 * d / t / 2 / peak
            cp_fwd = (c - 1) * max(0.0, hop - block)
        else:                           # q, k, v and the output, (c - 1)/c of them each
            cp_fwd = 2 * (c - 1) * (alpha + call) + \
                token_bytes * (2 * d + 2 * kv) / t * (c - 1) / c / bw
    moe, ep_fwd = moe_layer(model, L, gpu, per_node, settings)
    layer_fwd += moe
    over = settings.layer_overhead
    if settings.byte_cost:
        written = hpcdist_layer(model, replace(L, recompute=False, cp=1), settings,
                                "first")[0] / c
        over += settings.byte_cost * written
    f = layer_fwd / peak + tp_fwd + cp_fwd + ep_fwd + over
    bwd = 2 * layer_fwd / peak + tp_fwd + 2 * cp_fwd + ep_fwd + 2 * over
    if L.recompute:
        bwd += f
    return f, bwd, tp_fwd, cp_fwd, ep_fwd


def moe_layer(model: Model, L: Layout, gpu: GPU, per_node: int, settings: Settings) -> tuple:
    """(forward FLOPs an MoE layer adds to a dense layer's, the EP all-to-alls of its
    forward in seconds), averaged over the layers (one in ``moe_every``). FLOPs: k experts
    per token (2hf a matmul: two, or three gated), whole on every tensor-parallel rank, and
    the router (2hE), for the dense MLP's over t (GPT-2's 16h^2/t). The all-to-alls: the
    dispatch and the combine, each moving k rows of h per token, (ep - 1)/ep of them to
    other ranks (the routing assumed balanced), inside the node when the EP group is (tp x
    cp x ep ranks), with a latency per peer, less the share ``settings.ep_overlap`` hides;
    the backward runs the same two again."""
    if not model.experts:
        return 0.0, 0.0
    s, h, t, b, c, k = model.seq, model.hidden, L.tp, L.micro_batch, L.cp, model.top_k
    f = model.anatomy.expert_width
    tokens = b * s / c
    share = model.moe_layers / model.layers
    mats = model.expert_matmuls                    # an expert's matmuls (gated: three)
    dense = 2 * mats * h * model.mlp_width
    flops = tokens * (2 * mats * k * h * f + 2 * h * model.experts - dense / t)
    if L.ep == 1:
        return share * flops, 0.0
    inside = t * c * L.ep <= per_node
    bw, alpha = (gpu.nvlink, gpu.nvlink_alpha) if inside else (gpu.network, gpu.network_alpha)
    rows = settings.param_bytes * tokens * k * h * (L.ep - 1) / L.ep
    one = (L.ep - 1) * alpha + rows / bw + settings.call_overhead
    return share * flops, share * 2 * one * (1 - settings.ep_overlap)


def data_parallel_time(model: Model, L: Layout, gpu: GPU, per_node: int, settings: Settings,
                       layers: int) -> tuple:
    """(the gradient reduction over DP x CP, not overlapped, as Megatron-LM ran it; the
    optimizer's memory-bound pass over its state) in seconds."""
    h, t = model.hidden, L.tp
    psi = (layers * (model.block_split + model.block_whole) + model.positions) / t + \
        model.vocab_rows(t) * h * (1 if model.head_tied else 2)
    # the experts' gradients are averaged over the ranks holding them (DP x CP / EP)
    experts = layers * model.moe_layers / model.layers * (model.experts // L.ep) * \
        model.expert_size
    psi += layers * moe_block(model, L) - experts
    grad_bytes = settings.grad_bytes * psi
    n = L.dp * L.cp
    inside = t * n <= per_node
    level = zero_level(L.zero)                  # its traffic and calls, as its class says
    if L.shard:            # hybrid: ZeRO's traffic inside the node, then the shards across
        groups = n // L.shard
        dp = _allreduce(grad_bytes, L.shard, gpu.nvlink, gpu.nvlink_alpha) * level.traffic \
            + _allreduce(grad_bytes / L.shard, groups, gpu.network, gpu.network_alpha)
    else:
        dp = _allreduce(grad_bytes, n, gpu.nvlink if inside else gpu.network,
                        gpu.nvlink_alpha if inside else gpu.network_alpha) * level.traffic
    if experts and n // L.ep > 1:
        e_in = t * n <= per_node
        dp += _allreduce(settings.grad_bytes * experts, n // L.ep,
                         gpu.nvlink if e_in else gpu.network,
                         gpu.nvlink_alpha if e_in else gpu.network_alpha) * level.traffic
    if n > 1:                      # a call per 25 MB bucket; ZeRO-3 gathers every block twice
        calls = max(1, math.ceil(grad_bytes / 25e6)) + level.calls_per_block * layers
        dp += calls * settings.call_overhead
    psi += experts
    optimizer = 16 * psi / ((L.shard or n // L.ep) if L.zero else 1) / 2e12   # a pass over state
    return dp, optimizer
