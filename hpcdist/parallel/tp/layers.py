"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019), built from the mappings.

Each layer holds this rank's shard of one layer of the one logical model, and records how
its parameters were cut (``shard_spec``: parameter name -> (axis, pieces) or None for a
replicated parameter), so shards can be put back together (checkpoints, tests).

Under sequence parallelism (Korthikanti et al. 2022) the activations between the tensor-
parallel regions are split along the sequence: the input mapping of a column-parallel layer
is an allgather along the sequence (instead of copy), the output mapping of a row-parallel
layer a reduce-scatter along it (instead of allreduce), and LayerNorm, dropout and the biases
of row-parallel layers see only this rank's rows — so their gradients are partial and must be
summed over the tensor-parallel group (``sequence_parallel_params``).
"""
from __future__ import annotations

import numpy as np

from ...device import backend, fp8
from ...autograd import ops
from ...nn.module import Module, Parameter, Shard, pad_axis, padded_length
from ...nn.placement import HIDDEN, SHARDED
from ...autograd.tensor import Tensor
from .mappings import (copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp)


def piece_spec(widths: tuple):
    """A fused output's pieces as a Shard records them: their count where all are alike (the
    checkpoints of multi-head models keep their form), else their widths."""
    widths = tuple(int(w) for w in widths)
    return len(widths) if len(set(widths)) == 1 else widths


def piece_widths(total: int, pieces) -> list[int]:
    return [total // pieces] * pieces if isinstance(pieces, int) else [int(w) for w in pieces]


def column_pieces(total: int, pieces, rank: int, world: int) -> list[tuple[int, int]]:
    """Ranges of a dimension that holds ``pieces`` blocks side by side (q, k, v) which this
    rank takes: the rank-th of ``world`` equal parts of each block."""
    out, at = [], 0
    for width in piece_widths(total, pieces):
        part = width // world
        out.append((at + rank * part, at + (rank + 1) * part))
        at += width
    return out


def take(array, axis: int, ranges):
    """The given ranges of ``array`` along ``axis``, concatenated (a copy)."""
    xp = backend.array_module(array)
    sl = [slice(None)] * array.ndim
    parts = []
    for lo, hi in ranges:
        sl[axis] = slice(lo, hi)
        parts.append(array[tuple(sl)])
    return xp.ascontiguousarray(xp.concatenate(parts, axis=axis))


class ColumnParallelLinear(Module):
    """y_t = x @ W[:, cols_t] + b[cols_t]: output columns split. The input is replicated (its
    mapping is copy: backward allreduces dx) or, under sequence parallelism (``seq``: the
    model's parallel.sequence.Sequence), split along the sequence (allgather, backward
    reduce-scatter). ``logical``: the whole weight's shape where ``weight`` is padded.
    ``lora``: a LoRA adapter on this rank's columns (nn/lora.py)."""

    lora = None
    tp_kind = "column"          # (what an adapter on it reads: nn/lora.py)

    def __init__(self, weight, bias, comm, pieces=1, seq=None, logical=None, *, multiple=1):
        C_out = weight.shape[1]
        pieces = piece_spec(piece_widths(C_out, pieces))
        for width in piece_widths(C_out, pieces):
            if width % comm.size:
                raise ValueError(f"a column-parallel output of width {width} does not split "
                                 f"over a tensor-parallel group of {comm.size}")
        cols = column_pieces(C_out, pieces, comm.rank, comm.size)
        self.weight = Parameter(take(weight, 1, cols))
        self.bias = Parameter(take(bias, 0, cols)) if bias is not None else None
        self.comm, self.seq = comm, seq
        self.split = fp8.Split(comm, frozenset({"weight", "gradient"}))   # (fp8's scales)
        self.shard_spec = {"weight": Shard(1, pieces, logical or tuple(weight.shape),
                                           multiple),
                           "bias": Shard(0, pieces, (C_out,))}
        self.placements = {"weight": SHARDED, "bias": SHARDED}

    def _input(self, x: Tensor) -> Tensor:
        return gather_from_sp(x, self.seq.rows, self.comm) if self.seq is not None else \
            copy_to_tp(x, self.comm)

    def forward(self, x: Tensor) -> Tensor:
        x = self._input(x)
        y = ops.linear(x, self.weight, self.bias, split=self.split)
        return y if self.lora is None else y + self.lora(x)      # (this rank's columns)

    def gelu(self, x: Tensor) -> Tensor:
        """gelu(x @ W + b) of this rank's columns: the bias and the GELU in one pass."""
        if self.lora is not None:
            return ops.gelu(self(x))
        x = self._input(x)
        if self.bias is not None and x.ndim >= 2:
            return ops.linear_gelu(x, self.weight, self.bias, split=self.split)
        return ops.gelu(ops.linear(x, self.weight, self.bias, split=self.split))


