"""Tensor parallelism (Megatron-LM style, with sequence parallelism): mappings, layers, and
``apply_tensor_parallel``: a model of any family with its modules swapped for these."""
from .model import apply_tensor_parallel, check_divisible, split_problem
from .layers import (ColumnParallelLinear, RowParallelLinear, Shard, VocabParallelEmbedding,
                     padded_vocab, vocab_parallel_cross_entropy)
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_tp, sequence_bounds)

__all__ = ["apply_tensor_parallel", "check_divisible", "split_problem", "Shard", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "padded_vocab", "vocab_parallel_cross_entropy",
           "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
           "reduce_scatter_to_sp", "gather_from_sp", "sequence_bounds"]
