"""Pipeline parallelism against the 1-rank run: in fp64 the per-step loss and gradient norm of
every schedule, split and layout equal it to rel 1e-10; the stash stays within its bound."""
import functools

import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.comm import Communicator
from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi

BATCH = 9          # per replica: enough for 2P + 1 micro-batches at P = 4


def _history(cfg, comm):
    final = train(cfg, comm, log=lambda *a: None)
    return final, np.array([[r["loss"], r["grad_norm"]] for r in final["history"]])


@functools.lru_cache(maxsize=None)
def _reference(n_layer, tie, batch, ckpt):
    """The 1-rank run with the global batch (computed once per model on every rank)."""
    solo = Communicator(MPI.COMM_SELF)
    try:
        cfg = small(n_layer=n_layer, tie_weights=tie, batch_size=batch, grad_clip=1.0,
                    checkpoint_activations=ckpt, out_dir=f"/tmp/hpcdist-pp-ref-{MPI.COMM_WORLD.Get_rank()}")
        return _history(cfg, solo)[1]
    finally:
        solo.close()


def _check(comm, tmp_path, P, tp=1, **kw):
    replicas = comm.size // (P * tp)
    cfg = small(pp=P, tp=tp, batch_size=BATCH, grad_clip=1.0, out_dir=str(tmp_path), **kw)
    if tp > 1:
        cfg.n_head, cfg.n_embd = 4, 16
    final, got = _history(cfg, comm)
    ref_kw = dict(n_layer=cfg.n_layer, tie=cfg.tie_weights, batch=BATCH * replicas,
                  ckpt=cfg.checkpoint_activations)
    if tp > 1:    # a different (wider-headed) model: its own reference
        solo = Communicator(MPI.COMM_SELF)
        try:
            ref = _history(small(n_layer=cfg.n_layer, n_head=4, n_embd=16, batch_size=BATCH *
                                 replicas, grad_clip=1.0, out_dir=str(tmp_path / "ref")),
                           solo)[1]
        finally:
            solo.close()
    else:
        ref = _reference(**ref_kw)
    np.testing.assert_allclose(got, ref, rtol=1e-10, err_msg=str(kw))
    return final


def _pipeline_sizes(world):
    return [P for P in (2, 3, 4) if world % P == 0]


def test_every_schedule_follows_the_one_rank_run(comm, tmp_path):
    # the whole pipeline at world sizes 2, 3, 4 (DP x PP: the ZeRO-1 and 3D tests below)
    if comm.size not in (2, 3, 4):
        pytest.skip("the schedule matrix runs with world size = P in 2, 3, 4")
    for P in [comm.size]:
        for m in sorted({1, P - 1, P, 2 * P + 1}):
            for schedule in ("gpipe", "1f1b", "zb-h1"):
                _check(comm, tmp_path / f"{schedule}{P}{m}", P, n_layer=P, micro_batches=m,
                       schedule=schedule)
            if m % P == 0:
                _check(comm, tmp_path / f"il{P}{m}", P, n_layer=2 * P, micro_batches=m,
                       schedule="interleaved", virtual_stages=2)


def test_uneven_split_untied_checkpointed_and_zero1(comm, tmp_path):
    sizes = _pipeline_sizes(comm.size)
    if not sizes:
        pytest.skip(f"no pipeline size in 2, 3, 4 divides {comm.size} ranks")
    P = sizes[0]
    _check(comm, tmp_path / "uneven", P, n_layer=2 * P + 1, micro_batches=P)     # 5 on 2
    split = ",".join(["1"] * (P - 1) + [str(P + 1)])
    _check(comm, tmp_path / "split", P, n_layer=2 * P, pp_split=split, schedule="zb-h1")
    _check(comm, tmp_path / "untied", P, n_layer=P, tie_weights=False)
    _check(comm, tmp_path / "ckpt", P, n_layer=P, checkpoint_activations=True)
    # fewer blocks than stages: at P = 4, 2 blocks go to the middle stages (embed | 1 | 1 | head)
    _check(comm, tmp_path / "few", sizes[-1], n_layer=max(1, sizes[-1] - 2), schedule="zb-h1")
    if comm.size // P > 1:
        _check(comm, tmp_path / "zero1", P, n_layer=P, zero=1)