class RowParallelLinear(Module):
    """y = sum_t x_t @ W[rows_t, :] + b: input features split (already, by the column-parallel
    layer before it); the partial products are allreduced (or reduce-scattered along the
    sequence); the bias is replicated and added after the reduction. ``lora``: a LoRA
    adapter whose partial product joins the reduction (nn/lora.py)."""

    lora = None
    tp_kind = "row"

    def __init__(self, weight, bias, comm, sequence_parallel=False):
        rows = column_pieces(weight.shape[0], 1, comm.rank, comm.size)
        self.weight = Parameter(take(weight, 0, rows))
        self.bias = Parameter(backend.array_module(bias).array(bias)) if bias is not None \
            else None
        self.comm, self.sp = comm, sequence_parallel
        self.split = fp8.Split(comm, frozenset({"input", "weight"}))       # (fp8's scales)
        self.shard_spec = {"weight": Shard(0, 1, tuple(weight.shape)), "bias": None}
        # the bias is added after the reduction: to the residual stream (whole rows without
        # sequence parallelism, this rank's rows with it)
        self.placements = {"weight": SHARDED, "bias": HIDDEN}

    def forward(self, x: Tensor, residual: Tensor | None = None, norm=None):
        """``residual``: added after the reduction, as the bias is; ``norm``: the result's
        norm too (returns both; a pass of its own)."""
        y = ops.linear(x, self.weight, split=self.split)
        if self.lora is not None:                     # its partial sum, reduced with ours
            y = y + self.lora(x)
        y = reduce_scatter_to_sp(y, self.comm) if self.sp else reduce_from_tp(y, self.comm)
        y = y + self.bias if self.bias is not None else y
        y = y if residual is None else residual + y
        return y if norm is None else (y, norm(y))


def padded_vocab(V: int, world: int, multiple: int = 1) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size times ``multiple``
    (Megatron's make-vocab-size-divisible-by x TP: each rank's part aligned; the padded rows
    are zero, never looked up, and masked out of the loss)."""
    return padded_length(V, world * multiple)


class VocabParallelEmbedding(Module):
    """Each rank holds rows [lo, hi) of the (padded) table; tokens outside are masked to zero
    and the partial results are summed (allreduce, or reduce-scatter along the sequence).
    ``attend``: a head tied to the table (this rank's vocabulary columns of the logits)."""

    def __init__(self, weight, comm, sequence_parallel=False, seq=None, multiple=1):
        """``weight``: the logical (V, C) table; ``multiple``: each rank's rows rounded up to
        a multiple of it (the model's ``vocab_multiple``)."""
        V, C = weight.shape
        Vp = padded_vocab(V, comm.size, multiple)
        per = Vp // comm.size
        self.lo, self.hi, self.vocab_size = comm.rank * per, (comm.rank + 1) * per, V
        self.weight = Parameter(pad_axis(weight, 0, Vp)[self.lo:self.hi].copy())  # (its own)
        self.comm, self.sp, self.seq = comm, sequence_parallel, seq
        self.shard_spec = {"weight": Shard(0, 1, (V, C), multiple)}
        self.placements = {"weight": SHARDED}

    def forward(self, idx) -> Tensor:
        xp = backend.array_module(idx)
        outside = (idx < self.lo) | (idx >= self.hi)
        local = xp.where(outside, 0, idx - self.lo)
        out = ops.embedding(self.weight, local) * Tensor((~outside)[..., None].astype(
            self.weight.data.dtype))
        return reduce_scatter_to_sp(out, self.comm) if self.sp else reduce_from_tp(out, self.comm)

    def attend(self, x: Tensor) -> Tensor:
        x = gather_from_sp(x, self.seq.rows, self.comm) if self.sp else copy_to_tp(x, self.comm)
        return ops.attend(x, self.weight)                            # (B, T, Vp/tp)


def vocab_parallel_cross_entropy(logits: Tensor, targets, comm, lo: int, vocab_size: int,
                                 ignore_index: int = -100) -> Tensor:
    """Mean NLL of ``targets`` when each rank holds the logit columns [lo, lo + Vt) of a
    vocabulary of ``vocab_size`` (columns past it are padding, masked out). The full logits
    never exist on one rank: a max-allreduce of the row maxima, then one sum-allreduce of
    [sum of exponentials, target logit] per row."""
    if isinstance(targets, Tensor):
        targets = targets.data
    xp = backend.array_module(logits.data)
    Vt = logits.shape[-1]
    z = logits.data.reshape(-1, Vt)
    low = z.dtype if z.dtype.itemsize < 4 else None  # bf16, fp16: the loss in float32
    pad = min(Vt, max(0, lo + Vt - vocab_size))      # padded columns on this rank (all, where
                                                     # the slice lies past the vocabulary)
    if low:
        z = z.astype(np.float32)                     # (a copy)
    if pad:
        z = z if low else z.copy()
        z[:, Vt - pad:] = -xp.inf
    t = xp.asarray(targets).reshape(-1)               # host targets go to the logits' device
    valid = t != ignore_index
    count = max(int(valid.sum()), 1)
    mine = valid & (t >= lo) & (t < lo + Vt)
    local_t = xp.where(mine, t - lo, 0)
    m = comm.allreduce(z.max(axis=1), op="max")       # (N,) the row maxima
    shifted = z - m[:, None]
    exp = xp.exp(shifted)
    rows = xp.arange(z.shape[0])
    both = xp.stack([exp.sum(axis=1), xp.where(mine, shifted[rows, local_t], 0.0)])
    both = comm.allreduce(both)                       # [sum of exp, target logit - max]
    lse = xp.log(both[0])
    nll = (lse - both[1]) * valid
    out = nll.sum() / count

    def backward(g):
        p = exp / both[0][:, None]
        p[rows[mine], local_t[mine]] -= 1
        p *= (valid * (g / count))[:, None].astype(p.dtype)
        return (p.reshape(logits.shape).astype(low) if low else p.reshape(logits.shape),)
    return Tensor._make(xp.asarray(out, dtype=z.dtype), (logits,), backward)
