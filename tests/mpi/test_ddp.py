"""Data-parallel training against its oracles: 1-rank training, bit-identical resume."""
import numpy as np
import pytest

from hpcdist.device import backend
from mpi4py import MPI

from hpcdist import checkpoint
from hpcdist.comm import Communicator
from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi


def _reference(cfg, out_dir):
    """The same run on one rank with a P-times larger batch (every rank computes it)."""
    solo = Communicator(MPI.COMM_SELF)
    try:
        return train(cfg, solo, log=lambda *a: None)["params"].copy()
    finally:
        solo.close()


@pytest.mark.parametrize("accum", [1, 2])
def test_n_ranks_equal_one_rank_with_n_times_the_batch(comm, tmp_path, accum):
    P = comm.size
    got = train(small(grad_accum=accum, out_dir=str(tmp_path / "ddp")), comm,
                log=lambda *a: None)["params"]
    ref = _reference(small(batch_size=3 * P * accum, out_dir=str(tmp_path / "ref")), None)
    # atol: parameters whose exact gradient is 0 get round-off gradients (~1e-18) that Adam's
    # eps-normalized step turns into ~1e-12 moves; every other entry agrees to 1e-10 relative.
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_many_small_buckets_and_no_overlap_agree(comm, tmp_path):
    a = train(small(bucket_mb=0.002, first_bucket_mb=0.001, out_dir=str(tmp_path / "a")), comm,
              log=lambda *a: None)["params"]
    b = train(small(overlap=False, out_dir=str(tmp_path / "b")), comm, log=lambda *a: None)["params"]
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_parameters_identical_on_every_rank(comm, tmp_path):
    p = train(small(compress="fp16", dtype="fp32", out_dir=str(tmp_path)), comm,
              log=lambda *a: None)["params"]
    everyone = np.empty((comm.size, p.size), dtype=p.dtype)
    comm.mpi.Allgather(p, everyone)
    assert (everyone == everyone[0]).all()


def test_no_sync_keeps_gradients_local(comm):
    import hpcdist as hd
    from hpcdist import nn
    from hpcdist.parallel import DistributedDataParallel
    nn.manual_seed(0)
    model = nn.MLP([3, 4, 2])
    ddp = DistributedDataParallel(model, comm)
    x = hd.tensor(np.full((2, 3), float(comm.rank + 1), np.float32))
    with ddp.no_sync():
        ddp(x).sum().backward()
    local = backend.to_numpy(ddp.flat.grad).copy()
    everyone = np.empty((comm.size, local.size), np.float32)
    comm.mpi.Allgather(local, everyone)
    assert comm.size == 1 or not (everyone == everyone[0]).all()     # nothing was averaged
    ddp(x).sum().backward()                                          # accumulates, then syncs
    ddp.sync_gradients()
    # averaged over ranks: each rank contributed its no_sync gradient twice
    np.testing.assert_allclose(ddp.flat.grad, 2 * everyone.mean(axis=0), rtol=1e-5)


@pytest.mark.parametrize("compress", ["none", "topk"])
def test_resume_is_bit_identical(comm, shared_dir, compress):
    if compress == "topk" and comm.size == 1:
        pytest.skip("topk needs more than one rank")
    kw = dict(steps=6, compress=compress, density=0.3, dtype="fp32", dropout=0.1,
              out_dir=shared_dir + f"/o_{compress}")
    full = train(small(**kw), comm, log=lambda *a: None)["params"].copy()
    save = shared_dir + f"/ckpt_{compress}"
    train(small(**kw, save_dir=save, save_every=3), comm, log=lambda *a: None)
    comm.barrier()
    if comm.rank == 0:       # as if the job had been stopped right after step 3's checkpoint
        with open(save + "/latest", "w") as f:
            f.write("step_00000003")
    comm.barrier()
    resumed = train(small(**kw, save_dir=save, resume=True), comm, log=lambda *a: None)["params"]
    np.testing.assert_array_equal(resumed, full)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(comm):
    from hpcdist import nn
    from hpcdist.parallel.mixed_precision import MixedPrecision
    nn.manual_seed(0)
    model = nn.MLP([3, 2])
    mp = MixedPrecision(model.parameters(), "fp16")
    mp.master.grad[...] = 1.0
    if comm.rank == comm.size - 1:
        mp.master.grad[0] = np.inf
    overflow = mp.unscale_and_check([comm])
    assert overflow
    scale = mp.scaler.scale
    assert not mp.scaler.update(overflow) and mp.scaler.hysteresis_left == 1
    assert not mp.scaler.update(True) and mp.scaler.scale == scale / 2


def test_corrupt_checkpoint_is_named_on_load(comm, shared_dir):
    save = shared_dir + "/corrupt"
    train(small(steps=2, save_dir=save, out_dir=save + "_o"), comm, log=lambda *a: None)
    folder = checkpoint.latest(save)
    comm.barrier()
    if comm.rank == 0:
        path = folder + "/rank_00000.npz"
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 0xFF
        open(path, "wb").write(bytes(raw))
    comm.barrier()
    with pytest.raises(checkpoint.CheckpointError, match="rank_00000.npz: checksum mismatch"):
        checkpoint.Reader(folder).tensor("param/wte.weight")