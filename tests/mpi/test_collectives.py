"""Every algorithm, op and dtype against MPI's built-in collectives on the same data."""
import re

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.comm import CollectiveMismatchError, shard_bounds
from hpcdist.comm.select import ALLREDUCE_ALGORITHMS, BCAST_ALGORITHMS

pytestmark = pytest.mark.mpi

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "max", "min"]
MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def lengths(P):
    return sorted({0, 1, max(P - 1, 0), P, P + 1, 7, 13, 97, 1031})


def rank_data(n, dtype, rank, seed=0):
    """Small integers (exact in every dtype, so float sums are order-independent)."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-20, 21, size=n).astype(dtype)


def oracle_allreduce(comm, x, op):
    """MPI's Allreduce (fp16 computed in fp64: MPI has no half type)."""
    src = x.astype(np.float64) if x.dtype == np.float16 else x
    out = np.empty_like(src)
    comm.mpi.Allreduce(src, out, op=MPI_OPS[op])
    if op == "avg":
        out = out // comm.size if out.dtype.kind == "i" else out / comm.size
    return out.astype(x.dtype)


@pytest.mark.parametrize("algorithm", ["auto"] + sorted(ALLREDUCE_ALGORITHMS))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_matches_mpi(comm, algorithm, op, dtype):
    for n in lengths(comm.size):
        x = rank_data(n, dtype, comm.rank, seed=n)
        before = x.copy()
        got = comm.allreduce(x, op=op, algorithm=algorithm)
        np.testing.assert_array_equal(got, oracle_allreduce(comm, x, op), err_msg=f"n={n}")
        np.testing.assert_array_equal(x, before)        # out of place leaves buf alone
        assert got.dtype == x.dtype and got.shape == x.shape


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_allreduce_random_floats_in_place_and_identical_everywhere(comm, algorithm):
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((31, 17))
    ref = oracle_allreduce(comm, x, "sum")
    out = comm.allreduce(x, out=x, algorithm=algorithm)
    assert out is x
    np.testing.assert_allclose(x, ref, rtol=1e-12, atol=1e-12)
    everyone = np.empty((comm.size,) + x.shape)
    comm.mpi.Allgather(x, everyone)
    assert (everyone == everyone[0]).all(), "ranks ended with different bits"


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_allreduce_4Mi_elements(comm, algorithm):
    n = 4 * 1024 * 1024 + 3
    x = rank_data(n, "float32", comm.rank, seed=5)
    np.testing.assert_array_equal(comm.allreduce(x, algorithm=algorithm),
                                  oracle_allreduce(comm, x, "sum"))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_matches_mpi(comm, op, dtype):
    for n in lengths(comm.size) + [4 * 1024 * 1024 + 1] * (dtype == "float32" and op == "sum"):
        x = rank_data(n, dtype, comm.rank, seed=n)
        lo, hi = shard_bounds(n, comm.size, comm.rank)
        got = comm.reduce_scatter(x, op=op)
        np.testing.assert_array_equal(got, oracle_allreduce(comm, x, op)[lo:hi], err_msg=f"n={n}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_layout_and_equal_shards(comm, dtype):
    P, r = comm.size, comm.rank
    for total in lengths(P) + [4 * 1024 * 1024 + 5] * (dtype == "float32"):
        full = rank_data(total, dtype, 0, seed=total)          # the same array everywhere
        lo, hi = shard_bounds(total, P, r)
        np.testing.assert_array_equal(comm.allgather(full[lo:hi].copy(), total=total), full)
    for n in (0, 1, 5):
        mine = rank_data(n, dtype, r, seed=3)
        ref = np.empty(n * P, dtype=dtype)
        comm.mpi.Allgather(mine.view(np.uint8), ref.view(np.uint8))
        np.testing.assert_array_equal(comm.allgather(mine), ref)


def test_allgatherv_uneven(comm):
    mine = np.arange(comm.rank * 3, dtype=np.float64) + 100 * comm.rank
    expected = np.concatenate([np.arange(q * 3, dtype=np.float64) + 100 * q
                               for q in range(comm.size)])
    np.testing.assert_array_equal(comm.allgatherv(mine), expected)


@pytest.mark.parametrize("algorithm", sorted(BCAST_ALGORITHMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_bcast_every_root(comm, algorithm, dtype):
    for root in range(comm.size):
        for n in lengths(comm.size) + [4 * 1024 * 1024 + 7] * (dtype == "float64" and root == comm.size - 1):
            x = rank_data(n, dtype, comm.rank, seed=root)
            ref = x.copy()
            comm.mpi.Bcast(ref.view(np.uint8), root=root)
            assert comm.bcast(x, root=root, algorithm=algorithm) is x
            np.testing.assert_array_equal(x, ref, err_msg=f"root={root} n={n}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_every_root(comm, op, dtype):
    for root in range(comm.size):
        for n in (0, 1, comm.size + 1, 97):
            x = rank_data(n, dtype, comm.rank, seed=n + root)
            got = comm.reduce(x, op=op, root=root)
            ref = oracle_allreduce(comm, x, op)
            if comm.rank == root:
                np.testing.assert_array_equal(got, ref)
            else:
                assert got is None


def test_barrier_and_comm_self(comm):
    comm.barrier()
    from hpcdist.comm import Communicator
    solo = Communicator(MPI.COMM_SELF)
    x = np.arange(5.0)
    np.testing.assert_array_equal(solo.allreduce(x), x)
    np.testing.assert_array_equal(solo.reduce_scatter(x), x)
    np.testing.assert_array_equal(solo.allgather(x), x)
    solo.close()


def test_split_even_odd(comm):
    sub = comm.split(comm.rank % 2)
    members = [q for q in range(comm.size) if q % 2 == comm.rank % 2]
    assert sub.size == len(members) and sub.rank == members.index(comm.rank)
    got = sub.allreduce(np.array([float(comm.rank)]))
    assert got[0] == sum(members)
    sub.close()


def test_local_rank_on_one_node(comm):
    assert comm.local_rank == comm.rank and comm.local_size == comm.size


# ---- bad input ---------------------------------------------------------------------------------

def test_length_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones(10 + (comm.rank == comm.size - 1), dtype=np.float32)
    last, others = comm.size - 1, ", ".join(str(r) for r in range(comm.size - 1))
    rest = "rank" if comm.size == 2 else "ranks"
    with pytest.raises(CollectiveMismatchError) as err:
        comm.allreduce(x)
    assert re.search(rf"(— |; )rank {last}: call #\d+ allreduce 11 x float32 sum", str(err.value))
    assert re.search(rf"(— |; ){rest} {others}: call #\d+ allreduce 10 x float32 sum",
                     str(err.value))
    with pytest.raises(CollectiveMismatchError, match=rf"rank {last}: call #\d+ reduce_scatter 11"):
        comm.reduce_scatter(x)
    comm.barrier()   # and the communicator still works afterwards
    np.testing.assert_array_equal(comm.allreduce(np.ones(3)), np.full(3, comm.size))


def test_dtype_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones(4, dtype=np.float32 if comm.rank else np.float64)
    with pytest.raises(CollectiveMismatchError, match="x float64"):
        comm.allreduce(x)
    with pytest.raises(CollectiveMismatchError, match="x float64"):
        comm.bcast(x)


def test_non_contiguous_on_one_rank(comm):
    x = np.ones((4, 4), dtype=np.float32)
    arg = x[:, ::2] if comm.rank == 0 else np.ones(8, np.float32)
    if comm.rank == 0:
        with pytest.raises(ValueError, match="buf must be C-contiguous"):
            comm.allreduce(arg)
    else:
        with pytest.raises(CollectiveMismatchError, match="bad argument"):
            comm.allreduce(arg)


def test_wrong_root(comm):
    with pytest.raises(ValueError, match="root must be in"):
        comm.bcast(np.ones(3), root=comm.size)
    with pytest.raises(ValueError, match="root must be in"):
        comm.reduce(np.ones(3), root=-1)


def test_different_collectives_raise(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones(3)
    with pytest.raises(CollectiveMismatchError, match="call #[0-9]+ bcast"):
        comm.allreduce(x) if comm.rank == 0 else comm.bcast(x)


def test_allgather_shard_not_matching_layout(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    total = 3 * comm.size
    n = 3 + (comm.rank == 0)
    if comm.rank == 0:
        with pytest.raises(ValueError, match="shard has 4 elements"):
            comm.allgather(np.ones(n), total=total)
    else:
        with pytest.raises(CollectiveMismatchError):
            comm.allgather(np.ones(n), total=total)


def test_unknown_op_and_algorithm(comm):
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce(np.ones(2), op="prod")
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        comm.allreduce(np.ones(2), algorithm="butterfly")


def test_process_mesh_axes(comm):
    from hpcdist.comm.mesh import ProcessMesh
    P = comm.size
    for dp, tp, pp in {(P, 1, 1), (1, P, 1), (1, 1, P)} | ({(2, 2, P // 4)} if P % 4 == 0 else set()):
        mesh = ProcessMesh(comm, dp=dp, tp=tp, pp=pp)
        c = mesh.coord
        assert (mesh.dp_comm.size, mesh.tp_comm.size, mesh.pp_comm.size) == (dp, tp, pp)
        assert (mesh.dp_comm.rank, mesh.tp_comm.rank, mesh.pp_comm.rank) == (c.dp, c.tp, c.pp)
        # the members of my tp group are exactly the ranks that share my dp and pp
        members = mesh.tp_comm.allgather(np.array([comm.rank]))
        expected = [(c.pp * dp + c.dp) * tp + t for t in range(tp)]
        assert members.tolist() == expected
        mesh.close()
    with pytest.raises(ValueError, match="does not match the world size"):
        ProcessMesh(comm, dp=P + 1)


def test_debug_mode_checks_shape_and_caller(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    sub = comm.split(0)
    sub.debug = True                    # what HPCDIST_DEBUG=1 sets at construction
    x = np.ones((2, 3)) if sub.rank == 0 else np.ones((3, 2))
    with pytest.raises(CollectiveMismatchError, match=r"shape \(2, 3\)"):
        sub.allreduce(x)
    # one rank's call from another line of code: same kind, size and dtype, caught by the caller
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: .* at test_collectives.py:\d+"):
        if sub.rank == 0:
            sub.allreduce(np.ones(4))
        else:
            sub.allreduce(np.ones(4))
    sub.debug = False                   # without debug, same length and dtype is enough
    np.testing.assert_array_equal(sub.allreduce(np.ones(4)), np.full(4, sub.size))
    sub.close()


def test_call_numbers_are_always_on_and_shared_by_blocking_and_nonblocking(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    sub = comm.split(0)
    sub.iallreduce(np.ones(2)).wait()   # call #1, non-blocking
    if sub.rank == 0:                   # as if rank 0 had skipped a collective the others ran
        sub._ledger.seq -= 1
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: call #1 allreduce .*: call #2 allreduce"):
        sub.allreduce(np.ones(4))
    if sub.rank == 0:
        sub._ledger.seq += 1
    np.testing.assert_array_equal(sub.allreduce(np.ones(4)), np.full(4, sub.size))
    sub.close()


def test_bad_argument_on_every_rank_still_raises(comm):
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allreduce(np.ones((4, 4))[:, ::2])


def test_fp16_wire_reduces_in_fp32_and_counts_half_the_bytes(comm):
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(1000).astype(np.float32)
    before = comm.bytes_sent
    got = comm.allreduce(x, op="avg", wire_dtype="float16")
    wire16 = comm.bytes_sent - before
    assert got.dtype == np.float32
    ref = oracle_allreduce(comm, x.astype(np.float64), "avg")
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-3 * np.abs(ref).max() + 1e-3)
    everyone = np.empty((comm.size, x.size), np.float32)
    comm.mpi.Allgather(got, everyone)
    assert (everyone == everyone[0]).all(), "ranks disagree after the fp16-wire ring"
    before = comm.bytes_sent
    comm.allreduce(x, algorithm="ring")
    assert wire16 * 2 == comm.bytes_sent - before


def alltoall_oracle(comm, buf, counts):
    """MPI's Alltoallv (the sizes by MPI's Alltoall first)."""
    incoming = np.empty(comm.size, dtype=np.int64)
    comm.mpi.Alltoall(np.array(counts, dtype=np.int64), incoming)
    out = np.empty(int(incoming.sum()), dtype=buf.dtype)
    comm.mpi.Alltoallv([buf, counts], [out, incoming])
    return out, [int(c) for c in incoming]


@pytest.mark.parametrize("algorithm", ["auto", "pairwise", "bruck"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_matches_mpi(comm, algorithm, dtype):
    """Equal pieces (MPI's Alltoall) of several sizes, and the v-form (Alltoallv) with uneven
    and zero counts, the sizes exchanged by the call or given by the caller."""
    P, r = comm.size, comm.rank
    for per in (0, 1, 3, 1000):
        x = rank_data(per * P, dtype, r, per)
        want = np.empty_like(x)
        comm.mpi.Alltoall(x, want)
        got = comm.alltoall(x, algorithm=algorithm)
        assert [g.size for g in got] == [per] * P
        np.testing.assert_array_equal(np.concatenate(got), want)
    rng = np.random.default_rng(7 + r)
    for zeros in (False, True):
        counts = [int(c) for c in rng.integers(0, 40, P)]
        if zeros:                                # nothing to the odd ranks, nothing from rank 0
            counts = [0 if (j % 2 or r == 0) else c for j, c in enumerate(counts)]
        x = rank_data(sum(counts), dtype, r, 3)
        want, incoming = alltoall_oracle(comm, x, counts)
        got = comm.alltoall(x, counts=counts, algorithm=algorithm)
        assert [g.size for g in got] == incoming
        np.testing.assert_array_equal(np.concatenate(got) if got else x[:0], want)
        given = comm.ialltoall(x, counts=counts, recv_counts=incoming, algorithm=algorithm)
        np.testing.assert_array_equal(np.concatenate(given.wait()), want)


def test_alltoall_takes_a_list_and_is_one_numbered_call(comm):
    """A list of P arrays is the pieces; each call is one collective of the ledger's (a rank
    that calls another collective meanwhile is named), with its bytes counted."""
    P, r = comm.size, comm.rank
    sends = [np.full((2, j + 1), 10 * r + j, np.float32) for j in range(P)]
    got = comm.alltoall(sends)
    for j, g in enumerate(got):
        np.testing.assert_array_equal(g, np.full(2 * (r + 1), 10 * j + r, np.float32))
    before = comm.bytes_sent
    comm.alltoall(np.ones(4 * P), algorithm="pairwise")
    assert comm.bytes_sent - before == (P - 1) * 4 * 8
    if P > 1:
        with pytest.raises(ValueError, match="does not split into"):
            comm.alltoall(np.ones(P + 1))
        with pytest.raises(CollectiveMismatchError):
            comm.alltoall(np.ones(P)) if r == 0 else comm.allreduce(np.ones(P))


def test_an_algorithm_is_one_record(comm):
    """A new algorithm, added the way every algorithm is (comm/algorithm.py): one record. Here
    the naive allreduce — every rank sends its whole buffer to every other and sums what it
    receives, in rank order so that every rank adds the same numbers in the same order. Once
    registered, select runs it when asked for by name, the alpha-beta model prices it and
    its wire bytes are the Communicator's count, with no other file touched."""
    import dataclasses

    from hpcdist.comm import algorithm, model, registry, select
    from hpcdist.comm.arith import as_bytes, finish, reduce_into

    def naive_allreduce(wire, buf, op):
        P, r = wire.Get_size(), wire.Get_rank()
        parts = [None] * P
        for step in range(1, P):
            to, frm = (r + step) % P, (r - step) % P
            parts[frm] = np.empty_like(buf)
            wire.Sendrecv(as_bytes(buf), to, 150, as_bytes(parts[frm]), frm, 150)
        parts[r] = buf.copy()
        buf[...] = parts[0]
        for p in parts[1:]:
            reduce_into(buf, p, op)
        finish(buf, op, P)

    naive = algorithm.Algorithm(
        "naive", kinds=("allreduce",), runs={"allreduce": naive_allreduce},
        wire_bytes=lambda kind, n, P, itemsize: (P - 1) * n * itemsize,
        cost=lambda kind, nbytes, P, a, b: (P - 1) * (a + nbytes * b))
    registry.register(naive)
    try:
        x = np.arange(5000, dtype=np.float64) * (comm.rank + 1)
        before = comm.bytes_sent
        got = comm.allreduce(x, algorithm="naive")
        sent = comm.bytes_sent - before
        want = np.empty_like(x)
        comm.mpi.Allreduce(x, want)
        np.testing.assert_array_equal(got, want)
        assert sent == select.wire_bytes("allreduce", "naive", x.size, comm.size, 8)
        assert "naive" in select.ALLREDUCE_ALGORITHMS
        assert select.choose("allreduce", x.nbytes, comm.size, "naive") == "naive"
        if comm.size > 1:
            assert model.predict("allreduce", x.nbytes, comm.size, 1e-6, 1e-9, "naive") == \
                pytest.approx(math.ceil(math.log2(comm.size)) * 1e-6
                              + (comm.size - 1) * (1e-6 + x.nbytes * 1e-9))
        with pytest.raises(ValueError, match="unknown allreduce algorithm 'naiv'"):
            comm.allreduce(x, algorithm="naiv")
        # "auto" never picks it: it declares no size it wins at
        assert select.choose("allreduce", x.nbytes, comm.size) != "naive"
        assert dataclasses.asdict(naive)["name"] == "naive"
    finally:
        registry.unregister("naive")


def test_a_registered_algorithm_is_benchmarked_beside_the_others(comm):
    """An all-to-all algorithm registered here (each rank posts every piece at once) runs,
    matches MPI, and ``bench collectives --algorithms`` times it beside pairwise and Bruck's
    with no file of bench/ touched."""
    from hpcdist.bench import collectives as bench
    from hpcdist.comm import algorithm, registry
    from hpcdist.comm.alltoall import offsets
    from hpcdist.comm.arith import as_bytes

    def all_at_once(wire, send, counts, out, incoming, uniform=True):
        P, r = wire.Get_size(), wire.Get_rank()
        so, ro = offsets(counts), offsets(incoming)
        reqs = [wire.Irecv(as_bytes(out[ro[j]:ro[j + 1]]), j, 160) for j in range(P)]
        for j in range(P):
            wire.Send(as_bytes(send[so[j]:so[j + 1]]), j, 160)
        MPI.Request.Waitall(reqs)

    registry.register(algorithm.Algorithm("at-once", kinds=("alltoall",),
                                           runs={"alltoall": all_at_once}))
    try:
        x = rank_data(4 * comm.size, "float64", comm.rank)
        want = np.empty_like(x)
        comm.mpi.Alltoall(x, want)
        np.testing.assert_array_equal(np.concatenate(comm.alltoall(x, algorithm="at-once")),
                                      want)
        rows = bench.by_algorithm(comm, [64], lambda *a: None)
        row = next(r for r in rows if r["collective"] == "alltoall_by_algorithm")
        assert {"at-once_us", "pairwise_us", "bruck_us"} <= set(row)
    finally:
        registry.unregister("at-once")


def test_each_algorithm_sends_the_bytes_its_record_says(comm):
    """Every allreduce algorithm's ``wire_bytes`` against the Communicator's count, where the
    formula is exact (a power of two of ranks dividing the length)."""
    from hpcdist.comm import select
    from hpcdist.comm.registry import serving
    P = comm.size
    if P & (P - 1) or P == 1:
        pytest.skip("exact at a power of two of ranks")
    for a in serving("allreduce"):
        if a.wire_bytes is None or "allreduce" not in a.runs:
            continue
        for n in (P * 250, P * 1024, P * 25_000):
            before = comm.bytes_sent
            comm.allreduce(np.ones(n), algorithm=a.name)
            assert comm.bytes_sent - before == select.wire_bytes("allreduce", a.name, n, P, 8), \
                (a.name, n)


def _stage_callers(fn):
    """{stage: the files that called it} while ``fn`` ran (profile hook, this thread)."""
    import os
    import sys
    stages = {("ledger.py", "open"), ("ledger.py", "agree"), ("ledger.py", "agree_static"),
              ("select.py", "choose"), ("select.py", "check_name"),
              ("watchdog.py", "enter"), ("timeline.py", "collective")}
    seen: dict = {}

    def prof(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        key = (os.path.basename(code.co_filename), code.co_name)
        if key in stages and "hpcdist" in code.co_filename:
            path = frame.f_back.f_code.co_filename
            caller = os.path.basename(path)
            # not its own file's delegation, nor contextlib resuming a context manager
            if caller != key[0] and "hpcdist" in path:
                seen.setdefault(key, set()).add(caller)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.mpi(min_size=1)
def test_one_straight_path_enters_every_stage_from_one_place(comm):
    """check -> choose -> watch -> (short exchange | algorithm): every stage — the ledger's
    numbering and agreement, the choice, the watchdog, the timeline — is entered from
    dispatch.py, on every route (short fused and its memo, each algorithm, non-blocking,
    each kind, with the timeline recording or not); the kinds and the Communicator enter
    none. A Kind sees no Communicator (its hooks take the call's Args)."""
    import inspect
    from hpcdist.host import timeline
    from hpcdist.comm import collectives
    big, small = np.ones(1 << 18, np.float32), np.ones(2)

    def routes():
        comm.allreduce(small)
        comm.allreduce(small)                              # the memo
        comm.allreduce(small, algorithm="ring")
        comm.allreduce(big)
        comm.iallreduce(big).wait()
        comm.reduce_scatter(big)
        comm.allgather(np.ones(3), total=3 * comm.size)
        comm.bcast(big.copy())
        comm.reduce(small.copy())
        comm.allgatherv(np.ones(comm.rank + 1))
        comm.alltoall(np.ones(2 * comm.size))
        comm.ialltoall(np.ones(comm.size), counts=[1] * comm.size).wait()
        comm.barrier()
        comm.barrier()
    for recording in (False, True):
        if recording:
            timeline.activate(timeline.Recorder(comm.rank))
        try:
            seen = _stage_callers(routes)
        finally:
            timeline.deactivate()
        assert seen, "no stage was entered"
        for stage, callers in seen.items():
            assert callers == {"dispatch.py"}, (stage, callers, recording)
    for name, kind in vars(collectives).items():
        if isinstance(kind, collectives.Kind):
            for hook in ("check", "nbytes", "short_form", "fill", "extract", "run"):
                params = inspect.signature(getattr(kind, hook)).parameters
                assert "c" not in params, (name, hook)


def test_short_exchanges_count_the_bytes_that_cross_nodes(comm):
    """A short allreduce (recursive doubling) counts its payload sends to ranks on other nodes
    in ``bytes_inter_node`` (PowerSGD's small buffers at 4 nodes once counted 0 there). Nodes
    are declared here: even ranks on one, odd on another; the sends that cross are counted
    round by round against the exchange's own partners."""
    from hpcdist.comm.short import fold_rank, unfold_rank
    if comm.size == 1:
        pytest.skip("one rank sends nothing")
    wire = comm._wire
    saved = wire.node_of, wire.node
    P, r = comm.size, comm.rank
    wire.node_of = [q % 2 for q in range(P)]
    wire.node = wire.node_of[r]
    try:
        x = np.full(3, float(r + 1))
        comm.allreduce(x)                               # (the exchange made and cached once)
        sent, inter = wire.total()
        out = comm.allreduce(x)
        sent, inter = wire.total()[0] - sent, wire.total()[1] - inter
    finally:
        wire.node_of, wire.node = saved
    np.testing.assert_array_equal(out, np.full(3, P * (P + 1) / 2))
    pof2, new = fold_rank(r, P)                        # the partners this rank sends to
    partners = []
    if r < 2 * (P - pof2):
        partners.append(r + 1 if r % 2 == 0 else None)
    mask = 1
    while new >= 0 and mask < pof2:
        partners.append(unfold_rank(new ^ mask, P))
        mask <<= 1
    if r < 2 * (P - pof2) and r % 2 == 1:
        partners.append(r - 1)
    partners = [p for p in partners if p is not None]
    assert sent == len(partners) * x.nbytes, (sent, partners)
    assert inter == sum(x.nbytes for p in partners if p % 2 != r % 2), (inter, partners)
