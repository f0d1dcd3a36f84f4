"""Communication: handwritten collectives over mpi4py point-to-point calls, raw arrays only.

Shard layout (used by reduce_scatter, allgather and ZeRO): a length-L array over P ranks
gives rank r the elements [r*S, min((r+1)*S, L)) with S = ceil(L/P). See layout.py.
"""
from .ledger import CollectiveMismatchError
from .communicator import Communicator
from .handle import Handle
from .layout import padded_length, shard_bounds, shard_counts, shard_size

__all__ = ["Communicator", "Handle", "CollectiveMismatchError", "shard_bounds", "shard_counts",
           "shard_size", "padded_length"]
