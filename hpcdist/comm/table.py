"""Every collective algorithm, by name, in one list: what ``select`` chooses among (in this
order), what ``python -m hpcdist.bench collectives`` and the planner price. An algorithm is a
record in the file that implements it (comm/algorithm.py says what a record holds) and a line
here; ``registry.register`` adds one at run time (a test, a user's experiment).
"""
from __future__ import annotations

from .alltoall import BRUCK, PAIRWISE
from .hierarchical import HIERARCHICAL
from .rabenseifner import RABENSEIFNER
from .recursive_doubling import RECURSIVE_DOUBLING
from .ring import RING
from .short import SHORT_EXCHANGE
from .sparse import TOPK_ALLGATHERV
from .tree import BINOMIAL, SCATTER_ALLGATHER

TABLE = (
    HIERARCHICAL,          # allreduce, reduce_scatter, allgather: two levels, where nodes are
    RABENSEIFNER,          # allreduce, mid sizes
    RECURSIVE_DOUBLING,    # allreduce, short
    RING,                  # allreduce (long), reduce_scatter, allgather, allgatherv
    SHORT_EXCHANGE,                 # the short exchange (every short call), barrier
    TOPK_ALLGATHERV,       # sparse_allreduce
    BINOMIAL,              # bcast (short), reduce
    SCATTER_ALLGATHER,     # bcast (long)
    PAIRWISE,              # alltoall (long, and the v-form)
    BRUCK,                 # alltoall (short)
)
