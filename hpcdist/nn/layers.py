"""Layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout, MLP, the gated MLP (SwiGLU, GeGLU)."""
from __future__ import annotations

import math

from ..autograd import ops
from .module import (Module, ModuleList, Parameter, Shard, init_normal, init_uniform, pad_axis,
                     padded_length)
from .placement import HIDDEN
from ..autograd.tensor import Tensor


class Linear(Module):
    """``y = x @ weight + bias`` with weight stored (in_features, out_features).

    Default init is PyTorch's U(-1/sqrt(in), 1/sqrt(in)); pass ``std`` for N(0, std) (GPT-2).
    ``lora``: a LoRA adapter whose update is added to the output (nn/lora.py).
    """

    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 std: float | None = None, multiple: int = 1, *, over: str = HIDDEN):
        """``multiple``: outputs padded with zero columns to a multiple of it (an LM head over
        a vocabulary rounded up to an aligned width; no bias then). ``over``: what the layer
        is applied to (nn/placement.py; tensor parallelism swaps the projections a family
        declares for layers of their own)."""
        self.placements = {"weight": over, "bias": over}
        bound = 1.0 / math.sqrt(in_features)
        w = init_normal((in_features, out_features), std) if std is not None else \
            init_uniform((in_features, out_features), bound)
        if multiple > 1:
            if bias:
                raise ValueError("a padded Linear (multiple > 1) takes no bias")
            w = pad_axis(w, 1, padded_length(out_features, multiple))
            self.shard_spec = {"weight": Shard(1, 1, (in_features, out_features), multiple,
                                               whole=True)}
        self.weight = Parameter(w)
        if bias:
            b = init_uniform((out_features,), bound) if std is None else \
                init_normal((out_features,), 0.0)
            self.bias = Parameter(b)
        else:
            self.bias = None

    def forward(self, x: Tensor, residual: Tensor | None = None, norm=None):
        """``residual``: added to the output with the bias, in one pass; ``norm``: a
        LayerNorm or RMSNorm of the result too, in the same pass (returns both)."""
        if self.lora is not None:                   # + the adapter's low-rank update
            y = ops.linear(x, self.weight, self.bias, residual) + self.lora(x)
            return y if norm is None else (y, norm(y))
        if norm is not None:
            return ops.linear_norm(x, self.weight, self.bias, residual, norm)
        return ops.linear(x, self.weight, self.bias, residual)

    def gelu(self, x: Tensor) -> Tensor:
        """gelu(x @ weight + bias): the bias and the GELU in one pass after the GEMM."""
        if self.bias is not None and x.ndim >= 2 and self.lora is None:
            return ops.linear_gelu(x, self.weight, self.bias)
        return ops.gelu(self(x))


class Embedding(Module):
    """Rows of a (num_embeddings, dim) table picked by integer indices. ``multiple``: the
    table padded with zero rows to a multiple of it (a vocabulary rounded up so that a head
    tied to it is GEMM-aligned: 50,257 -> 50,304 at 64); the padding is never looked up, is
    left out of the loss (``LMLoss``) and out of checkpoints (``shard_spec``)."""

    def __init__(self, num_embeddings: int, dim: int, std: float = 1.0, multiple: int = 1):
        self.placements = {"weight": HIDDEN}    # (its rows are the residual stream's start)
        w = init_normal((num_embeddings, dim), std)      # (the logical rows' draws first)
        if multiple > 1:
            w = pad_axis(w, 0, padded_length(num_embeddings, multiple))
            self.shard_spec = {"weight": Shard(0, 1, (num_embeddings, dim), multiple,
                                               whole=True)}
        self.weight = Parameter(w)

    def forward(self, idx) -> Tensor:
        return ops.embedding(self.weight, idx)

    def attend(self, x: Tensor) -> Tensor:
        """x @ table.T: scores of x against every row (a head tied to this table)."""
        return ops.attend(x, self.weight)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, over: str = HIDDEN):
        """``over``: what the norm is applied to (nn/placement.py)."""
        from ..device import backend
        self.placements = {"weight": over, "bias": over}
        xp = backend.xp()
        self.weight = Parameter(xp.ones(dim, dtype=backend.default_float()))
        self.bias = Parameter(xp.zeros(dim, dtype=backend.default_float())) if bias else None
        self.eps = eps

    def forward(self, x: Tensor, fuse=None) -> Tensor:
        """``fuse``: a projection's (bias, residual) to add into x first (ops.linear_norm)."""
        return ops.layer_norm(x, self.weight, self.bias, self.eps, fuse=fuse)


