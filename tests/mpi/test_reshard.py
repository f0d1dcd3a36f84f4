"""Checkpoints load into any layout: save in one, resume in another, and in fp64 the per-step
loss and gradient norm after resuming equal the uninterrupted 1-rank run's (rel 1e-10)."""
import functools

import numpy as np
import pytest
from mpi4py import MPI

from hpcdist import checkpoint
from hpcdist.comm import Communicator
from hpcdist.parallel.strategy import build_strategy
from hpcdist.parallel.state import restore_checkpoint, save_checkpoint
from hpcdist.train import prepare, train

from helpers import small

pytestmark = pytest.mark.mpi

GLOBAL = 120           # divisible by every data-parallel size used here (1-5, 8)
MODEL = dict(n_head=4, n_embd=16, n_layer=2, grad_clip=1.0)


def layouts(P):
    """Layouts (as settings) that fit P ranks."""
    out = [dict(zero=z) for z in (0, 1, 2, 3)]
    if P % 2 == 0:
        out += [dict(tp=2), dict(tp=2, zero=1, sequence_parallel=True), dict(pp=2),
                dict(pp=2, schedule="zb-h1", micro_batches=3)]
    if P % 4 == 0:
        out += [dict(tp=2, pp=2)]
    return out


def _cfg(layout, world, **kw):
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    return small(**{**MODEL, **layout, **kw}, batch_size=GLOBAL // dp)


def _history(final):
    return np.array([[r["loss"], r["grad_norm"]] for r in final["history"]])


@functools.lru_cache(maxsize=None)
def _reference():
    """Steps 1-4 of the uninterrupted 1-rank run (every rank computes it)."""
    solo = Communicator(MPI.COMM_SELF)
    try:
        return _history(train(_cfg({}, 1, steps=4, out_dir=f"/tmp/hpcdist-rs-{MPI.COMM_WORLD.Get_rank()}"),
                              solo, log=lambda *a: None))
    finally:
        solo.close()


def _save(comm, layout, folder):
    train(_cfg(layout, comm.size, steps=2, save_dir=folder, out_dir=folder + "_o"), comm,
          log=lambda *a: None)


def _resume(comm, layout, folder, tag):
    final = train(_cfg(layout, comm.size, steps=4, save_dir=folder, resume=True,
                       out_dir=folder + f"_{tag}"), comm, log=lambda *a: None)
    np.testing.assert_allclose(_history(final), _reference()[2:], rtol=1e-10,
                               err_msg=f"resumed as {layout} on {comm.size} ranks")
    return final


def _copy(comm, src, dst):
    """A private copy of a checkpoint folder (resuming writes new steps into its save dir)."""
    import shutil
    if comm.rank == 0:
        shutil.copytree(src, dst)
    comm.barrier()
    return dst


def test_from_data_parallel_into_every_layout(comm, shared_dir):
    base = shared_dir + "/dp"
    _save(comm, {}, base)
    for i, layout in enumerate(layouts(comm.size)):
        _resume(comm, layout, _copy(comm, base, shared_dir + f"/dp{i}"), "r")


def test_from_every_layout_into_one_rank_and_back(comm, shared_dir):
    for i, layout in enumerate(layouts(comm.size)):
        folder = shared_dir + f"/l{i}"
        _save(comm, layout, folder)
        solo = Communicator(MPI.COMM_SELF)
        try:            # every rank resumes it alone (read-only use of the same files)
            mine = _copy(solo, folder, shared_dir + f"/l{i}_solo{comm.rank}")
            _resume(solo, {}, mine, "solo")
        finally:
            solo.close()
    # and a checkpoint written by one rank, resumed by all in every layout
    one = shared_dir + "/one"
    if comm.rank == 0:
        solo = Communicator(MPI.COMM_SELF)
        _save(solo, {}, one)
        solo.close()
    comm.barrier()
    for i, layout in enumerate(layouts(comm.size)):
        _resume(comm, layout, _copy(comm, one, shared_dir + f"/one{i}"), "w")


def test_world_size_down_and_up(comm, shared_dir):
    if comm.size < 3:
        pytest.skip("needs a smaller world inside this one")
    folder = shared_dir + "/down"
    _save(comm, dict(zero=1), folder)
    n = max(d for d in range(2, comm.size) if GLOBAL % d == 0)   # a smaller world (same batch)
    sub = comm.split(0 if comm.rank < n else 1)
    try:
        if comm.rank < n:
            _resume(sub, dict(zero=2), _copy(sub, folder, shared_dir + "/down_r"), "d")
    finally:
        sub.close()
    comm.barrier()


def test_round_trip_is_bit_identical(comm, shared_dir):
    P = comm.size
    other = layouts(P)[-1]                                   # the most model-parallel one
    a = shared_dir + "/rt_a"
    _save(comm, {}, a)
    b = shared_dir + "/rt_b"
    cfg = _cfg(other, P, steps=2, save_dir=b, out_dir=b + "_o", resume=True)
    cfg.save_dir = a
    datasets, resume = prepare(cfg, comm)
    model, strategy = build_strategy(cfg, comm, datasets[0])
    from hpcdist import data
    sampler = data.DistributedSampler(len(datasets[0]), cfg.batch_size, strategy.batch_comm.rank,
                                      strategy.batch_comm.size, seed=cfg.seed)
    restore_checkpoint(resume[2], cfg, comm, strategy, sampler)
    cfg.save_dir = b
    save_checkpoint(cfg, 2, comm, strategy, sampler)             # saved again, in the other layout
    ra, rb = checkpoint.Reader(a + "/step_00000002"), checkpoint.Reader(b + "/step_00000002")
    assert set(ra.tensors) == set(rb.tensors)
    for name in ra.tensors:
        assert np.array_equal(ra.tensor(name), rb.tensor(name)), name
    assert ra.scalars["sampler"] == rb.scalars["sampler"]
    _resume(comm, {}, b, "back")                             # and loaded back in the first
