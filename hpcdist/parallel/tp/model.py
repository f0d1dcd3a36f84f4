"""Tensor parallelism applied to a model of any family: its modules swapped, in place, for
parallel ones by what the family declares (nn/family.py), never by its attribute names.

Each block's projections are cut by their declared role — column-parallel (outputs split;
fused pieces such as grouped-query attention's q | k | v, or SwiGLU's gate | up, each split
alike) or row-parallel (inputs split, outputs summed) — and its attention core keeps this
rank's heads (``AttentionShape.split``); the token embedding (and an untied head) are split
over the vocabulary; the loss becomes the vocabulary-parallel cross-entropy; norms, learned
positions and the biases of row-parallel layers stay whole (replicated). The model's
forward, its pipeline pieces and its parameter names are the family's, so a checkpoint maps
one-to-one, and each parallel module's ``shard_spec`` says how it cut its parameters
(``layers.Shard``). The rest: docs/tensor-parallel.md, "hpcdist/parallel/tp/model.py"."""
from __future__ import annotations

from ...nn.family import replace, resolve
from ...nn.module import Module, pad_axis
from ...autograd import ops
from ...autograd.tensor import Tensor
from ..sequence import Cut, cut_embeddings, sequence_of
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     padded_vocab, vocab_parallel_cross_entropy)
from .mappings import _allgather_last


def split_problem(model, tp: int) -> str | None:
    """Why ``model`` (a family's, unbuilt config or built model) cannot be split ``tp`` ways
    (None: it can): the heads, then every column-parallel piece must divide."""
    shape = model.attention_shape
    why = shape.split_problem(tp)
    if why or not hasattr(model, "blocks"):
        return why
    for block in model.blocks:
        for proj in block.projections():
            if proj.role != "column":
                continue
            width = resolve(block, proj.path)[2].weight.shape[1]
            for piece in proj.pieces or (width,):
                if piece % tp:
                    return (f"tensor-parallel size {tp} must divide the width {piece} of "
                            f"{proj.path} (a column-parallel output)")
    return None


def check_divisible(model, tp: int) -> None:
    """Raise ValueError when ``model`` cannot be split ``tp`` ways (``split_problem``)."""
    why = split_problem(model, tp)
    if why:
        raise ValueError(why)


def _bias(linear):
    return linear.bias.data if linear.bias is not None else None


class VocabParallelLoss(Module):
    """The loss over logits split by vocabulary (the full logits never exist on one rank in
    training); in evaluation, or without targets, the logits are gathered (trimmed to the
    vocabulary) for the caller's argmax."""

    def __init__(self, comm, lo: int, vocab_size: int, cap: float = 0.0):
        self.comm, self.lo, self.vocab_size, self.cap = comm, lo, vocab_size, cap

    def forward(self, logits: Tensor, targets=None, ignore_index: int = -100):
        if self.cap:                          # (elementwise: each rank caps its slice)
            logits = ops.softcap(logits, self.cap)
        loss = None if targets is None else vocab_parallel_cross_entropy(
            logits, targets, self.comm, self.lo, self.vocab_size, ignore_index)
        if not self.training or targets is None:
            logits = Tensor(_allgather_last(logits.data, self.comm)[..., :self.vocab_size])
        return logits if targets is None else (logits, loss)


def _cut_block(block, comm, seq, sp: bool) -> None:
    """The block's projections by their declared roles, its attention core to this rank's
    heads."""
    for proj in block.projections():
        lin = resolve(block, proj.path)[2]
        if proj.role == "column":
            new = ColumnParallelLinear(lin.weight.data, _bias(lin), comm,
                                       pieces=proj.pieces or 1, seq=seq if sp else None)
        elif proj.role == "row":
            new = RowParallelLinear(lin.weight.data, _bias(lin), comm, sequence_parallel=sp)
        else:
            raise ValueError(f"{proj.path}: unknown projection role {proj.role!r}")
        replace(block, proj.path, new)
    core = resolve(block, block.attention)[2]
    core.shape = core.shape.split(comm.size)


def apply_tensor_parallel(model, comm, sequence_parallel: bool = False):
    """Cut ``model`` (a family's ``DecoderLM``, built alike on every rank) over the tensor-
    parallel communicator ``comm``, in place; returns it. Each rank keeps its shards (copies
    of slices of the whole parameters) and the replicated parameters."""
    check_divisible(model, comm.size)
    if isinstance(model.part("tokens"), Cut):
        raise ValueError("cut a model for tensor parallelism before context parallelism "
                         "(apply_tensor_parallel, then apply_context_parallel)")
    seq = sequence_of(model)
    if sequence_parallel:
        seq.sp = comm
        cut_embeddings(model, seq)
    sp = sequence_parallel
    V, m = model.config.vocab_size, getattr(model.config, "vocab_multiple", 1)
    table = model.part("tokens").weight.data[:V]       # (the logical rows of a padded table)
    tokens = VocabParallelEmbedding(table, comm, sp, seq, multiple=m)
    model.set_part("tokens", tokens)
    for block in model.blocks:
        _cut_block(block, comm, seq, sp)
    head = model.part("head")
    if head is not None:
        weight = head.weight.data[:, :V]
        model.set_part("head", ColumnParallelLinear(
            pad_axis(weight, 1, padded_vocab(V, comm.size, m)), None, comm,
            seq=seq if sp else None, logical=tuple(weight.shape), multiple=m))
    model.set_part("loss", VocabParallelLoss(comm, tokens.lo, V,
                                             getattr(model.part("loss"), "cap", 0.0)))
    return model.train(model.training)
