"""Communication: handwritten collectives over mpi4py point-to-point calls, raw arrays only.

The shard rule (used by reduce_scatter, allgather and ZeRO): a length-L array over P ranks
gives rank r the elements [r*S, min((r+1)*S, L)) with S = ceil(L/P). See arith.py.
"""
from .ledger import CollectiveMismatchError
from .communicator import Communicator
from .handle import Handle
from .arith import padded_length, shard_bounds, shard_counts, shard_size

__all__ = ["Communicator", "Handle", "CollectiveMismatchError", "shard_bounds", "shard_counts",
           "shard_size", "padded_length"]
