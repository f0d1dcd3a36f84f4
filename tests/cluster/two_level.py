"""Run on the cluster in a box (tests/cluster/test_cluster.py): the two-level collectives
against MPI's built-ins, the bytes they put on the node links against the formula, and the
topology every layer sees. Any failed check raises (the job ends with its traceback)."""
import sys

import numpy as np
from mpi4py import MPI

from hpcdist.comm import Communicator, shard_bounds

comm = Communicator()
P, r = comm.size, comm.rank
N, L = int(sys.argv[1]), int(sys.argv[2])
assert comm.nodes == N and comm.topology.per_node == L, (comm.nodes, comm.topology)
assert comm.local_size == L and comm.node_of[r] == r - r % L      # block placement
rng = np.random.default_rng(r)

for n in (1, 7, L * N, 1000, 4099):
    for op, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("avg", MPI.SUM)):
        x = rng.standard_normal(n)
        want = np.empty_like(x)
        comm.mpi.Allreduce(x, want, op=mpi_op)
        if op == "avg":
            want /= P
        for algorithm in ("hierarchical", "ring", "auto"):
            got = comm.allreduce(x, op=op, algorithm=algorithm)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{n} {op} {algorithm}")
        full = np.empty_like(x)
        comm.mpi.Allreduce(x, full, op=mpi_op)
        if op == "avg":
            full /= P
        lo, hi = shard_bounds(n, P, r)
        for algorithm in ("hierarchical", "auto"):
            got = comm.reduce_scatter(x, op=op, algorithm=algorithm)
            np.testing.assert_allclose(got, full[lo:hi], rtol=1e-12, atol=1e-12)
    shard = rng.standard_normal(shard_bounds(n, P, r)[1] - shard_bounds(n, P, r)[0])
    counts = [shard_bounds(n, P, q)[1] - shard_bounds(n, P, q)[0] for q in range(P)]
    want = np.empty(n)
    comm.mpi.Allgatherv(shard, [want, counts])
    for algorithm in ("hierarchical", "auto"):
        np.testing.assert_array_equal(comm.allgather(shard, total=n, algorithm=algorithm), want)
    h = comm.iallreduce(np.full(n, float(r)), algorithm="hierarchical")   # progress thread
    assert (h.wait() == sum(range(P))).all()

# bytes over the node links, per rank: hierarchical allreduce 2(N-1)/N x S/L, the flat ring
# crosses a node link only where a ring neighbour is on another node
S = 8 * L * N * 1000
x = np.ones(S // 8)
before = comm.bytes_inter_node
comm.allreduce(x, algorithm="hierarchical")
hier = comm.bytes_inter_node - before
assert hier == 2 * (N - 1) * S // (N * L), (hier, S, N, L)
before = comm.bytes_inter_node
comm.allreduce(x, algorithm="ring")
flat = comm.bytes_inter_node - before
crosses = comm.node_of[(r + 1) % P] != comm.node_of[r]
assert flat == (2 * (P - 1) * S // P if crosses else 0), (flat, crosses)
before = comm.bytes_inter_node
comm.reduce_scatter(x, algorithm="hierarchical")
assert comm.bytes_inter_node - before == (N - 1) * S // (N * L)

# the process mesh keeps tensor-parallel groups on a node
from hpcdist.comm.mesh import ProcessMesh
mesh = ProcessMesh(comm, dp=P // L, tp=L, pp=1)
assert mesh.tp_within_node and mesh.tp_comm.nodes == 1 and mesh.dp_comm.nodes == N
if N > 1 and N % 2 == 0:                      # tensor-parallel groups of two nodes' ranks
    across = ProcessMesh(comm, dp=P // (2 * L), tp=2 * L, pp=1)
    assert not across.tp_within_node and across.tp_comm.nodes == 2
print(f"rank {r}: two-level checks passed (N={N}, L={L}, inter-node bytes hier {hier}, "
      f"flat {flat})", flush=True)
