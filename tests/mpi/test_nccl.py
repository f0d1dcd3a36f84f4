"""The NCCL backend against MPI's built-ins, against the MPI backend and against the 1-rank
CPU run.

Where CuPy sees at least as many GPUs as there are ranks (NCCL refuses two ranks on one GPU),
the suite runs on the real NCCL; elsewhere on the NCCL stand-in
(device/standin_nccl.py: every call bound to CuPy's typed signature, the data moved by MPI's
built-ins), so the NCCL backend's whole protocol runs in every ``make test``.
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.device import backend
from hpcdist.comm import Communicator, shard_bounds
from hpcdist.comm.nccl import NcclCommunicator, pack_unique_id, unpack_unique_id
from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi


def test_unique_id_round_trips_in_both_spellings():
    raw = bytes(range(128))
    assert unpack_unique_id(pack_unique_id(raw)) == raw                  # CuPy 14: bytes
    chars = tuple(np.arange(-64, 64, dtype=np.int64))
    assert unpack_unique_id(pack_unique_id(chars)) == chars              # earlier: tuple
    with pytest.raises(ValueError, match="128"):
        pack_unique_id(b"short")


@pytest.fixture(scope="module")
def nccl(comm):
    """The NCCL backend on the real NCCL (a GPU per rank) or on the NCCL stand-in."""
    device = "gpu" if backend.gpu_count() >= comm.size else "standin"
    backend.init(device, comm.local_rank)
    nc = NcclCommunicator(comm.mpi)
    nc.device = device
    yield nc
    nc.close()
    backend.init("cpu")


def test_the_stand_in_refuses_what_cupy_refuses(comm, nccl):
    """An id of CuPy 13's spelling (a tuple), or a float count, is a TypeError, as in CuPy."""
    if nccl.device != "standin":
        pytest.skip("the real NCCL is here")
    nccl_mod = backend.nccl_module()
    with pytest.raises(TypeError, match="commId must be bytes"):
        nccl_mod.NcclCommunicator(comm.size, tuple(range(128)), comm.rank)
    x = backend.xp().ones(3, dtype=backend.xp().float32)
    with pytest.raises(TypeError, match="count must be size_t"):
        nccl.comm.allReduce(x.data.ptr, x.data.ptr, 3.0, nccl_mod.NCCL_FLOAT32,
                            nccl_mod.NCCL_SUM, 0)


def test_nccl_collectives_match_mpi(comm, nccl):
    xp = backend.xp()
    P, r = comm.size, comm.rank
    for n in (1, P + 1, 1000, 65_537):
        x = np.random.default_rng(r + n).integers(-9, 10, n).astype(np.float32)
        ref = np.empty_like(x)
        comm.mpi.Allreduce(x, ref, op=MPI.SUM)
        np.testing.assert_array_equal(backend.to_numpy(nccl.allreduce(xp.asarray(x))), ref)
        np.testing.assert_allclose(backend.to_numpy(nccl.allreduce(xp.asarray(x), op="avg")),
                                   ref / P, rtol=1e-6)
        lo, hi = shard_bounds(n, P, r)
        np.testing.assert_array_equal(
            backend.to_numpy(nccl.reduce_scatter(xp.asarray(x))), ref[lo:hi])
        np.testing.assert_array_equal(
            backend.to_numpy(nccl.allgather(xp.asarray(ref[lo:hi]), total=n)), ref)
        y = xp.asarray(x)
        nccl.bcast(y, root=P - 1)
        expect = np.random.default_rng(P - 1 + n).integers(-9, 10, n).astype(np.float32)
        np.testing.assert_array_equal(backend.to_numpy(y), expect)


def test_bf16_arrays_go_over_nccl_as_bf16(comm, nccl):
    """Native bf16 (tensor-parallel activations, pipeline sends): NCCL's bfloat16, summed to
    the same values as MPI's float32 sum rounded once (small integers: exact either way)."""
    xp, bf16 = backend.xp(), backend.bfloat16()
    P, r = comm.size, comm.rank
    for n in (1, P + 1, 1000):
        x = np.random.default_rng(r + n).integers(-9, 10, n).astype(np.float32)
        ref = np.empty_like(x)
        comm.mpi.Allreduce(x, ref, op=MPI.SUM)
        got = nccl.allreduce(xp.asarray(x.astype(bf16)))
        assert got.dtype == bf16
        np.testing.assert_array_equal(backend.to_numpy(got).astype(np.float32), ref)
        lo, hi = shard_bounds(n, P, r)
        np.testing.assert_array_equal(
            backend.to_numpy(nccl.reduce_scatter(xp.asarray(x.astype(bf16)))).astype(
                np.float32), ref[lo:hi])
        full = nccl.allgather(xp.asarray(ref[lo:hi].astype(bf16)), total=n)
        np.testing.assert_array_equal(backend.to_numpy(full).astype(np.float32), ref)
        if P > 1:
            got = nccl.sendrecv(xp.asarray(x.astype(bf16)), (r + 1) % P, (r - 1) % P)
            want = np.random.default_rng((r - 1) % P + n).integers(-9, 10, n)
            np.testing.assert_array_equal(backend.to_numpy(got).astype(np.float32), want)


