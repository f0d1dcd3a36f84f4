"""The attention between the projections, shared by every family: the fused q|k|v (its shape
an ``AttentionShape``: grouped-query attention reads each kv head for its group, never a
repeated copy), rotary position embeddings applied to q and k at each token's global
position, then causal attention — one fused op (tiled, ops.fused_attention), or op by op
where the probabilities take dropout or a KV cache holds the past keys and values (only the
kv heads). A module of its own so that a parallel version (parallel/context.py: each rank a
slice of the sequence) takes its place."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..autograd import ops
from ..autograd.tensor import Tensor
from ..device import backend, kernels
from ..device.kernels.attention_kinds import PLAIN, Scores
from .family import AttentionShape
from .layers import Dropout, active
from .packing import Packing
from .module import Module, Parameter
from .placement import HEADS


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (RoFormer; Llama's half-split layout): q and k's pairs
    (i, i + hd/2) rotated by position x frequency i, theta^(-2i/hd)."""
    theta: float = 10000.0

    def magnitude(self) -> float:
        """What cos and sin are scaled by (YaRN's attention factor; 1 elsewhere)."""
        return 1.0

    def frequencies(self, hd: int, xp):
        """The hd/2 frequencies (float64, made on ``xp``'s device: nothing crosses from the
        host inside a step, which a CUDA graph's capture refuses)."""
        return 1.0 / (self.theta ** (xp.arange(0, hd, 2, dtype="float64") / hd))


