"""ZeRO-1, -2 and -3 against ZeRO-0 (plain DDP): same trajectory, exact memory, exact resume."""
import numpy as np
import pytest

from hpcdist.comm import shard_bounds
from hpcdist.train import train

import helpers

pytestmark = pytest.mark.mpi


def small(**kw):
    """Two blocks (ZeRO-3 gathers per block) and small buckets (several per step)."""
    return helpers.small(**{"n_layer": 2, "bucket_mb": 0.004, "first_bucket_mb": 0.002, **kw})


def quiet(*a, **k):
    pass


@pytest.mark.parametrize("extra", [{}, {"grad_clip": 0.05, "grad_accum": 2}])
def test_levels_follow_level_zero(comm, tmp_path, extra):
    ref = train(small(**extra, out_dir=str(tmp_path / "z0")), comm, log=quiet)
    for level in (1, 2, 3):
        got = train(small(**extra, zero=level, out_dir=str(tmp_path / f"z{level}")), comm,
                    log=quiet)
        np.testing.assert_allclose(got["params"], ref["params"], rtol=1e-10, atol=1e-10,
                                   err_msg=f"ZeRO-{level}")
        assert got["accuracy"] == ref["accuracy"]


def test_zero3_with_recomputation_follows_level_zero(comm, tmp_path):
    """A recomputed block gathers its parameters once and keeps them to the end of its
    backward: the trajectory of ZeRO-0 without recomputation, the bytes of ZeRO-3 without."""
    kw = dict(dropout=0.1, grad_accum=2, grad_clip=0.05)    # dropout: the masks are replayed
    ref = train(small(**kw, out_dir=str(tmp_path / "z0")), comm, log=quiet)
    plain = train(small(**kw, zero=3, out_dir=str(tmp_path / "z3")), comm, log=quiet)
    got = train(small(**kw, zero=3, checkpoint_activations=True, out_dir=str(tmp_path / "r")),
                comm, log=quiet)
    np.testing.assert_allclose(got["params"], ref["params"], rtol=1e-10, atol=1e-10)
    assert [r["bytes_sent"] for r in got["history"]] == \
        [r["bytes_sent"] for r in plain["history"]]
    assert got["history"][0]["bytes_sent"] > 0 or comm.size == 1


def test_memory_is_exactly_the_sharded_state_fp32(comm, tmp_path):
    P = comm.size
    psi = None
    for level in (0, 1, 2, 3):
        final = train(small(zero=level, dtype="fp32", out_dir=str(tmp_path / str(level))), comm,
                      log=quiet)
        psi = final["params"].size
        lo, hi = shard_bounds(psi, P, comm.rank)
        n = hi - lo
        peak = final["memory_peak"]
        expected_opt = {0: 8 * psi, 1: 8 * n, 2: 8 * n, 3: 8 * n}[level]     # Adam m and v
        assert peak["optimizer"] == expected_opt, (level, peak)
        if level < 3:
            assert peak["params"] == 4 * psi                 # full fp32 parameters
        else:
            assert peak["params"] >= 4 * n                   # shard + gathered working set
        if level <= 1:
            assert peak["grads"] == 4 * psi                  # the full gradient buffer


def test_mixed_precision_and_identical_ranks(comm, tmp_path):
    for level in (1, 2, 3):
        final = train(small(zero=level, dtype="fp32", precision="bf16", steps=6,
                            out_dir=str(tmp_path / str(level))), comm, log=quiet)
        p = final["params"]
        assert p.dtype == np.float32 and np.isfinite(p).all()
        everyone = np.empty((comm.size, p.size), p.dtype)
        comm.mpi.Allgather(np.ascontiguousarray(p), everyone)
        assert (everyone == everyone[0]).all()


@pytest.mark.parametrize("level", [1, 3])
def test_resume_is_bit_identical(comm, shared_dir, level):
    kw = dict(zero=level, steps=6, dtype="fp32", dropout=0.1, out_dir=shared_dir + f"/o{level}")
    full = train(small(**kw), comm, log=quiet)["params"].copy()
    save = shared_dir + f"/ckpt{level}"
    train(small(**kw, save_dir=save, save_every=3), comm, log=quiet)
    comm.barrier()
    if comm.rank == 0:
        with open(save + "/latest", "w") as f:
            f.write("step_00000003")
    comm.barrier()
    resumed = train(small(**kw, save_dir=save, resume=True), comm, log=quiet)["params"]
    np.testing.assert_array_equal(resumed, full)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_non_finite_gradient_skips_the_step_on_every_rank(comm, tmp_path, level):
    """Without a loss scaler, a NaN in one rank's gradient shard skips the update on every
    rank (seen in the global sum of squares, which is read anyway: no extra device read)."""
    from hpcdist import data
    from hpcdist.parallel.strategy import build_strategy
    cfg = small(zero=level, out_dir=str(tmp_path))
    _, strategy = build_strategy(cfg, comm, data.datasets_of(cfg)[0])
    strategy.zero_grad()
    before = np.array(strategy.full_parameters(), copy=True)
    if comm.rank == comm.size - 1 and strategy.grad_shard.size:
        strategy.grad_shard[0] = np.nan
    assert strategy.apply(1e-2, 0.0) == (False, None)
    np.testing.assert_array_equal(strategy.full_parameters(), before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fp16_gradients_average_without_overflowing_their_sum(comm, dtype):
    """ZeRO's and hybrid sharding's averages (parallel/mixed_precision.averaging): fp16 is
    divided by the world first, so ranks whose gradients sum past 65,504 still average to a
    finite value, equal to the fp64 mean; other dtypes average as before."""
    from hpcdist.parallel.mixed_precision import averaging
    ml = pytest.importorskip("ml_dtypes") if dtype == "bfloat16" else None
    dt = ml.bfloat16 if ml else np.dtype(dtype)
    n = 5 * comm.size
    values = 40000.0 + 1000.0 * np.arange(n) / n + 24.0 * comm.rank
    g = values.astype(dt)
    want = np.mean([(40000.0 + 1000.0 * np.arange(n) / n + 24.0 * r).astype(dt)
                    .astype(np.float64) for r in range(comm.size)], axis=0)
    op = averaging(g, comm.size)
    assert op == ("sum" if dtype == "float16" and comm.size > 1 else "avg")
    got = comm.reduce_scatter(g, op).astype(np.float64)
    lo, hi = shard_bounds(n, comm.size, comm.rank)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want[lo:hi], rtol=2 ** -7 if dtype == "bfloat16" else 2e-3)