def test_nccl_alltoall_matches_mpi(comm, nccl):
    """Grouped sends and receives: equal pieces, and uneven ones with zeros (the sizes over
    MPI first, or given), against MPI's Alltoallv; blocking and non-blocking."""
    xp, P, r = backend.xp(), comm.size, comm.rank
    for counts in (None, [(j * r) % 4 for j in range(P)]):
        c = counts or [3] * P
        x = np.random.default_rng(r).integers(-9, 10, sum(c)).astype(np.float32)
        incoming = np.empty(P, dtype=np.int64)
        comm.mpi.Alltoall(np.array(c, dtype=np.int64), incoming)
        want = np.empty(int(incoming.sum()), dtype=np.float32)
        comm.mpi.Alltoallv([x, c], [want, incoming])
        got = nccl.alltoall(xp.asarray(x), counts=counts)
        np.testing.assert_array_equal(np.concatenate([backend.to_numpy(g) for g in got]), want)
        h = nccl.ialltoall(xp.asarray(x), counts=counts, recv_counts=list(incoming))
        np.testing.assert_array_equal(np.concatenate([backend.to_numpy(g) for g in h.wait()]),
                                      want)


def test_both_backends_run_one_suite_alike(comm, nccl):
    """The same calls on the MPI Communicator (with GPU arrays) and on NCCL give the same
    arrays: blocking and non-blocking reduce-scatter and allgather, reduce, sendrecv round a
    ring, and a split; the calls NCCL refuses say so by name."""
    xp = backend.xp()
    P, r = comm.size, comm.rank
    for n in (1, P + 3, 4099):
        x = xp.asarray(np.random.default_rng(7 * r + n).integers(-9, 10, n).astype(np.float32))
        same = [(comm.allreduce(x), nccl.allreduce(x)),
                (comm.reduce_scatter(x), nccl.reduce_scatter(x)),
                (comm.ireduce_scatter(x).wait(), nccl.ireduce_scatter(x).wait())]
        lo, hi = shard_bounds(n, P, r)
        piece = xp.ascontiguousarray(x[lo:hi])
        same += [(comm.allgather(piece, total=n), nccl.allgather(piece, total=n)),
                 (comm.iallgather(piece, total=n).wait(), nccl.iallgather(piece, total=n).wait()),
                 (comm.sendrecv(x, (r + 1) % P, (r - 1) % P),
                  nccl.sendrecv(x, (r + 1) % P, (r - 1) % P))]
        for got_mpi, got_nccl in same:
            np.testing.assert_array_equal(backend.to_numpy(got_mpi), backend.to_numpy(got_nccl))
        a, b = comm.reduce(x, root=P - 1), nccl.reduce(x, root=P - 1)
        assert (a is None) == (b is None) == (r != P - 1)
        if a is not None:
            np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
    half = nccl.split(r % 2)
    try:
        mpi_half = comm.split(r % 2)
        y = xp.ones(5, dtype=xp.float32) * (r + 1)
        np.testing.assert_array_equal(backend.to_numpy(half.allreduce(y)),
                                      backend.to_numpy(mpi_half.allreduce(y)))
        mpi_half.close()
    finally:
        half.close()
    with pytest.raises(NotImplementedError, match="sparse_allreduce is not in the NCCL"):
        nccl.sparse_allreduce(xp.ones(3), k=1)


def test_pieces_of_other_sizes_match_mpi(comm, nccl):
    """reduce_scatter and allgather with counts (zeros included; NCCL pads each piece to the
    largest), allgatherv, against MPI's built-ins."""
    xp, P, r = backend.xp(), comm.size, comm.rank
    for counts in ([1] * P, [(3 * j + 1) % 4 for j in range(P)], [0] * (P - 1) + [5]):
        n = sum(counts)
        x = np.random.default_rng(r + n).integers(-9, 10, n).astype(np.float64)
        ref = np.empty_like(x)
        comm.mpi.Allreduce(x, ref, op=MPI.SUM)
        lo = sum(counts[:r])
        np.testing.assert_array_equal(
            backend.to_numpy(nccl.reduce_scatter(xp.asarray(x), counts=counts)),
            ref[lo:lo + counts[r]])
        mine = ref[lo:lo + counts[r]].copy()
        np.testing.assert_array_equal(
            backend.to_numpy(nccl.iallgather(xp.asarray(mine), counts=counts).wait()), ref)
        np.testing.assert_array_equal(backend.to_numpy(nccl.allgatherv(xp.asarray(mine))), ref)


