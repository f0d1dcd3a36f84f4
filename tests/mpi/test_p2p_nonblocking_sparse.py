"""Point-to-point with shapes and dtypes, non-blocking collectives, sparse Top-K exchange."""
import time

import numpy as np
import pytest

from hpcdist.comm import sparse

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "bool"])
def test_ring_send_recv_carries_shape_and_dtype(comm, dtype):
    P, r = comm.size, comm.rank
    shape = (r + 1, 3, 2)
    mine = (np.arange(np.prod(shape)) % 7 + r).astype(dtype).reshape(shape)
    got = comm.sendrecv(mine, dest=(r + 1) % P, source=(r - 1) % P, sendtag=7)
    left = (r - 1) % P
    lshape = (left + 1, 3, 2)
    np.testing.assert_array_equal(got, (np.arange(np.prod(lshape)) % 7 + left).astype(dtype).reshape(lshape))
    assert got.dtype == np.dtype(dtype)


def test_isend_irecv_pipeline_order(comm):
    """Several messages in flight between stage neighbours arrive in order, complete and intact."""
    P, r = comm.size, comm.rank
    if P == 1:
        pytest.skip("needs a neighbour")
    sends = [comm.isend(np.full((2, m + 1), r * 10 + m, np.float32), (r + 1) % P, tag=3)
             for m in range(4)]
    recvs = [comm.irecv((r - 1) % P, tag=3) for _ in range(4)]
    for m, h in enumerate(recvs):
        out = h.wait()
        assert out.shape == (2, m + 1) and (out == ((r - 1) % P) * 10 + m).all()
    for h in sends:
        h.wait()
        assert h.test()


def test_send_bad_peer_and_array(comm):
    with pytest.raises(ValueError, match="dest must be in"):
        comm.send(np.ones(2), dest=comm.size)
    with pytest.raises(ValueError, match="source must be in"):
        comm.recv(source=-1)
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.send(np.ones((3, 3))[:, 1], dest=comm.rank)


@pytest.mark.parametrize("which", ["allreduce", "reduce_scatter", "allgather"])
def test_nonblocking_with_compute_in_between(comm, which):
    rng = np.random.default_rng(comm.rank)
    x = rng.integers(-5, 5, size=300_001).astype(np.float64)
    total = x.size
    if which == "allreduce":
        h, ref = comm.iallreduce(x), comm.allreduce(x)
    elif which == "reduce_scatter":
        h, ref = comm.ireduce_scatter(x), comm.reduce_scatter(x)
    else:
        from hpcdist.comm import shard_bounds
        lo, hi = shard_bounds(total, comm.size, comm.rank)
        h, ref = comm.iallgather(x[lo:hi].copy(), total=total), comm.allgather(x[lo:hi].copy(), total=total)
    a = np.random.default_rng(0).standard_normal((300, 300))
    for _ in range(5):                        # compute while the collective progresses
        a = np.tanh(a @ a.T / 300)
    h.test()
    np.testing.assert_array_equal(h.wait(), ref)
    assert h.test()


def test_many_handles_in_flight_complete_in_order(comm):
    xs = [np.full(1000 * (i + 1), float(comm.rank + i)) for i in range(6)]
    handles = [comm.iallreduce(x) for x in xs]
    for i, h in reversed(list(enumerate(handles))):       # waiting out of order is fine
        expected = sum(q + i for q in range(comm.size))
        assert (h.wait() == expected).all()


def test_nonblocking_error_surfaces_in_wait(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    from hpcdist.comm import CollectiveMismatchError
    h = comm.iallreduce(np.ones(5 + comm.rank))
    with pytest.raises(CollectiveMismatchError):
        h.wait()


def test_iallreduce_progresses_while_caller_sleeps(comm):
    """The progress thread moves data while the main thread does not call into MPI."""
    x = np.ones(2_000_000)
    h = comm.iallreduce(x)
    deadline = time.time() + 60
    while not h.test() and time.time() < deadline:
        time.sleep(0.01)                      # no MPI call from this thread
    assert h.test(), "iallreduce made no progress without wait()"
    assert (h.wait() == comm.size).all()


def test_a_nonblocking_calls_bytes_count_when_it_is_waited(comm):
    """``bytes_sent`` takes a non-blocking collective's bytes at its wait, all of them at
    once, whenever the progress thread sent them: a training step's window holds exactly the
    calls it waited (DiLoCo's records fell short when the thread sent between two windows).
    The same bytes as the blocking call's."""
    x = np.ones(120_000)                      # (divides by every world size the suite runs)
    before = comm.bytes_sent
    comm.allreduce(x, algorithm="ring")
    blocking = comm.bytes_sent - before
    before = comm.bytes_sent
    h = comm.iallreduce(x, algorithm="ring")
    deadline = time.time() + 60
    while not h.test() and time.time() < deadline:
        time.sleep(0.01)                      # sent by now: not counted until the wait
    assert comm.bytes_sent == before
    h.wait()
    assert comm.bytes_sent - before == blocking == (0 if comm.size == 1 else
                                                    2 * (comm.size - 1) * (x.nbytes //
                                                                           comm.size))
    h.wait()                                  # a second wait counts nothing again
    assert comm.bytes_sent - before == blocking


def _dense_reference(comm, grads, k):
    """Sum over ranks of each rank's top-k entries, computed from everyone's gradient."""
    out = np.zeros_like(grads[0])
    for g in grads:
        idx = np.argsort(-np.abs(g), kind="stable")[:k]
        out[idx] += g[idx]
    return out


@pytest.mark.parametrize("n,density", [(1000, 0.01), (5003, 0.001), (97, 0.05), (1, 1.0)])
def test_sparse_allreduce_against_dense_reference(comm, n, density):
    P = comm.size
    # distinct magnitudes so top-k is unique; overlapping supports make duplicates
    grads = [np.random.default_rng(q).permutation(n).astype(np.float64) * (1 if q % 2 else -1) / n
             for q in range(P)]
    got = comm.sparse_allreduce(grads[comm.rank].copy(), density=density)
    k = sparse.choose_k(n, density, None)
    st = comm.sparse_stats
    if st.fell_back:
        np.testing.assert_allclose(got, sum(grads), rtol=1e-12)
    else:
        np.testing.assert_allclose(got, _dense_reference(comm, grads, k), rtol=1e-12, atol=1e-15)
        assert st.bytes_sent == (P - 1) * k * 12
    assert st.k == k and st.n == n


def test_sparse_falls_back_when_dense_is_cheaper(comm):
    if comm.size == 1:
        pytest.skip("no wire at P=1")
    x = np.arange(100, dtype=np.float32) + comm.rank
    got = comm.sparse_allreduce(x, density=0.9)
    assert comm.sparse_stats.fell_back
    np.testing.assert_array_equal(got, comm.allreduce(x))


def test_sparse_bad_arguments(comm):
    with pytest.raises(ValueError, match="exactly one"):
        comm.sparse_allreduce(np.ones(4), density=0.1, k=2)
    with pytest.raises(ValueError, match="density must be in"):
        comm.sparse_allreduce(np.ones(4), density=0.0)
