"""Memory per GPU of a layout: ZeRO's state formulas and the activations a stage holds at
its most (Korthikanti et al.'s layers or hpcdist's own, the stash walked along our
schedules)."""
from __future__ import annotations

from dataclasses import replace

from .model import Layout, Model, Settings


def memory(model: Model, L: Layout, settings: Settings = Settings(),
           stage: str | None = None) -> dict:
    """Bytes per GPU on the ``stage`` "first" or "last" (None: the fuller of the two).

    Parameters counted as a block holds them under tensor parallelism (``Model.block_split``
    over the TP ranks: GPT-2's 12h^2 + 7h, QKV, the projections, the MLP and their column-
    parallel biases; ``block_whole`` on every rank: GPT's 6h of row-parallel biases and two
    LayerNorms, Llama's two RMSNorms); the vocabulary-parallel table padded to a multiple of
    TP and a learned position table on the first stage; the final norm and the head (the tied
    table's copy, or an untied head split over TP) on the last; a middle stage ("middle",
    with more than two stages) holds the most blocks of the stages between. ZeRO shards over
    DP x CP (the ranks that hold the same parameters)."""
    h, t = model.hidden, L.tp
    block = model.block_split / t + model.block_whole + moe_block(model, L)
    sizes = L.stages(model.layers)
    table = model.vocab_rows(t) * h
    norm = model.norm_size
    head = table                          # (tied: the table's copy; untied: as wide)
    held = {"first": sizes[0] * block + table + model.positions +
            (norm + (0 if model.head_tied else head) if L.pp == 1 else 0),
            "last": sizes[-1] * block + norm + (head if L.pp > 1 else 0)}
    if L.pp > 2:
        held["middle"] = max(sizes[1:-1]) * block
    # the ranks ZeRO shards over (under EP those holding the same experts: train.py's)
    d = L.shard or L.dp * L.cp // L.ep
    pb, gb, ob = settings.param_bytes, settings.grad_bytes, settings.optimizer_bytes

    sharded = zero_level(L.zero).sharded          # what the level's class says it splits

    def state(psi):                       # bytes per parameter, ZeRO's sharding (rank 0's
        shard = -(-int(psi) // d)         # shard: the layout's first, ceil(psi / d))
        return tuple(b * (shard if kind in sharded else psi) for kind, b in
                     (("params", pb), ("grads", gb), ("optimizer", ob)))
    blocks = {"first": sizes[0], "last": sizes[-1], "middle": max(sizes[1:-1] or [0])}
    out = {}
    for name, psi in held.items():
        p, g, o = state(psi) if not settings.lora_rank else \
            lora_state(model, L, settings, psi, blocks[name], state)
        act = activations(model, L, settings, name)
        out[name] = {"params": p, "grads": g, "optimizer": o, "activations": act,
                     "buffers": settings.buffers, "total": p + g + o + act + settings.buffers}
    return out[stage] if stage else max(out.values(), key=lambda x: x["total"])


def lora_state(model: Model, L: Layout, settings: Settings, psi: float, blocks: int,
               state) -> tuple:
    """(params, grads, optimizer) bytes of a LoRA stage holding ``psi`` base parameters in
    ``blocks`` blocks: the frozen base whole (its block weights at ``base_bits`` where set),
    the adapters' state as any parameters' (``state``: ZeRO's sharding)."""
    weights = blocks * model.matmul_weights / L.tp
    bits = settings.base_bits or 8 * settings.param_bytes
    base = (psi - weights) * settings.param_bytes + weights * bits / 8
    p, g, o = state(blocks * model.lora_parameters(settings.lora_rank, L.tp))
    return base + p, g, o


def moe_block(model: Model, L: Layout) -> float:
    """Parameters an MoE block holds per GPU beyond a dense block's, averaged over the
    blocks (one in ``moe_every``): the dense MLP's split over TP (its down projection's bias
    on every rank) replaced by the router (hE) and E/ep experts, whole on every
    tensor-parallel rank (as hpcdist runs them)."""
    if not model.experts:
        return 0.0
    h, t = model.hidden, L.tp
    moe = h * model.experts + model.experts // L.ep * model.expert_size
    dense = (model.mlp_params - model.mlp_whole) / t + model.mlp_whole
    return model.moe_layers / model.layers * (moe - dense)


def moe_activations(model: Model, L: Layout, settings: Settings) -> float:
    """Bytes one MoE layer stores in forward beyond the dense MLP's: per token k rows
    through an expert (the gathered input, the hidden activations — the pre-activation and
    its GELU, f each, or a gated MLP's gate | up and their product, 3f —, the output, its
    gated copy; under EP the rows received and returned: 2h more) and the router's logits
    and probabilities (2E), against the dense MLP's hidden activations split over TP."""
    if not model.experts:
        return 0.0
    h, k, E, t = model.hidden, model.top_k, model.experts, L.tp
    f = model.anatomy.expert_width
    n = L.micro_batch * model.seq
    kept = 3 if model.anatomy.gated else 2          # hidden activations per unit of width
    hidden = kept * f
    dense = kept * model.mlp_width / t
    per_row = hidden + 3 * h + (2 * h if L.ep > 1 else 0)
    return settings.param_bytes * n * (k * per_row + 2 * E - dense)


def activations(model: Model, L: Layout, settings: Settings = Settings(),
                stage: str = "first") -> float:
    """Bytes of activations a GPU holds at its most on the ``stage`` "first", "middle" or
    "last": one
    layer's stored tensors times the layers of a chunk times the micro-batch chunks the
    schedule keeps in flight there (``stash_at_peak``), plus the embedding
    (first) or the logits and loss (last) of each micro-batch in flight and, with full
    recompute, the one layer rebuilt in backward. ``settings.activations`` picks the layer:

    - "megatron": Korthikanti et al. 2022, Table 2, for Megatron-LM's layers in 16-bit
      (sbh(10 + 24/t + 5as/(ht)) bytes, sbh(34/t + 5as/(ht)) with sequence parallelism,
      2sbh, the layer's input, with full recompute); the fp32 logits and their gradient;
    - "hpcdist": hpcdist's own GPT (nn/gpt.py, parallel/tp/) counted tensor by tensor in
      ``hpcdist_layer``; checked against ``--trace-memory`` runs by ``bench plan --memory``.

    Context parallelism (CP c): every per-token term counts the s/c tokens a rank holds;
    attention's scores are the ring's (s/c)^2 blocks, or with ulysses the a/c heads' over the
    whole sequence.
    """
    if L.cp > 1:
        local = replace(model, seq=-(-model.seq // L.cp))
        # the ring's steps run the tiled kernels by blocks (parallel/ring_flash.py) and
        # Ulysses the tiled attention on a/c heads: (s/c)^2 blocks or scores only where the
        # settings keep probabilities
        out = activations(local, replace(L, cp=1), settings, stage)
        if L.cp_impl == "ulysses" and settings.attention_probs:  # a/c heads over all s
            held, _ = stash_at_peak(L.schedule, L.pp, L.micro_batches, L.virtual,
                                    "first" if stage == "middle" else stage)
            per_layer = scores(model.seq, model.heads / L.cp, L, settings) - \
                scores(local.seq, model.heads, L, settings)
            out += per_layer * (1 if L.recompute else
                                held * stage_layers(model, L, stage) / L.virtual)
        return out
    layers = stage_layers(model, L, stage)
    held, edge = stash_at_peak(L.schedule, L.pp, L.micro_batches, L.virtual,
                               "first" if stage == "middle" else stage)
    per = hpcdist_layer if settings.activations == "hpcdist" else megatron_layer
    stored, rebuilt, ends = per(model, L, settings, "first" if stage == "middle" else stage)
    moe = moe_activations(model, L, settings)      # an MoE layer's, beyond a dense one's
    if L.recompute:
        rebuilt += moe
    else:
        stored += moe * model.moe_layers / model.layers
    if stage == "middle":                          # neither the embedding nor the head
        ends = 0.0
    if L.pp == 1:                                   # one stage: both ends
        ends += per(model, L, settings, "last" if stage == "first" else "first")[2]
    # each chunk in flight holds its layers; the embedding or the head comes with the
    # micro-batches in flight through the chunk that has it
    return held * layers / L.virtual * stored + edge * ends + rebuilt


def stage_layers(model: Model, L: Layout, stage: str) -> int:
    """Blocks on the ``stage`` "first", "last" or "middle" (the fullest between them)."""
    sizes = L.stages(model.layers)
    return sizes[0] if stage == "first" else sizes[-1] if stage == "last" else \
        max(sizes[1:-1])


def scores(seq: int, heads: float, L: Layout, settings: Settings) -> float:
    """Bytes of one layer's attention scores kept for backward (the term in s^2 of
    ``megatron_layer`` / ``hpcdist_layer``)."""
    b, t = L.micro_batch, L.tp
    if settings.activations == "hpcdist":
        return b * heads * seq * seq / t * settings.param_bytes
    return 5 * heads * seq * seq * b / t


_STASH: dict = {}
_ORDERS: dict = {}


def schedule_order(name: str, P: int, m: int, v: int, costs: dict | None = None) -> list:
    """Our schedule's compute order per stage (its generator's, without the communication
    ``schedules.make`` adds: the stash walk reads only F, B, I and W), made once per (name,
    P, m, v, costs) in a process; the stash walk and the makespan's simulation share it
    (read only)."""
    from ..parallel import schedules as S
    key = (name, P, m, v, tuple(sorted(costs.items())) if costs else None)
    if key not in _ORDERS:
        _ORDERS[key] = S.check(name, v).generate(P, m, v, costs)
    return _ORDERS[key]


def stash_at_peak(name: str, P: int, m: int, v: int, stage: str) -> tuple:
    """(micro-batch chunks the ``stage`` ("first" or "last") holds activations for at its
    most, how many of them are through its edge chunk: the first stage's chunk 0 embeds, the
    last stage's chunk v - 1 holds the head). Walked along our schedule's own action list
    (F adds a chunk, B or W frees it) where it is small enough; past that the registry's
    bound, with the edge chunks an even share."""
    from ..parallel import schedules as S
    if P == 1:
        return 1, 1
    key = (name, P, m, v, stage)
    if key not in _STASH:
        rank = 0 if stage == "first" else P - 1
        if P * m * v > 4096:
            held = S.promised_stash(name, P, m, v)[rank]
            _STASH[key] = (held, held / v)
        else:
            costs = {"F": 1.0, "I": 1.0, "W": 1.0} if S.get(name).replan else None
            edge_chunk = 0 if stage == "first" else v - 1
            live, edge, best = set(), 0, (0, 0)
            for a in schedule_order(name, P, m, v, costs)[rank]:
                if a.kind == "F":
                    live.add((a.mb, a.chunk))
                    edge += a.chunk == edge_chunk
                    best = max(best, (len(live), edge))
                elif a.kind in ("B", "W") and (a.mb, a.chunk) in live:
                    live.discard((a.mb, a.chunk))
                    edge -= a.chunk == edge_chunk
            _STASH[key] = best
    return _STASH[key]


def megatron_layer(model: Model, L: Layout, settings: Settings, stage: str) -> tuple:
    """(bytes stored per layer, the layer rebuilt in backward, embedding / head per
    micro-batch): Korthikanti et al.'s Table 2 for Megatron-LM's 16-bit layers, which are
    GPT-2's (a GELU MLP). A gated layer by the same accounting with fused attention (no s^2
    term, the log-sum-exp) and no dropout: the norms' inputs 4sbh, q, k, v 2sb w (w: q|k|v's
    width), attention's output 2sb d (d: heads x head size), the MLP's input 2sbh, its gate|up
    4sbf and their product 2sbf."""
    s, h, a, t, b = model.seq, model.hidden, model.heads, L.tp, L.micro_batch
    if model.anatomy.gated:               # bytes per token: split over TP, or whole
        inner = 2 * model.anatomy.attention.width + 2 * model.attention_width + \
            6 * model.mlp_width + 4 * a
        whole = 8 * h                     # the norms' and the column-parallel inputs
        full = s * b * ((whole + inner) / t if L.sp else whole + inner / t)
    else:
        full = s * b * h * ((34 / t) if L.sp else (10 + 24 / t)) + \
            5 * a * s * s * b / t * bool(settings.attention_probs)    # (flash: none kept)
    if L.recompute:
        stored, rebuilt = 2 * s * b * h / (t if L.sp else 1), full
    else:
        stored, rebuilt = full, 0.0
    ends = 4 * s * b * model.vocab_rows(t) * 2 if stage == "last" else 0.0  # fp32 logits, grad
    return stored, rebuilt, ends


def hpcdist_layer(model: Model, L: Layout, settings: Settings, stage: str) -> tuple:
    """The same three for hpcdist's layers, tensor by tensor, from the family's declaration
    (``Model.anatomy``). Every op's output stays with the graph until backward, and some ops
    keep more (a LayerNorm its mean and 1/std, an RMSNorm its 1/std; the twins x-hat and
    GELU's tanh: ``fused_kernels`` drops those); tiled attention keeps no (s, s)
    (``attention_probs``: the GPU's ``--attention gemms`` does). Per layer, in elements (n =
    b s tokens of the micro-batch; w: q|k|v's width, rotated q and k kept beside it in a
    rotary family: 2w; d: attention's output, heads x head size; the MLP's hidden
    activations m: GELU's pre-activation and output 2f, a gated MLP's gate|up and product 3f):

    - no TP: two norms' outputs 2nh, q|k|v nw, attention's output nd (and log-sum-exp an),
      each projection with the residual added in place nh, the MLP's mn: GPT-2's 16nh;
    - TP t (parallel/tp/model.py): the column-parallel outputs split (w, d, m over t, each
      bias added in place), each row-parallel output whole three times (the partial sums,
      the allreduced result, the residual added) and once more with a bias (added apart),
      the norms whole;
    - and sequence parallel: the two allgathered inputs and the two row-parallel partial
      sums whole, the rest split (the reduce-scattered output twice, and the bias).

    Full recompute keeps each block's output (nh, or nh/t with SP) and rebuilds one layer.
    First stage: the token vectors (TP: the masked rows, the reduced sum; SP:
    reduce-scattered), scaled where the family scales them, a learned position table's rows
    and their sum. Last: the final norm, the logits, the cross-entropy's (TP: its shifted
    logits' exponentials too), its per-token vectors."""
    s, h, a, t, b = model.seq, model.hidden, model.heads, L.tp, L.micro_batch
    n, ab, an = b * s, settings.param_bytes, model.anatomy
    scores = (b * a * s * s * bool(settings.attention_probs) + n * a) / t   # (s, s) and lse
    split = t if t > 1 and L.sp else 1
    qkv = an.attention.width * (2 if an.rotary else 1)
    hidden = 3 * model.mlp_width if an.gated else 2 * model.mlp_width
    tanh = 0 if settings.fused_kernels or an.gated else model.mlp_width   # (GELU's twin)
    inner = (qkv + model.attention_width + hidden + tanh) * n / t        # split over TP
    biases = int(an.out_bias) + int(an.mlp_bias)        # row outputs with a bias added apart
    if t == 1:
        rows = 2 * n * h                                # projection + residual, in place
    elif not L.sp:
        rows = (2 * 3 + biases) * n * h
    else:                                   # (and the two allgathered inputs, whole)
        rows = 4 * n * h + (2 * 2 + biases) * n * h / t
    full = (2 * n * h / split + inner + rows + scores) * ab + 2 * _norm_keeps(model, n / split,
                                                                             settings)
    act = n * h / split * ab                    # one activation between layers
    # full recompute: the block's output kept, and in backward the rebuilt block beside the
    # gradient arriving at it
    stored, rebuilt = (act, full + act) if L.recompute else (full, 0.0)
    if L.pp > 1:                                # the gradient received, the output being sent
        rebuilt += 2 * act
    return stored, rebuilt, _ends(model, L, settings, stage, split, act)


def _norm_keeps(model: Model, rows: float, settings: Settings) -> float:
    """Bytes a norm over ``rows`` rows keeps beyond its output: a LayerNorm its mean and
    1/std (fp32), an RMSNorm its 1/std (the activations' type), and unfused (the twins) the
    normalised input x-hat (a LayerNorm's in fp32 at least)."""
    ab, h = settings.param_bytes, model.hidden
    if model.anatomy.norm == "layernorm":
        xhat = 0 if settings.fused_kernels else max(ab, 4)
        return rows * h * xhat + 2 * rows * 4
    return rows * ab + (0 if settings.fused_kernels else rows * h * ab)


def _ends(model: Model, L: Layout, settings: Settings, stage: str, split: int,
          act: float) -> float:
    """``hpcdist_layer``'s embedding (first stage) or head (last) per micro-batch."""
    s, h, t, b = model.seq, model.hidden, L.tp, L.micro_batch
    n, ab, an = b * s, settings.param_bytes, model.anatomy
    Vt = model.vocab_rows(t)
    if stage == "first":
        tokens = n * h if t == 1 else 3 * n * h + n if not L.sp else 2 * n * h + n + n * h / t
        more = int(an.scaled_embeddings) * n * h / split      # the scaled token vectors
        if not an.rotary:                                     # the positions' rows, the sum
            more += (n * h + s * h) / split
        return (tokens + more) * ab + 2 * n * 8               # the batch's tokens, targets
    norm = n / split * h * ab + _norm_keeps(model, n / split, settings)
    if t == 1:                              # the fused cross-entropy keeps the logits
        logits, per_token = n * Vt * ab, n * (ab + 8)     # and lse; the targets
    else:
        logits, per_token = n * Vt * 3 * ab + (n * h * ab if L.sp else 0), n * 21
    return norm + logits + per_token + (act if L.pp > 1 else 0)


def zero_level(level: int):
    """What ZeRO ``level`` splits and moves, as its class declares it (the ``ZeroShape`` its
    class inherits: parallel/capabilities.py; 0: plain data parallelism)."""
    from ..parallel.capabilities import ZERO_SHAPES
    return ZERO_SHAPES[level]