def test_point_to_point_rings_batch_into_groups(comm, nccl):
    """isend/irecv round a ring both ways, posted before any wait (one NCCL group), with
    pieces of each rank's own length: what MPI's Sendrecv moves; a receive posted with the
    wrong shape, or out of the sender's order, is named."""
    xp, P, r = backend.xp(), comm.size, comm.rank
    nxt, prev = (r + 1) % P, (r - 1) % P
    mine = np.arange(r + 2, dtype=np.float32) + 10 * r           # rank r holds r + 2 values
    want = {}
    for dest, src in ((nxt, prev), (prev, nxt)):
        want[src] = np.empty(src + 2, dtype=np.float32)
        comm.mpi.Sendrecv(mine, dest, 5, want[src], src, 5)
    hs = [nccl.isend(xp.asarray(mine), nxt, 5), nccl.isend(xp.asarray(mine), prev, 6)]
    got = [nccl.irecv(prev, 5, shape=(prev + 2,), dtype=np.float32),
           nccl.irecv(nxt, 6, shape=(nxt + 2,), dtype=np.float32)]
    np.testing.assert_array_equal(backend.to_numpy(got[0].wait()), want[prev])
    np.testing.assert_array_equal(backend.to_numpy(got[1].wait()), want[nxt])
    for h in hs:
        assert h.wait() is None
    with pytest.raises(NotImplementedError, match="needs the shape and dtype"):
        nccl.irecv(prev, 7)
    if P == 1 or nccl.device == "gpu":     # (the real NCCL may hang on mismatched counts)
        return
    # the receiver expects one value more than rank prev sends
    h = nccl.isend(xp.asarray(mine), nxt, 8)
    bad = nccl.irecv(prev, 8, shape=(prev + 2,), dtype=np.float32) if r % 2 else \
        nccl.irecv(prev, 8, shape=(prev + 3,), dtype=np.float32)
    if r % 2:
        bad.wait()
    else:
        with pytest.raises(RuntimeError, match="NCCL point-to-point mismatch"):
            bad.wait()
    h.wait()


def test_blocking_and_queued_point_to_point_share_one_numbering(comm, nccl):
    """Blocking sends answered by queued receives and queued sends answered by blocking
    receives, in turns: each message takes the next number between the two ranks (a blocking
    send once numbered every message 0, and the second queued receive called it a mismatch)."""
    if comm.size < 2:
        pytest.skip("point-to-point needs two ranks")
    xp, r = backend.xp(), comm.rank
    if r > 1:
        return
    peer = 1 - r
    for i in range(3):
        x = xp.asarray(np.full(i + 1, 10.0 * r + i, dtype=np.float32))
        if r == 0:
            nccl.send(x, peer, tag=20 + i)
            got = nccl.irecv(peer, 30 + i, shape=(i + 1,), dtype=np.float32).wait()
        else:
            got = nccl.irecv(peer, 20 + i, shape=(i + 1,), dtype=np.float32).wait()
            nccl.isend(x, peer, 30 + i).wait()
        np.testing.assert_array_equal(backend.to_numpy(got), np.full(i + 1, 10.0 * peer + i))
        y = xp.asarray(np.full(2, 5.0 * r + i, dtype=np.float32))
        h = nccl.isend(y, peer, 40 + i)
        np.testing.assert_array_equal(backend.to_numpy(nccl.recv(peer, 40 + i)),
                                      np.full(2, 5.0 * peer + i))
        h.wait()


def test_mismatched_nccl_collectives_are_named_by_the_ledger(comm, nccl):
    """NCCL calls are numbered and agreed like MPI's: a rank calling with another size, or
    another collective, is an error on every rank naming both sides, before NCCL moves data."""
    from hpcdist.comm.ledger import CollectiveMismatchError
    xp, P = backend.xp(), comm.size
    if P == 1:
        pytest.skip("one rank agrees with itself")
    n = 4 + (comm.rank == 1)
    with pytest.raises(CollectiveMismatchError, match=r"rank 1: call #\d+ allreduce 5 x float32"):
        nccl.allreduce(xp.ones(n, dtype=xp.float32))
    with pytest.raises(CollectiveMismatchError, match=r"bcast .* root 0"):
        if comm.rank == 1:
            nccl.bcast(xp.ones(3, dtype=xp.float32), root=0)
        else:
            nccl.allgather(xp.ones(3, dtype=xp.float32))
    np.testing.assert_array_equal(                    # and the communicator goes on
        backend.to_numpy(nccl.allreduce(xp.ones(2, dtype=xp.float32))), [P, P])