@dataclass(frozen=True)
class Llama3Rotary(Rotary):
    """Llama 3.1's long-context rotary frequencies (the Llama 3 paper; transformers'
    ``rope_type: llama3``): wavelengths longer than original_context / low_freq_factor are
    slowed ``factor`` times, those shorter than original_context / high_freq_factor kept, and
    the band between blended by where the wavelength falls in it."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def frequencies(self, hd: int, xp):
        inv = super().frequencies(hd, xp)
        wavelength = 2 * math.pi / inv
        long_, short = (self.original_context / self.low_freq_factor,
                        self.original_context / self.high_freq_factor)
        smooth = (self.original_context / wavelength - self.low_freq_factor) / \
            (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv / self.factor + smooth * inv
        out = xp.where(wavelength > long_, inv / self.factor, inv)
        middle = (wavelength >= short) & (wavelength <= long_)
        return xp.where(middle, blended, out)


@dataclass(frozen=True)
class YarnRotary(Rotary):
    """YaRN (arXiv:2309.00071; transformers' ``rope_type: yarn``, gpt-oss's and Qwen's long
    contexts): the dimensions turning fewer than beta_slow times in the original context
    are slowed ``factor`` times, those turning more than beta_fast kept, a linear ramp
    between (its ends rounded out to whole dimensions where ``truncate``); cos and sin
    scaled by the attention factor (default 0.1 ln(factor) + 1), so the scores by its
    square."""
    factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_context: int = 4096
    attention_factor: float = 0.0
    truncate: bool = True

    def magnitude(self) -> float:
        if self.attention_factor:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def frequencies(self, hd: int, xp):
        inv = super().frequencies(hd, xp)

        def dimension(turns):           # the dimension turning ``turns`` times in the context
            return hd * math.log(self.original_context / (turns * 2 * math.pi)) / \
                (2 * math.log(self.theta))
        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        high = high + 0.001 if high == low else high
        slowed = xp.clip((xp.arange(hd // 2, dtype="float64") - low) / (high - low), 0, 1)
        return inv / self.factor * slowed + inv * (1 - slowed)


ROTARY_KINDS = {"default": Rotary, "llama3": Llama3Rotary, "yarn": YarnRotary}  # --rope-type


def rotary_of(cfg) -> Rotary:
    """The rotary kind a rotary family's config declares (``rope_type`` and the ``rope_*``
    settings); a kind or setting it cannot compute is refused."""
    if cfg.rope_type not in ROTARY_KINDS:
        raise ValueError(f"unknown rope_type {cfg.rope_type!r}: one of "
                         f"{', '.join(ROTARY_KINDS)}")
    if cfg.rope_type == "llama3":
        if not 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor:
            raise ValueError("llama3 rotary scaling needs 0 < rope_low_freq_factor < "
                             f"rope_high_freq_factor, got {cfg.rope_low_freq_factor} and "
                             f"{cfg.rope_high_freq_factor}")
        return Llama3Rotary(cfg.rope_theta, cfg.rope_factor, cfg.rope_low_freq_factor,
                            cfg.rope_high_freq_factor, cfg.rope_original_context)
    if cfg.rope_type == "yarn":
        if not 0 < cfg.rope_beta_slow < cfg.rope_beta_fast or cfg.rope_attention_factor < 0:
            raise ValueError("yarn rotary scaling needs 0 < rope_beta_slow < rope_beta_fast "
                             f"and an attention factor of 0 or more, got {cfg.rope_beta_slow}"
                             f", {cfg.rope_beta_fast}, {cfg.rope_attention_factor}")
        return YarnRotary(cfg.rope_theta, cfg.rope_factor, cfg.rope_beta_fast,
                          cfg.rope_beta_slow, cfg.rope_original_context,
                          cfg.rope_attention_factor)
    return Rotary(cfg.rope_theta)


class SelfAttention(Module):
    """(B, T, shape.width) -> (B, T, shape.out_width) over ``shape``'s heads, with dropout on
    the probabilities and, with ``rotary``, q and k rotated by their positions first.
    ``q_norm`` / ``k_norm``: the seam between the projections and the core, a module applied
    to each query / key head (B, T, heads, head_dim) before the rotation (Qwen3's per-head
    RMSNorm, declared ``over=HEADS``: under tensor parallelism each rank norms its own
    heads, and the norm's gradient is partial over the group). ``scores``: the layer's
    attention kind (device/kernels/attention_kinds.py: scale, soft-cap, window, sinks),
    which the training path, the KV cache and packed rows all honour; with sinks the layer
    owns ``sinks`` (n_head,), zeros to start."""

    def __init__(self, shape: AttentionShape, dropout: float = 0.0,
                 rotary: Rotary | None = None, window: int = 0, *, q_norm=None, k_norm=None,
                 scores: Scores = PLAIN):
        if window and scores.window and window != scores.window:
            raise ValueError(f"a layer of window {window} declared with scores of window "
                             f"{scores.window}")
        self.shape, self.rotary, self.window = shape, rotary, window or scores.window
        self.scores = scores
        self.attn_drop = Dropout(dropout)
        self.q_norm, self.k_norm = q_norm, k_norm
        if scores.sinks:
            self.placements = {"sinks": HEADS}
            self.sinks = Parameter(backend.xp().zeros(shape.n_head,
                                                      dtype=backend.default_float()))

    @property
    def n_head(self) -> int:
        return self.shape.n_head

    def forward(self, qkv: Tensor, pos=None, cache: dict | None = None) -> Tensor:
        """``pos``: the rows' global positions (rotary), or a packed batch's Packing (each
        document attended alone: nn/packing.py); ``cache``: this layer's KV cache (inference;
        see ``attention``)."""
        kind = (self.scores, getattr(self, "sinks", None))
        if isinstance(pos, Packing):
            return pos.attend(qkv, lambda part, p: attention(
                before_core(self, part, p), self.shape, self.attn_drop, None, self.window,
                kind))
        return attention(before_core(self, qkv, pos), self.shape, self.attn_drop, cache,
                         self.window, kind)


def before_core(core, qkv: Tensor, pos) -> Tensor:
    """What every attention core (this one, a context-parallel one) does to the fused q|k|v
    first: ``core.q_norm`` on each query head and ``core.k_norm`` on each key head (where
    declared), then the rotation by the rows' global positions ``pos``."""
    shape = core.shape
    if core.q_norm is not None or core.k_norm is not None:
        B, T, _ = qkv.shape
        q, k, v = ops.split(qkv, list(shape.pieces), axis=2)
        if core.q_norm is not None:
            q = core.q_norm(q.reshape(B, T, shape.n_head, shape.head_dim)).reshape(B, T, -1)
        if core.k_norm is not None:
            k = core.k_norm(k.reshape(B, T, shape.n_kv_head, shape.head_dim)).reshape(B, T, -1)
        qkv = ops.concat([q, k, v], axis=2)
    if core.rotary is not None:
        qkv = ops.rotary(qkv, pos, shape, core.rotary)
    return qkv


