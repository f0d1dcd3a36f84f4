"""Every documented training mode runs past its first steps (--precision fp16 once crashed at
its second step on any number of ranks, and no test ran it that far)."""
import numpy as np
import pytest

from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi

MODES = [(p, z, "none") for p in ("fp32", "fp16", "bf16") for z in (0, 1, 2, 3)] + \
        [(p, 0, c) for p in ("fp32", "fp16", "bf16") for c in ("fp16", "topk")]


@pytest.mark.parametrize("precision, zero, compress", MODES)
def test_mode_trains_several_steps(comm, tmp_path, precision, zero, compress):
    if compress == "topk" and comm.size == 1:
        pytest.skip("topk compresses nothing on one rank (refused by the configuration)")
    cfg = small(precision=precision, zero=zero, compress=compress, dtype="fp32", steps=4,
                log_every=1, loss_scale=1024.0, out_dir=str(tmp_path))
    final = train(cfg, comm, log=lambda *a: None)
    assert final["event"] == "final" and final["steps"] == 4
    assert np.isfinite(final["train_loss"]) and np.isfinite(final["test_loss"])
    p = np.ascontiguousarray(final["params"], dtype=np.float32)
    everyone = np.empty((comm.size, p.size), np.float32)
    comm.mpi.Allgather(p, everyone)
    assert (everyone == everyone[0]).all(), "replicas differ after training"