def test_host_arrays_take_the_mpi_path(comm, nccl):
    """Losses, norms and flags are NumPy arrays: the NCCL communicator hands them to MPI."""
    P = comm.size
    got = nccl.allreduce(np.array([comm.rank + 1.0]), op="sum")
    assert isinstance(got, np.ndarray) and got[0] == P * (P + 1) / 2
    before = sum(n for n, _ in nccl.calls.values())
    nccl.allgather(np.array([comm.rank], dtype=np.int64))
    assert sum(n for n, _ in nccl.calls.values()) == before    # no NCCL call made


def test_nccl_training_follows_the_cpu_run(comm, tmp_path, nccl):
    solo = Communicator(MPI.COMM_SELF)
    try:
        ref = train(small(device="cpu", batch_size=3 * comm.size, out_dir=str(tmp_path / "r")),
                    solo, log=lambda *a: None)
    finally:
        solo.close()
    got = train(small(device=nccl.device, backend="nccl", out_dir=str(tmp_path / "n")), comm,
                log=lambda *a: None)
    h = lambda f: np.array([[s["loss"], s["grad_norm"]] for s in f["history"]])  # noqa: E731
    np.testing.assert_allclose(h(got), h(ref), rtol=1e-9)


# ---- the real library's id through hpcdist's bootstrap (no GPU needed: make test-cupy) -----

_PY_TYPES = {"int": int, "size_t": int, "intptr_t": int, "bytes": bytes}


def _call_problems(typed_text: str, args) -> list:
    """Which of ``args`` do not have the C type ``typed_text`` gives their parameter."""
    from hpcdist.device.standin import typed_parameters
    out = []
    for (ctype, name), value in zip(typed_parameters(typed_text), args):
        want = _PY_TYPES.get(ctype)
        if want is not None and type(value) is not want:
            out.append(f"{name}: {ctype} wanted, got {type(value).__name__} {value!r:.40}")
    return out


def _bootstrap(comm, monkeypatch, real):
    """hpcdist's NcclCommunicator built over ``comm`` with the real NCCL module, except for
    the communicator class, which records the call hpcdist makes (creating a real one needs
    a GPU)."""
    import types
    import hpcdist.comm.nccl as hn
    calls = []

    class Recorder:
        def __init__(self, *args):
            calls.append(args)

        def destroy(self):
            pass

    fake = types.SimpleNamespace(get_unique_id=real.get_unique_id, NcclCommunicator=Recorder,
                                 groupStart=real.groupStart, groupEnd=real.groupEnd)
    monkeypatch.setattr(backend, "nccl_module", lambda: fake)
    nc = hn.NcclCommunicator(comm.mpi)
    nc.close()
    return calls[0]


def test_the_real_nccl_id_reaches_the_constructor_as_cupy_declares_it(comm, monkeypatch):
    # cupy.cuda, not cupy: without CuPy, tests/cupy on sys.path imports as a namespace package
    pytest.importorskip("cupy.cuda", reason="CuPy is not installed: make test-cupy installs it")
    from cupy.cuda import nccl as real
    import sys
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/cupy")
    import surface
    declared = surface.real_signature_text(real.NcclCommunicator)   # CuPy's own, typed
    args = _bootstrap(comm, monkeypatch, real)
    assert _call_problems(declared, args) == []
    assert args[0] == comm.size and args[2] == comm.rank
    ids = np.empty((comm.size, 128), dtype=np.uint8)            # MPI's Allgather: the oracle
    comm.mpi.Allgather(np.frombuffer(args[1], dtype=np.uint8), ids)
    assert (ids == ids[0]).all(), "every rank must get rank 0's id"

    # planted: the id handed over in CuPy 13's spelling (a tuple of chars) is caught
    import hpcdist.comm.nccl as hn
    monkeypatch.setattr(hn, "unpack_unique_id",
                        lambda packed: tuple(int(b) for b in packed[:128].view(np.int8)))
    bad = _bootstrap(comm, monkeypatch, real)
    problems = _call_problems(declared, bad)
    assert problems and problems[0].startswith("commId: bytes wanted, got tuple"), problems