def active(drop) -> bool:
    """Whether a Dropout module drops anything now."""
    return bool(drop.p) and drop.training


class Dropout(Module):
    def __init__(self, p: float = 0.0):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return ops.dropout(x, self.p, self.training)


_ACTIVATIONS = {"relu": ops.relu, "gelu": ops.gelu, "tanh": ops.tanh, "sigmoid": ops.sigmoid}


class MLP(Module):
    """Linear layers with an activation between them: sizes [784, 128, 10] -> 2 layers.

    ``proj_std`` sets the init std of the last layer (GPT-2 scales residual projections).
    """

    def __init__(self, sizes, activation: str = "relu", dropout: float = 0.0, bias: bool = True,
                 std: float | None = None, proj_std: float | None = None):
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got {sizes}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: one of {sorted(_ACTIVATIONS)}")
        n = len(sizes) - 1
        self.layers = ModuleList([
            Linear(sizes[i], sizes[i + 1], bias=bias,
                   std=proj_std if (i == n - 1 and proj_std is not None) else std)
            for i in range(n)])
        self.act = _ACTIVATIONS[activation]
        self.drop = Dropout(dropout)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """``residual``: added to the output (with the last layer's bias, in one pass)."""
        n = len(self.layers)
        for layer in list(self.layers)[:-1]:
            x = layer.gelu(x) if self.act is ops.gelu else self.act(layer(x))
        last = self.layers[n - 1]
        if residual is not None and not (self.drop.p and self.drop.training):
            return last(x, residual)                     # + residual with the bias: one pass
        x = self.drop(last(x))
        return x if residual is None else residual + x


class RMSNorm(Module):
    """x / rms(x) * (offset + weight): Llama's (offset 0, weight starting at 1) or Gemma's
    (offset 1, weight starting at 0, as its checkpoints store it). ``over``: what it
    normalises (nn/placement.py): the hidden vector, or each attention head (Qwen3's q and k
    norms: ``HEADS``)."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0, *,
                 over: str = HIDDEN):
        from ..device import backend
        self.placements = {"weight": over}
        xp = backend.xp()
        start = xp.zeros if offset else xp.ones
        self.weight = Parameter(start(dim, dtype=backend.default_float()))
        self.eps, self.offset = eps, offset

    def forward(self, x: Tensor, fuse=None) -> Tensor:
        """``fuse``: a projection's (bias, residual) to add into x first (ops.linear_norm)."""
        scale = self.weight + self.offset if self.offset else self.weight
        return ops.rms_norm(x, scale, self.eps, fuse=fuse)


_GATES = {"silu": ops.swiglu, "gelu_tanh": ops.geglu}


class SwiGLU(Module):
    """down(act(x gate) * (x up)), gate and up one fused projection [gate | up]; ``act``
    silu (SwiGLU) or the tanh GELU (GeGLU)."""

    def __init__(self, C: int, H: int, bias: bool = False, std: float = 0.02,
                 proj_std: float = 0.02, dropout: float = 0.0, *, activation: str = "silu"):
        self.gate_up = Linear(C, 2 * H, bias=bias, std=std)
        self.down = Linear(H, C, bias=bias, std=proj_std)
        self.drop = Dropout(dropout)
        self.gate = _GATES[activation]

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        h = self.gate(self.gate_up(x))
        if residual is not None and not active(self.drop):
            return self.down(h, residual)
        out = self.drop(self.down(h))
        return out if residual is None else residual + out
