"""Mixture of experts: a router sends each token to ``k`` of ``E`` expert MLPs.

    x (N, C) --router--> scores (N, E) --top-k--> (expert, gate) per token and slot
      --sort by expert--> each expert's tokens in one GEMM pair --gate, add back--> (N, C)

Routers: softmax (GShard/Switch) or sigmoid with a selection-only bias (DeepSeek-V3).
Balancing: the Switch auxiliary loss, the bias update, an optional z-loss. Capacity: an
expert keeps its first ``ceil(tokens x k x factor / E)`` assignments in global token order;
dropless by default. Expert parallelism (parallel/expert.py) keeps a rank's share of the
experts and moves the tokens through ``exchange``. The rest: docs/moe.md.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..device import backend, fp8
from ..autograd import ops
from ..autograd.recompute import recomputing
from ..autograd.tensor import Tensor
from .layers import MLP, Dropout, Linear
from .module import Module, ModuleList

SCORES = ("softmax", "sigmoid")
_AUX_SCALE = [1.0]      # what the loss is multiplied by before backward (loss scale x weight)


@contextlib.contextmanager
def loss_multiplier(value: float):
    """The multiplier the step puts on the loss before backward (loss scaling, micro-batch
    weight): the auxiliary losses' gradients, injected at each MoE layer, get it too."""
    prev, _AUX_SCALE[0] = _AUX_SCALE[0], float(value)
    try:
        yield
    finally:
        _AUX_SCALE[0] = prev


def _with_aux(out: Tensor, aux: Tensor | None, coef: float) -> Tensor:
    """``out`` unchanged forward; in backward, ``aux`` gets the gradient ``coef`` times the
    step's loss multiplier, as if ``coef * aux`` were added to the loss (Megatron's
    auxiliary-loss auto-scaler: works under recomputation and across pipeline stages)."""
    if aux is None or not coef:
        return out
    xp = backend.array_module(out.data)

    def backward(g):
        return g, xp.full(aux.shape, coef * _AUX_SCALE[0], dtype=aux.data.dtype)
    return Tensor._make(out.data, (out, aux), backward)


def moe_settings(cfg) -> dict:
    """A family config's mixture-of-experts settings as MoE's keywords."""
    return dict(top_k=cfg.top_k, score=cfg.router, shared=cfg.shared_experts,
                normalize=getattr(cfg, "norm_topk", True),   # (GPT's: always)
                capacity_factor=cfg.capacity_factor, aux_loss_coef=cfg.aux_loss_coef,
                z_loss_coef=cfg.z_loss_coef, balance=cfg.balance, bias_rate=cfg.bias_rate)


