"""The NCCL backend against MPI's built-ins and against the 1-rank CPU run.

Runs where CuPy sees at least as many GPUs as there are ranks (NCCL refuses two ranks on one
GPU): at 1 rank on any GPU machine (``make test-gpu``), at N ranks on a node with N GPUs;
elsewhere it skips and says why.
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist import backend
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
    if backend.gpu_count() < comm.size:
        pytest.skip(f"NCCL needs a GPU per rank: {backend.gpu_count()} visible, "
                    f"{comm.size} ranks")
    backend.init("gpu", comm.local_rank)
    nc = NcclCommunicator(comm.mpi)
    yield nc
    nc.close()
    backend.init("cpu")


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


def test_nccl_training_follows_the_cpu_run(comm, tmp_path, nccl):
    solo = Communicator(MPI.COMM_SELF)
    try:
        ref = train(small(device="cpu", batch_size=3 * comm.size, out_dir=str(tmp_path / "r")),
                    solo, log=lambda *a: None)
    finally:
        solo.close()
    got = train(small(device="gpu", backend="nccl", out_dir=str(tmp_path / "n")), comm,
                log=lambda *a: None)
    h = lambda f: np.array([[s["loss"], s["grad_norm"]] for s in f["history"]])  # noqa: E731
    np.testing.assert_allclose(h(got), h(ref), rtol=1e-9)
