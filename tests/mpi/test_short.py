"""Short collectives carry their data in the agreement (comm/short.py): the lean and the
general path meet, short and long calls still disagree loudly, bytes travel exactly."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.host import timeline
from hpcdist.comm import CollectiveMismatchError, shard_bounds, short

pytestmark = pytest.mark.mpi


def each_path(comm):
    """Even ranks take the general path (a timeline recorder is active), odd ranks the lean
    one: their keys and messages must be the same."""
    if comm.rank % 2 == 0:
        timeline.activate(timeline.Recorder(comm.rank))
    return comm


@pytest.fixture
def mixed(comm):
    yield each_path(comm)
    timeline.deactivate()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 129, 8192])
def test_lean_and_general_paths_meet(mixed, n):
    comm = mixed
    x = np.arange(n, dtype=np.float64) * (comm.rank + 1) - 3.5
    ref = np.empty_like(x)
    comm.mpi.Allreduce(x, ref, op=MPI.SUM)
    np.testing.assert_array_equal(comm.allreduce(x), ref)
    np.testing.assert_array_equal(comm.allreduce(x, op="max"),
                                  np.maximum.reduce([np.arange(n) * (r + 1) - 3.5
                                                     for r in range(comm.size)]))
    lo, hi = shard_bounds(n, comm.size, comm.rank)
    np.testing.assert_array_equal(comm.reduce_scatter(x), ref[lo:hi])
    full = np.arange(n, dtype=np.int32)
    np.testing.assert_array_equal(comm.allgather(full[lo:hi].copy(), total=n), full)
    y = np.full(n, float(comm.rank))
    comm.bcast(y, root=comm.size - 1)
    np.testing.assert_array_equal(y, np.full(n, float(comm.size - 1)))
    comm.barrier()


def test_short_and_long_calls_disagree_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    n = 10 if comm.rank == 0 else 100_000          # rank 0 short (fused), others long
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: call #\d+ allreduce 10 x"):
        comm.allreduce(np.ones(n))
    comm.barrier()                                  # and the communicator still works
    assert comm.allreduce(np.ones(3))[0] == comm.size


def test_short_allreduce_vs_barrier_disagree(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(CollectiveMismatchError, match="barrier"):
        if comm.rank == comm.size - 1:
            comm.barrier()
        else:
            comm.allreduce(np.ones(4))


def test_bytes_travel_exactly(comm):
    """OR of zeros and one rank's bytes is those bytes: -0.0, NaN payloads, all bit patterns."""
    pattern = np.array([-0.0, np.nan, np.inf, -np.inf, 5e-324, 1.0], dtype=np.float64)
    bits = pattern.view(np.uint64).copy()
    bits[1] |= comm.rank + 1                      # a NaN with this rank's payload
    mine = bits.view(np.float64)
    got = comm.allgather(mine).view(np.uint64).reshape(comm.size, -1)
    for r in range(comm.size):
        want = pattern.view(np.uint64).copy()
        want[1] |= r + 1
        np.testing.assert_array_equal(got[r], want)
    root = comm.size // 2
    y = mine.copy() if comm.rank == root else np.full(6, 7.0)
    comm.bcast(y, root=root)
    want = pattern.view(np.uint64).copy()
    want[1] |= root + 1
    np.testing.assert_array_equal(y.view(np.uint64), want)


@pytest.mark.parametrize("dtype", ["float16", "int8", "uint8", "complex128", "bool"])
def test_one_element_and_odd_dtypes(comm, dtype):
    x = np.ones(1, dtype=dtype)
    got = comm.allreduce(x, op="max")
    assert got.shape == (1,) and got.dtype == x.dtype and got[0] == x[0]
    s = comm.allgather(np.array([comm.rank % 2], dtype=dtype))
    np.testing.assert_array_equal(s, (np.arange(comm.size) % 2).astype(dtype))


def test_nonblocking_short_calls_interleave_with_blocking(comm):
    handles = [comm.iallreduce(np.full(5, float(i + comm.rank))) for i in range(6)]
    direct = [comm.allreduce(np.full(3, float(i))) for i in range(4)]
    total = sum(range(comm.size))
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(h.wait(), np.full(5, i * comm.size + total))
    for i, d in enumerate(direct):
        np.testing.assert_array_equal(d, np.full(3, i * comm.size))


def test_many_sizes_evict_and_stay_correct(comm):
    """More payload sizes than an Exchanges keeps: the oldest are freed, results stay right."""
    for n in range(1, short.CACHED + 20):
        got = comm.allreduce(np.full(n, comm.rank, dtype=np.int64))
        assert (got == comm.size * (comm.size - 1) // 2).all()
    assert len(comm._wire.exchanges._by_shape) <= short.CACHED


def test_agree_only_checks_calls_whose_data_moves_elsewhere(comm):
    """What the NCCL backend runs before each NCCL collective (no GPU needed to test it)."""
    comm.agree_only("allreduce", np.ones(4, dtype=np.float32), op="sum")
    comm.agree_only("bcast", np.ones(2), root=0)
    if comm.size > 1:
        with pytest.raises(CollectiveMismatchError, match="allreduce"):
            comm.agree_only("allreduce", np.ones(4 + (comm.rank == 0)), op="sum")
    assert comm.allreduce(np.ones(1))[0] == comm.size       # numbering still in step
