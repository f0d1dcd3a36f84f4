"""Tensor parallelism applied to the one GPT: its modules swapped, in place, for parallel ones.

Attention heads and the MLP's hidden width are split over the tensor-parallel group; the token
embedding (and an untied output head) over the vocabulary; the loss becomes the vocabulary-
parallel cross-entropy; LayerNorms, position embeddings and the biases of row-parallel layers
stay whole (replicated). The model's forward, its pipeline pieces and its parameter names are
``nn.GPT``'s, so a checkpoint maps one-to-one, and each parallel module's ``shard_spec`` says
how it cut its parameters (``layers.Shard``).

The rest of this design: docs/tensor-parallel.md, "hpcdist/parallel/tp/gpt.py"."""
from __future__ import annotations

from ...device import backend
from ...nn.gpt import SelfAttention
from ...nn.layers import Dropout
from ...nn.module import Module, ModuleList
from ...nn.moe import MoE
from ...autograd.tensor import Tensor
from ..sequence import Cut, cut_embeddings, sequence_of
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     vocab_parallel_cross_entropy)
from .mappings import _allgather_last


def check_divisible(cfg, tp: int) -> None:
    """Raise ValueError when ``cfg`` cannot be split ``tp`` ways: tp must divide n_head (then
    n_embd and the MLP width, multiples of it, split too)."""
    if cfg.n_head % tp:
        divisors = [d for d in range(1, cfg.n_head + 1) if cfg.n_head % d == 0]
        raise ValueError(f"tensor-parallel size {tp} must divide n_head ({cfg.n_head}); "
                         f"choose one of {', '.join(map(str, divisors))}")


def _bias(linear):
    return linear.bias.data if linear.bias is not None else None


class ParallelAttention(Module):
    """Causal self-attention with this rank's n_head / tp heads (the same forward as
    ``nn.CausalSelfAttention``'s; ``core`` the attention between the projections)."""

    def __init__(self, attn, comm, seq, sp: bool):
        self.c_attn = ColumnParallelLinear(attn.c_attn.weight.data, _bias(attn.c_attn), comm,
                                           pieces=3, seq=seq if sp else None)
        self.core = SelfAttention(attn.core.n_head // comm.size, attn.core.attn_drop.p)
        self.c_proj = RowParallelLinear(attn.c_proj.weight.data, _bias(attn.c_proj), comm,
                                        sequence_parallel=sp)
        self.resid_drop = attn.resid_drop
        self.sp = sp

    def forward(self, x: Tensor, cache: dict | None = None, residual: Tensor | None = None):
        if cache is not None and self.sp:
            raise ValueError("sampling with a KV cache runs without sequence parallelism")
        out = self.resid_drop(self.c_proj(self.core(self.c_attn(x), cache)))
        return out if residual is None else residual + out           # (B, T or T/tp, C)


class ParallelMLP(Module):
    """Column-parallel fc (4C split), GELU, row-parallel projection."""

    def __init__(self, mlp, comm, seq, sp: bool):
        fc, proj = mlp.layers
        self.layers = ModuleList([
            ColumnParallelLinear(fc.weight.data, _bias(fc), comm, seq=seq if sp else None),
            RowParallelLinear(proj.weight.data, _bias(proj), comm, sequence_parallel=sp)])
        self.act, self.drop = mlp.act, Dropout(mlp.drop.p)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        out = self.drop(self.layers[1](self.act(self.layers[0](x))))
        return out if residual is None else residual + out


class VocabParallelLoss(Module):
    """The loss over logits split by vocabulary (the full logits never exist on one rank in
    training); in evaluation, or without targets, the logits are gathered (trimmed to the
    vocabulary) for the caller's argmax."""

    def __init__(self, comm, lo: int, vocab_size: int):
        self.comm, self.lo, self.vocab_size = comm, lo, vocab_size

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        loss = None if targets is None else vocab_parallel_cross_entropy(
            logits, targets, self.comm, self.lo, self.vocab_size, ignore_index)
        if not self.training or targets is None:
            logits = Tensor(_allgather_last(logits.data, self.comm)[..., :self.vocab_size])
        return logits if targets is None else (logits, loss)


def apply_tensor_parallel(model, comm, sequence_parallel: bool = False):
    """Cut ``model`` (an ``nn.GPT``, built alike on every rank) over the tensor-parallel
    communicator ``comm``, in place; returns it. Each rank keeps its shards (copies of slices
    of the whole parameters) and the replicated parameters."""
    cfg = model.config
    check_divisible(cfg, comm.size)
    if isinstance(model.wte, Cut):
        raise ValueError("cut a model for tensor parallelism before context parallelism "
                         "(apply_tensor_parallel, then apply_context_parallel)")
    seq = sequence_of(model)
    if sequence_parallel:
        seq.sp = comm
        cut_embeddings(model, seq)
    sp = sequence_parallel
    model.wte = VocabParallelEmbedding(model.wte.weight.data, comm, sp, seq)
    for block in model.blocks:
        block.attn = ParallelAttention(block.attn, comm, seq, sp)
        if not isinstance(block.mlp, MoE):     # experts: whole on every rank of the group
            block.mlp = ParallelMLP(block.mlp, comm, seq, sp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(
            _pad_columns(model.lm_head.weight.data, comm.size), None, comm,
            seq=seq if sp else None, logical=tuple(model.lm_head.weight.shape))
    model.lm_loss = VocabParallelLoss(comm, model.wte.lo, cfg.vocab_size)
    return model.train(model.training)


def _pad_columns(weight, world):
    xp = backend.array_module(weight)
    C, V = weight.shape
    Vp = -(-V // world) * world
    full = xp.zeros((C, Vp), dtype=weight.dtype)
    full[:, :V] = weight
    return full
