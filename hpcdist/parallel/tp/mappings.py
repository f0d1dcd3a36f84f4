"""Tensor-parallel mappings: autograd ops whose forward and backward are dual collectives.

Each op is a few lines, over the tensor-parallel communicator ``comm`` (our own collectives)
— the list goes on in docs/tensor-parallel.md, "hpcdist/parallel/tp/mappings.py"."""
from __future__ import annotations

from ...comm.arith import shard_bounds
from ...autograd.tensor import Tensor

# Elements that entered each kind of tensor-parallel collective (bench tp compares them with
# Megatron's formula): allreduce and reduce-scatter count their input, allgather its output.
traffic = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}


def _allreduce(x, comm):
    traffic["allreduce"] += x.size
    return comm.allreduce(x)


def sequence_bounds(T: int, P: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a length-T sequence that rank holds under sequence parallelism."""
    return shard_bounds(T, P, rank)


def _last_slice(x, comm):
    c = x.shape[-1] // comm.size
    return x[..., comm.rank * c:(comm.rank + 1) * c]


def _allgather_last(x, comm):
    """(..., c) on every rank -> (..., P*c), rank-major along the last axis."""
    traffic["allgather"] += x.size * comm.size
    xp_full = comm.allgather(x.reshape(-1))                   # (P * prod(x.shape),)
    parts = xp_full.reshape((comm.size,) + x.shape)            # (P, ..., c)
    return parts.transpose(tuple(range(1, x.ndim)) + (0, x.ndim)).reshape(
        x.shape[:-1] + (comm.size * x.shape[-1],))


def _seq_counts(T, rest, comm):
    return [(hi - lo) * rest for lo, hi in (sequence_bounds(T, comm.size, r)
                                            for r in range(comm.size))]


def _reduce_scatter_seq(x, comm):
    """(B, T, C) partial sums -> (B, t_r, C): this rank's sequence rows of the sum."""
    B, T, C = x.shape
    traffic["reduce_scatter"] += x.size
    rows = x.transpose(1, 0, 2).copy().reshape(-1)            # (T, B, C) flat, row-major in T
    mine = comm.reduce_scatter(rows, counts=_seq_counts(T, B * C, comm))
    return mine.reshape(-1, B, C).transpose(1, 0, 2).copy()


def _allgather_seq(x, T, comm):
    """(B, t_r, C) on every rank -> (B, T, C)."""
    B, t, C = x.shape
    traffic["allgather"] += T * B * C
    full = comm.allgather(x.transpose(1, 0, 2).copy().reshape(-1),
                          counts=_seq_counts(T, B * C, comm))
    return full.reshape(T, B, C).transpose(1, 0, 2).copy()


def copy_to_tp(x: Tensor, comm) -> Tensor:
    """Forward identity; backward allreduce (each rank's use of x adds a partial gradient)."""
    return Tensor._make(x.data, (x,), lambda g: (_allreduce(g, comm),))


def reduce_from_tp(x: Tensor, comm) -> Tensor:
    """Forward allreduce (sum of partial results); backward identity."""
    return Tensor._make(_allreduce(x.data, comm), (x,), lambda g: (g,))


def gather_from_tp(x: Tensor, comm) -> Tensor:
    """Forward allgather along the last axis; backward keeps this rank's slice."""
    return Tensor._make(_allgather_last(x.data, comm), (x,),
                        lambda g: (_last_slice(g, comm).copy(),))


def scatter_to_tp(x: Tensor, comm) -> Tensor:
    """Forward keeps this rank's slice of the last axis; backward allgathers."""
    return Tensor._make(_last_slice(x.data, comm).copy(), (x,),
                        lambda g: (_allgather_last(g, comm),))


def reduce_scatter_to_sp(x: Tensor, comm) -> Tensor:
    """Forward reduce-scatter along the sequence axis; backward allgather along it."""
    T = x.shape[1]
    return Tensor._make(_reduce_scatter_seq(x.data, comm), (x,),
                        lambda g: (_allgather_seq(g, T, comm),))


def gather_from_sp(x: Tensor, T: int, comm) -> Tensor:
    """Forward allgather along the sequence axis (to length T); backward reduce-scatter."""
    return Tensor._make(_allgather_seq(x.data, T, comm), (x,),
                        lambda g: (_reduce_scatter_seq(g, comm),))
