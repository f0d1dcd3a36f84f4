"""Parallel strategies: where autograd meets communication."""
from .compression import SCHEMES, make_compression
from .ddp import DistributedDataParallel, plan_buckets

__all__ = ["DistributedDataParallel", "plan_buckets", "make_compression", "SCHEMES"]
