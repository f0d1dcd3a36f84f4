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
