"""The attention kinds the newest families declare, beside the plain causal softmax: a softmax
scale of their own (Gemma 2's query_pre_attn_scalar), logit soft-capping (cap tanh(s / cap)),
a window (a query sees itself and window - 1 keys before it) and learned sinks (gpt-oss: a
logit per head in the softmax's denominator that holds no value). Capped or windowed scores
run in the tiled twin (flash.py: no T x T array; a window's block reads only its keys); the
sinks enter once, after any kernel, as a merge of one more term into the log-sum-exp: a
kernel's (y0, lse0) becomes y0 exp(lse0 - lse), lse = logaddexp(lse0, sink), and its backward
given that lse and y is already exact (p and rowsum(dy y) are the whole softmax's); the sink's
own gradient is -sum_i exp(sink - lse_i) rowsum(dy y)_i."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import backend


@dataclass(frozen=True)
class Scores:
    """How one layer's attention makes its probabilities: ``scale`` (None: 1 / sqrt(head
    size)), ``cap`` (0: none), ``window`` (0: every earlier key), ``sinks`` (a learned logit
    per query head)."""
    scale: float | None = None
    cap: float = 0.0
    window: int = 0
    sinks: bool = False

    def __post_init__(self):
        if self.cap < 0 or self.window < 0:
            raise ValueError(f"an attention cap and window are 0 (none) or more, got cap "
                             f"{self.cap}, window {self.window}")

    @property
    def tiled_kernels_take(self) -> bool:
        """The flash kernels (CPU numba + BLAS, CUDA, cuDNN) compute these scores: no cap,
        no window (sinks and a scale they take: the sinks are merged after them)."""
        return not self.cap and not self.window

    def within(self, T: int) -> "Scores":
        """These scores over T positions: a window of T or more masks nothing, so it is
        dropped (the flash kernels then take the rest)."""
        return replace(self, window=0) if self.window >= T else self

    def softmax_scale(self, head_size: int) -> float:
        return self.scale if self.scale is not None else 1.0 / head_size ** 0.5


PLAIN = Scores()


def with_sinks(y, lse, sinks):
    """(y, lse) with one more term per query head in the softmax's denominator, exp(sink_h),
    that adds nothing to y: y (B, T, nh hs), lse (B, nh, T), sinks (nh,)."""
    xp = backend.array_module(y)
    B, T, W = y.shape
    nh = lse.shape[1]
    s = sinks.astype(lse.dtype)[None, :, None]
    merged = xp.logaddexp(lse, s)
    keep = xp.exp(lse - merged)                                        # (B, nh, T)
    out = y.reshape(B, T, nh, W // nh) * keep.transpose(0, 2, 1)[..., None].astype(y.dtype)
    return out.reshape(B, T, W), merged


def sink_grad(y, dy, lse, sinks):
    """d loss / d sinks (nh,) given the merged ``lse`` and the final ``y``."""
    B, T, W = y.shape
    nh = lse.shape[1]
    ct = np.float64 if y.dtype == np.float64 else np.float32
    D = (dy.astype(ct).reshape(B, T, nh, W // nh) *
         y.astype(ct).reshape(B, T, nh, W // nh)).sum(axis=-1)        # (B, T, nh)
    p = backend.array_module(y).exp(sinks.astype(ct)[None, :, None] - lse.astype(ct))
    return -(p * D.transpose(0, 2, 1)).sum(axis=(0, 2)).astype(sinks.dtype)