def test_data_tensor_and_pipeline_parallel_together(comm, tmp_path):
    if comm.size != 8:
        pytest.skip("DP 2 x TP 2 x PP 2 needs 8 ranks")
    _check(comm, tmp_path / "3d", 2, tp=2, n_layer=2, micro_batches=3, schedule="1f1b")
    _check(comm, tmp_path / "3dsp", 2, tp=2, n_layer=4, sequence_parallel=True,
           micro_batches=4, schedule="interleaved", virtual_stages=2)


def test_measured_stash_1f1b_against_gpipe(comm, tmp_path):
    sizes = _pipeline_sizes(comm.size)
    if not sizes:
        pytest.skip(f"no pipeline size in 2, 3, 4 divides {comm.size} ranks")
    from hpcdist.comm.mesh import mesh_coords
    P, m = sizes[-1], 8
    for schedule, bound in (("1f1b", lambda s: min(P - s, m)), ("gpipe", lambda s: m)):
        cfg = small(pp=P, n_layer=P, batch_size=8, micro_batches=m, schedule=schedule, steps=1,
                    out_dir=str(tmp_path / schedule))
        from hpcdist.parallel.strategy import build_strategy
        from hpcdist import data
        train_set, _ = data.make_task("sort", length=4, num_digits=4)
        model, strategy = build_strategy(cfg, comm, train_set)
        x, y = train_set.batch(np.arange(8))
        strategy.zero_grad()
        strategy.forward_backward(x, y)
        s = mesh_coords(comm.rank, comm.size // P, 1, P).pp
        assert strategy.peak_stash == bound(s), (schedule, s, strategy.peak_stash)


# Mixed precision under pipelines: the same precision without PP is the oracle; the runs part
# only by rounding (activations cross stages in the compute precision; the micro-batches'
# gradients add up in another order), so the tolerance is stated, not 1e-10. The runs agree
# to rounding for the first steps and then drift apart (bf16: chaotically, a step's loss later
# differs by up to 13% either way), so: the first 3 steps within 1%, each step of the first
# half within MP_TOL, the mean of the last 5 within MP_TAIL. Measured 2026-11-27 (2 and 4
# ranks, CPU and the GPU stand-in, 1F1B, interleaved, ZB-H1): first half 0.05-5.6%, all 20
# steps 0.3-13.2%, the last 5 steps' mean 0.1-6.4%.
MP_TOL, MP_TAIL = 0.08, 0.1


@functools.lru_cache(maxsize=None)
def _mp_reference(precision, batch):
    solo = Communicator(MPI.COMM_SELF)
    try:
        cfg = small(**{**_MP, "batch_size": batch}, precision=precision,
                    out_dir=f"/tmp/hpcdist-pp-mp-{MPI.COMM_WORLD.Get_rank()}")
        return _history(cfg, solo)
    finally:
        solo.close()


_MP = dict(n_layer=4, dtype="fp32", steps=20, batch_size=16, lr=3e-3, min_lr=3e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_pipelines_follow_the_same_precision_without_pp(comm, tmp_path,
                                                                       precision):
    if comm.size not in (2, 4):
        pytest.skip("PP 2 (x DP 2) runs at 2 and 4 ranks")
    replicas = comm.size // 2
    ref_final, ref = _mp_reference(precision, 16 * replicas)
    skipped = set()
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        final, got = _history(small(**_MP, precision=precision, pp=2, schedule=schedule,
                                    virtual_stages=v, zero=replicas > 1,
                                    out_dir=str(tmp_path / schedule)), comm)
        diff = np.abs(got[:, 0] - ref[:, 0]) / ref[:, 0]
        assert diff[:3].max() <= 0.01, (schedule, diff[:3])
        assert diff[:len(ref) // 2].max() <= MP_TOL, (schedule, diff)
        assert abs(got[-5:, 0].mean() / ref[-5:, 0].mean() - 1) <= MP_TAIL, schedule
        skipped.add(final["skipped_steps"])
        p = np.ascontiguousarray(final["params"])       # this stage's parameters
        stage = comm.mpi.Split(color=comm.rank // replicas)   # rank = pp * DP + dp
        everyone = np.empty((replicas, p.size), p.dtype)
        stage.Allgather(p, everyone)
        stage.Free()
        assert (everyone == everyone[0]).all()         # the replicas of a stage agree
    # fp16's overflows (skipped steps) are the gradients' own since the loss is float32: the
    # schedules run the same micro-batches and skip the same steps. An overflow is a gradient
    # crossing 65,504 at the scale, so rounding decides a near one: the one-process run skips
    # about as many, its scale at most two halvings (2 skips each, at hysteresis 2) from the
    # pipelines'. Measured 2026-12-02: 3 vs 4 at 2 ranks (steps 4, 5 in both, 16 under PP),
    # 2 vs 5 at 4 ranks (steps 16-17 in one process, 9-12 under PP).
    assert len(skipped) == 1, skipped
    assert abs(skipped.pop() - ref_final["skipped_steps"]) <= 4, ref_final["skipped_steps"]


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(comm, tmp_path):
    if comm.size % 2:
        pytest.skip("PP 2 needs an even world")
    from hpcdist import data
    from hpcdist.parallel.strategy import build_strategy
    cfg = small(pp=2, n_layer=2, dtype="fp32", precision="fp16", out_dir=str(tmp_path))
    _, strategy = build_strategy(cfg, comm, data.datasets_of(cfg)[0])
    strategy.zero_grad()
    before = np.array(strategy.full_parameters(), copy=True)
    scale = strategy.scaler.scale
    if comm.rank == comm.size - 1:                 # the last stage of the last replica only
        strategy.inner.mp.master.grad[0] = np.inf
    assert strategy.apply(1e-2, 0.0) == (False, None)
    np.testing.assert_array_equal(strategy.full_parameters(), before)
    assert strategy.scaler.skipped == 1 and strategy.scaler.scale <= scale


def test_each_stage_compresses_its_data_parallel_reduction(comm, tmp_path):
    """PP 2 x DP 2: each stage's DP reduction compressed. The fp16 wire rounds element by
    element, so it follows the same compression without PP (per-step loss to 1e-3); Top-K and
    PowerSGD choose per bucket or matrix of a stage (other choices than one model's), so they
    are held to training: the loss falls and the replicas of a stage stay identical."""
    if comm.size != 4:
        pytest.skip("PP 2 x DP 2 needs 4 ranks")
    sub = Communicator(comm.mpi.Split(color=comm.rank // 2, key=comm.rank))   # one stage's DP
    try:
        for method in ("fp16", "topk", "powersgd"):
            kw = dict(n_layer=2, steps=8, batch_size=6, compress=method, powersgd_start=0,
                      density=0.3)
            final, got = _history(small(**kw, pp=2, out_dir=str(tmp_path / method)), comm)
            if method == "fp16":
                ref = _history(small(**kw, out_dir=str(tmp_path / f"dp{comm.rank}")), sub)[1]
                np.testing.assert_allclose(got[:, 0], ref[:, 0], rtol=1e-3)
            assert got[-3:, 0].mean() < got[:3, 0].mean(), method
            p = np.ascontiguousarray(final["params"])
            both = np.empty((2, p.size), p.dtype)
            sub.mpi.Allgather(p, both)
            assert (both[0] == both[1]).all(), method
    finally:
        sub.close()