class MoE(Module):
    """E expert MLPs (C -> H -> C: GELU, or what ``expert()`` makes — Mixtral's SwiGLU) behind
    a top-k router, with ``shared`` always-on expert MLPs beside them. ``forward(x,
    residual)`` -> residual + the mixture, like MLP."""

    def __init__(self, C: int, H: int, experts: int, *, top_k: int = 2, score: str = "softmax",
                 shared: int = 0, capacity_factor: float = 0.0, aux_loss_coef: float = 0.01,
                 z_loss_coef: float = 0.0, balance: str = "aux", bias_rate: float = 1e-3,
                 bias: bool = True, std: float = 0.02, proj_std: float = 0.02,
                 dropout: float = 0.0, expert=None, normalize: bool = True):
        """``normalize``: the chosen experts' softmax gates renormalised to sum to 1
        (Mixtral; Qwen3-MoE's ``norm_topk_prob``), else the softmax's own values."""
        if score not in SCORES:
            raise ValueError(f"unknown router score {score!r}: one of {SCORES}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"--top-k {top_k} must be between 1 and the {experts} experts")
        self.E, self.k, self.score, self.normalize = experts, top_k, score, normalize
        self.capacity_factor, self.aux_coef, self.z_coef = capacity_factor, aux_loss_coef, \
            z_loss_coef
        self.balance, self.bias_rate = balance, bias_rate
        self.router = Linear(C, experts, bias=False, std=std)
        expert = expert or (lambda: MLP([C, H, C], "gelu", 0.0, bias, std, proj_std))
        self.experts = ModuleList([expert() for _ in range(experts)])
        self.shared = ModuleList([expert() for _ in range(shared)])
        self.drop = Dropout(dropout)
        self.expert_bias = np.zeros(experts)      # selection only (balance "bias"), host
        self.first = 0                            # the global index of experts[0] (EP)
        self.exchange = None                      # EP: parallel/expert.py's ExpertExchange
        self.group = None                         # the ranks that read other tokens (DP)
        self.averaged = 1                         # ... of which the gradients are averaged
                                                  # over (the rest, TP under SP: summed)
        self.load = np.zeros(experts)             # assignments per expert since the last step
        self.dropped = 0                          # assignments dropped since the last step

    @property
    def expert_size(self) -> int:
        """Parameters of one expert (all are alike)."""
        return sum(p.size for p in self.experts[0].parameters()) if len(self.experts) else 0

    # ---- routing ---------------------------------------------------------------------------
    def route(self, x2: Tensor):
        """Scores (N, E) with their graph, and the chosen (N, k) experts (host-free: device).
        A 2-byte float's router logits are scored in float32 (Megatron's fp32 router): the
        choice and the balancing losses keep float32's resolution (and CuPy sorts no bf16)."""
        with fp8.kept_out():                  # (--precision fp8: the router in bf16)
            logits = self.router(x2)
        if logits.data.dtype.itemsize < 4:
            logits = ops.cast(logits, np.float32)
        probs = ops.softmax(logits, axis=-1) if self.score == "softmax" else \
            ops.sigmoid(logits)
        xp = backend.array_module(logits.data)
        pick = probs.data if self.score == "softmax" or self.balance != "bias" else \
            probs.data + xp.asarray(self.expert_bias, dtype=probs.data.dtype)
        # top-k, ties to the lower index (stable): the same choice on every rank and device
        chosen = xp.argsort(-pick, axis=-1, kind="stable")[:, :self.k]
        return logits, probs, chosen

    def gates(self, probs: Tensor, chosen):
        """(N, k) weights of the chosen experts."""
        xp = backend.array_module(probs.data)
        rows = xp.arange(probs.shape[0])[:, None]
        g = probs[rows, chosen]
        if (self.k > 1 and self.normalize) or self.score == "sigmoid":
            g = g / g.sum(axis=-1, keepdims=True)
        return g

    def capacity(self, tokens: int) -> int:
        """Assignments an expert keeps of ``tokens`` (every rank's that share the experts)."""
        if self.capacity_factor <= 0:
            return tokens * self.k                       # dropless: all of them
        return math.ceil(tokens * self.k * self.capacity_factor / self.E)

    def aux_loss(self, probs: Tensor, counts) -> Tensor:
        """Switch's load-balancing loss on this rank: E * sum_e f_e * mean_local(P_e), f_e the
        share of assignments over the group (1.0 under perfectly balanced routing)."""
        f = counts / max(counts.sum(), 1.0)
        xp = backend.array_module(probs.data)
        return (probs.mean(axis=0) * Tensor(xp.asarray(f * self.E, dtype=probs.data.dtype))
                ).sum()

    # ---- the layer -----------------------------------------------------------------------
    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        shape = x.shape
        C = shape[-1]
        self._T = shape[1] if len(shape) == 3 else 1
        x2 = x.reshape(-1, C)
        N = x2.shape[0]
        logits, probs, chosen = self.route(x2)
        expert = chosen.reshape(-1)                                  # (N k,) per assignment
        per = np.bincount(backend.to_numpy(expert), minlength=self.E)   # this rank's, per expert
        counts = per.astype(np.float64)
        if self.training:
            if self.group is not None and self.group.size > 1:       # every rank's tokens
                counts = self.group.allreduce(counts)
            if not recomputing():                 # (a recomputed block counted already)
                self.load += counts
        gate = ops.cast(self.gates(probs, chosen).reshape(-1), x2.data.dtype)   # (N k,)
        # the shared experts run while the routed tokens travel (under EP: the dispatch's
        # all-to-all is in flight meanwhile, parallel/expert.py)
        y, shared = self._dispatch(x2, expert, per, gate, N,
                                   lambda: [mlp(x2) for mlp in self.shared])
        for s in shared:
            y = y + s
        aux = None
        # a mean over this rank's tokens, weighted by its share of the group's: the average
        # over ``averaged`` ranks of the gradients (summed over the rest) is then the one over
        # all the group's tokens (context-parallel slices of an odd length differ in size;
        # data-parallel replicas' are alike: 1)
        share = 1.0
        if self.training and self.group is not None and self.group.size > 1 and counts.sum():
            share = float(per.sum()) * self.averaged / float(counts.sum())
        if self.training and self.balance == "aux" and self.aux_coef:
            aux = self.aux_loss(probs, counts) * (self.aux_coef * share)
        if self.training and self.z_coef:
            z = ops.log(ops.exp(logits).sum(axis=-1))
            z = (z * z).mean() * (self.z_coef * share)
            aux = z if aux is None else aux + z
        y = self.drop(_with_aux(y, aux, 1.0).reshape(*shape))
        return y if residual is None else residual + y

    def _dispatch(self, x2: Tensor, expert, per, gate: Tensor, N: int, meanwhile):
        """Every assignment through its expert (``per[e]`` of them to expert e), weighted by
        its gate, added back per token; and what ``meanwhile()`` returns, run while the
        tokens are on their way (EP) or before the experts (without)."""
        xp = backend.array_module(x2.data)
        order = xp.argsort(expert, kind="stable")        # assignment t k + j, by expert
        inv = xp.empty_like(order)
        inv[order] = xp.arange(order.size)               # where each assignment went
        xs = ops.moe_permute(x2, order, inv, self.k)     # (N k, C) sorted, token order
        keys = self.order_keys(order // self.k)
        if self.exchange is not None:                                # expert parallelism
            ys, kept, side = self.exchange(self, xs, per, keys, N, meanwhile)
        else:
            side = meanwhile()
            ys, kept = self.run_experts(xs, per, keys, N)
        w = gate[order] * Tensor(kept.astype(x2.data.dtype))
        return ops.moe_combine(ys, w, order, inv, self.k), side

    def order_keys(self, token):
        """Each assignment's place in global token order (capacity drops by it): this rank's
        token n is global token (n // T x W + rank) x T + n % T for W ranks reading batches
        (the sampler deals examples round-robin); T is the layer's sequence length."""
        if self.group is None or self.group.size == 1:
            return token
        T, W = self._T, self.group.size
        return (token // T * W + self.group.rank) * T + token % T

    def run_experts(self, xs: Tensor, per, keys, tokens: int):
        """This rank's experts over their rows of ``xs`` (sorted by expert: ``per`` rows
        each, ``keys`` their global token order) for ``tokens`` tokens in all; (outputs, 0/1
        kept per row: past an expert's capacity the latest in token order are dropped)."""
        xp = backend.array_module(xs.data)
        kept = xp.ones(xs.shape[0], dtype=bool)
        cap = self.capacity(tokens)
        pieces, at = [], 0
        for e, n in enumerate(per):
            n = int(n)
            if n > cap:                               # keep the first ``cap`` by token order
                rank_in = xp.argsort(xp.argsort(keys[at:at + n], kind="stable"), kind="stable")
                kept[at:at + n] = rank_in < cap
                if self.training and not recomputing():
                    self.dropped += n - cap
            at += n
        sizes = [int(n) for n in per]
        for e, piece in enumerate(ops.split(xs, sizes, axis=0) if len(sizes) > 1 else [xs]):
            pieces.append(self.experts[e](piece) if sizes[e] else piece)
        return (ops.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]), kept


def moe_layers(model) -> list:
    """The MoE layers of ``model``, in its order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def held_experts(model) -> set:
    """ids of the expert parameters this rank alone holds of its EP group (the MoE layers
    cut by parallel/expert.py; empty without expert parallelism)."""
    return {id(p) for m in moe_layers(model) if m.exchange is not None
            for p in m.experts.parameters()}


def after_step(model, applied: bool) -> dict:
    """After an optimizer step, for every MoE layer of ``model``: the balancing bias moves
    (``balance="bias"``, when the step was applied: ``b += rate * sign(mean load - load)``,
    the load agreed over the ranks, so every rank moves alike) and the step's load and
    drops are read and reset. Returns {} without MoE layers, else {"moe_load": the largest
    max/mean load over experts of any layer, "moe_dropped": assignments dropped}."""
    layers = moe_layers(model) if model is not None else []
    if not layers:
        return {}
    worst = 0.0
    dropped = np.array([float(sum(m.dropped for m in layers))])
    group = layers[0].group                  # drops happen where the experts are: add up
    if group is not None and group.size > 1:
        dropped = group.allreduce(dropped)
    for m in layers:
        if m.load.sum():
            worst = max(worst, float(m.load.max() / m.load.mean()))
        if applied and m.balance == "bias":
            m.expert_bias += m.bias_rate * np.sign(m.load.mean() - m.load)
        m.load[...] = 0
        m.dropped = 0
    return {"moe_load": worst, "moe_dropped": int(dropped[0])}


def balance_bias(model) -> list:
    """Every MoE layer's balancing bias (host lists, in the model's order; [] when no layer
    balances by bias): a checkpoint keeps them."""
    layers = moe_layers(model)
    if not any(m.balance == "bias" for m in layers):
        return []
    return [m.expert_bias.tolist() for m in layers]


def load_balance_bias(model, saved: list) -> None:
    layers = moe_layers(model)
    if len(saved) != len(layers):
        raise ValueError(f"the checkpoint holds {len(saved)} MoE layers' biases, the model "
                         f"has {len(layers)} MoE layers")
    for m, b in zip(layers, saved):
        m.expert_bias[...] = b