def attention(qkv: Tensor, shape: AttentionShape, drop, cache: dict | None = None,
              window: int = 0, kind=(PLAIN, None)) -> Tensor:
    """Causal self-attention of qkv (B, T, shape.width) -> (B, T, shape.out_width): the fused
    op unless the probabilities take dropout (then op by op, the (T, T) probabilities kept).
    ``cache`` (inference): the kv heads' keys and values of the tokens before these, extended
    with theirs; these rows attend through the tiled kernels by position (O(T) memory: a
    prompt as long as the context is one block). ``kind``: (the layer's Scores, its sinks
    Tensor or None)."""
    scores, sinks = kind
    if sinks is not None and sinks.shape[0] != shape.n_head:
        raise ValueError(f"attention sinks for {sinks.shape[0]} heads on a core of "
                         f"{shape.n_head}: tensor parallelism does not cut sinks with their "
                         "heads yet")
    if cache is not None:
        if active(drop):
            raise ValueError("a KV cache is for inference: call model.eval() first (dropout "
                             "is on)")
        return _cached(qkv, shape, cache, window, kind)
    if scores != PLAIN or sinks is not None:
        if active(drop):
            raise ValueError("dropout on the probabilities of a capped, windowed or sinked "
                             "attention: the tiled path has none (set --dropout 0)")
        return ops.fused_attention(qkv, shape.n_head, shape.n_kv_head, scores, sinks)
    if not active(drop):
        return ops.fused_attention(qkv, shape.n_head, shape.n_kv_head)
    B, T, _ = qkv.shape
    nkv, hd = shape.n_kv_head, shape.head_dim
    G = shape.n_head // nkv
    q, k, v = ops.split(qkv, list(shape.pieces), axis=2)
    q = q.reshape(B, T, nkv, G, hd).transpose(0, 2, 3, 1, 4)        # (B, nkv, G, T, hd)
    k = k.reshape(B, T, nkv, 1, hd).transpose(0, 2, 3, 4, 1)        # (B, nkv, 1, hd, T)
    v = v.reshape(B, T, nkv, 1, hd).transpose(0, 2, 3, 1, 4)        # (B, nkv, 1, T, hd)
    att = ops.causal_softmax(q @ k, 1.0 / math.sqrt(hd))            # (B, nkv, G, T, T)
    y = drop(att) @ v                                               # (B, nkv, G, T, hd)
    return y.transpose(0, 3, 1, 2, 4).reshape(B, T, shape.out_width)


def _cached(qkv: Tensor, shape: AttentionShape, cache: dict, window: int = 0,
            kind=(PLAIN, None)) -> Tensor:
    """The KV-cache step, inference only (no graph): keys and values kept in token layout
    (B, past + T, nkv hd), these rows (at positions past...) over all of them through the
    flash kernels' blocks (device/kernels/flash_blocks.py), the run's kind of arithmetic.
    ``window`` (sliding-window attention, Mistral's): a row sees itself and the window - 1
    keys before it; the cache keeps only those (one row a call once it is past the window:
    hpcdist.sample feeds a long prompt so)."""
    xp = backend.array_module(qkv.data)
    B, T, _ = qkv.shape
    q, k, v = (a.reshape(B, T, -1) for a in shape.views(qkv.data))
    past, held = 0, 0 if cache.get("k") is None else cache["k"].shape[1]
    if window and held + T > window and T > 1:
        raise ValueError(f"{held + T} rows past a sliding window of {window} in one call: "
                         "feed the rows past the window one at a time")
    if held:
        old_k, old_v = cache["k"], cache["v"]
        if window and held + T > window:           # (T is 1: the window's last keys stay)
            old_k, old_v = old_k[:, held - (window - 1):], old_v[:, held - (window - 1):]
        past = old_k.shape[1]
        k, v = xp.concatenate([old_k, k], axis=1), xp.concatenate([old_v, v], axis=1)
    else:
        k, v = xp.ascontiguousarray(k), xp.ascontiguousarray(v)
    cache["k"], cache["v"], cache["seen"] = k, v, cache.get("seen", held) + T
    arith, (scores, sinks) = kernels.attention.kind(qkv.dtype), kind
    q, scale = xp.ascontiguousarray(q), scores.softmax_scale(shape.head_dim)
    if scores.cap:                         # (the block kernels take no cap: their twin does)
        y, lse = kernels.block_twin(q, k, v, shape.n_head, shape.n_kv_head, scale, past, 0,
                                    kernels.flash.ROUNDING[arith], scores.cap)
    else:
        y, lse = kernels.FLASH_BLOCK_FWD[arith](q, k, v, shape.n_head, shape.n_kv_head,
                                                scale, past, 0)
    if sinks is not None:
        y, _ = kernels.attention_kinds.with_sinks(y, lse, sinks.data)
    return Tensor(y.astype(qkv.dtype, copy=False))
