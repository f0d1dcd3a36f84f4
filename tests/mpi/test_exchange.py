"""The gradient exchanges beside dense DDP: PowerSGD against DDP and its own formulas."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi
several = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1,
                             reason="gradient compression needs more than one rank")


def quiet(*a, **k):
    pass


def full_rank(strategy):
    """Every matrix compressed at its full rank: PowerSGD's approximation is then exact."""
    c = strategy.ddp.compression
    c.rank, c.min_rate = 10 ** 6, 0.0
    c.bind(strategy.ddp.bucket_shapes)


@several
@pytest.mark.parametrize("buckets", [25.0, 0.001])
def test_powersgd_at_full_rank_equals_dense_ddp(comm, tmp_path, buckets):
    kw = dict(steps=5, bucket_mb=buckets, first_bucket_mb=buckets)
    dense = train(small(out_dir=str(tmp_path / "d"), **kw), comm, log=quiet)
    psgd = train(small(compress="powersgd", out_dir=str(tmp_path / "p"), **kw), comm,
                 log=quiet, on_build=full_rank)
    # atol: entries whose exact gradient is 0 get round-off gradients that Adam's
    # eps-normalized step turns into ~1e-12 moves (as in test_ddp)
    np.testing.assert_allclose(psgd["params"], dense["params"], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose([r["loss"] for r in psgd["history"]],
                               [r["loss"] for r in dense["history"]], rtol=1e-10)


class Probe:
    """Per bucket: the local gradients handed to the scheme and the averages it returned;
    and the bytes each step's exchange sent."""

    def __init__(self):
        self.local, self.sent, self.bytes = {}, {}, []

    def attach(self, strategy):
        self.ddp = ddp = strategy.ddp
        ddp.on_launch.append(self.launch)
        ddp.on_synced.append(self.synced)

    def launch(self, bucket, grad):
        if bucket.index == 0:
            self.start = self.ddp.comm.bytes_sent
        self.local[bucket.index] = self.local.get(bucket.index, 0) + grad.copy()

    def synced(self, ddp):
        self.bytes.append(ddp.comm.bytes_sent - self.start)
        for b in ddp.buckets:
            self.sent[b.index] = self.sent.get(b.index, 0) + ddp.flat.grad[b.lo:b.hi].copy()


@several
@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_error_feedback_loses_nothing(comm, tmp_path, rank):
    """For each compressed matrix, on every rank: what was applied over the steps plus the
    error kept back equals the sum of this rank's own gradients (error feedback)."""
    probe = Probe()
    train(small(compress="powersgd", powersgd_rank=rank, n_embd=32, bucket_mb=0.004,
                first_bucket_mb=0.004, out_dir=str(tmp_path)), comm, log=quiet,
          on_build=probe.attach)
    c = probe.ddp.compression
    checked = 0
    for key, (mats, _) in c.split.items():
        for i, (off, n, m, r) in enumerate(mats):
            applied = probe.sent[key][off:off + n * m].reshape(n, m)
            own = probe.local[key][off:off + n * m].reshape(n, m)
            np.testing.assert_allclose(applied + c.state[key][f"e{i}"], own, rtol=1e-9,
                                       atol=1e-12)
            checked += 1
    assert checked >= 4


@several
def test_powersgd_bytes_per_step_are_two_allreduces_of_the_factors(comm, tmp_path):
    probe = Probe()
    r = 2
    train(small(compress="powersgd", powersgd_rank=r, n_embd=32, out_dir=str(tmp_path)), comm,
          log=quiet, on_build=probe.attach)
    c, ddp = probe.ddp.compression, probe.ddp
    # the formula, from the model's shapes alone: r (n + m) per compressed n x m matrix
    p_total = q_total = dense_total = 0
    for p in ddp.flat.params:
        n, m = p.shape[0], p.size // p.shape[0]
        dense_total += p.size
        if p.ndim >= 2 and n * m >= 2 * min(r, n, m) * (n + m):
            p_total, q_total = p_total + n * min(r, n, m), q_total + m * min(r, n, m)
        else:
            p_total += p.size
    got = [c.elements(b.index) for b in ddp.buckets]
    assert (sum(a for a, _ in got), sum(b for _, b in got)) == (p_total, q_total)
    assert p_total + q_total < dense_total / 2
    # the bytes: what the same two allreduces per bucket send on this communicator
    before = comm.bytes_sent
    for a, b in got:
        comm.iallreduce(np.zeros(a), op="avg").wait()
        if b:
            comm.allreduce(np.zeros(b), op="avg")
    assert probe.bytes == [comm.bytes_sent - before] * len(probe.bytes)


# ---- the parameter server -----------------------------------------------------------------

@several
@pytest.mark.parametrize("servers", [1, 2])
def test_ps_at_staleness_zero_equals_ddp(comm, tmp_path, servers):
    """--max-staleness 0 with W workers is DDP over W ranks (fp64): the same steps, the same
    losses, the same final parameters; no gradient is ever stale."""
    if comm.size <= servers:
        pytest.skip("needs a worker beside the servers")
    W = comm.size - servers
    ps = train(small(strategy="ps", servers=servers, max_staleness=0, grad_clip=1.0,
                     out_dir=str(tmp_path / "ps")), comm, log=quiet)
    sub = comm.split(color=0 if comm.rank < W else 1)
    if comm.rank < W:
        ddp = train(small(grad_clip=1.0, out_dir=str(tmp_path / "ddp")), sub, log=quiet)
        np.testing.assert_allclose(ps["params"], ddp["params"], rtol=1e-10, atol=1e-10)
        assert len(ps["history"]) == len(ddp["history"]) == 4
    sub.close()
    assert ps["staleness_max"] == 0 and ps["clock_gap_max"] == 0
    assert sum(ps["staleness_hist"]) == 4 * W * servers


@several
def test_ps_checkpoints_load_into_ddp_and_back(comm, shared_dir):
    """A PS run (s = 0) saves every 2 steps; DDP resumes it at step 4 and a PS run resumes a
    DDP checkpoint: both end where 6 steps of DDP end (fp64)."""
    if comm.size < 3:
        pytest.skip("needs two workers and a server")
    W = comm.size - 1
    sub = comm.split(color=0 if comm.rank < W else 1)
    kw = dict(out_dir=shared_dir + "/o")
    ps_dir, ddp_dir = shared_dir + "/ps", shared_dir + "/ddp"
    train(small(strategy="ps", max_staleness=0, steps=4, save_dir=ps_dir, save_every=2, **kw),
          comm, log=quiet)
    if comm.rank < W:
        ref = train(small(steps=6, **kw), sub, log=quiet)["params"]
        got = train(small(steps=6, save_dir=ps_dir, resume=True, **kw), sub, log=quiet)
        np.testing.assert_allclose(got["params"], ref, rtol=1e-10, atol=1e-10)
        train(small(steps=3, save_dir=ddp_dir, **kw), sub, log=quiet)
    comm.barrier()
    back = train(small(strategy="ps", max_staleness=0, steps=6, save_dir=ddp_dir, resume=True,
                       **kw), comm, log=quiet)
    if comm.rank < W:
        np.testing.assert_allclose(back["params"], ref, rtol=1e-10, atol=1e-10)
        assert len(back["history"]) == 3
    sub.close()


@several
@pytest.mark.parametrize("s", [1, 3])
def test_ps_staleness_bound_holds_with_a_straggler(comm, tmp_path, s):
    """Worker 0 sleeps every step: the others run ahead, never more than s clocks, and no
    applied gradient is more than 2s steps stale."""
    if comm.size < 3:
        pytest.skip("needs two workers and a server")
    out = train(small(strategy="ps", max_staleness=s, steps=12, straggler="0:20",
                      out_dir=str(tmp_path)), comm, log=quiet)
    assert out["clock_gap_max"] <= s
    if s == 1:
        assert out["clock_gap_max"] == 1         # the bound was reached, and held
    assert out["staleness_max"] <= 2 * s
    assert sum(out["staleness_hist"]) == 12 * (comm.size - 1)     # every step's W pushes
    local = comm.mpi.allgather(len(out["history"]))[:comm.size - 1]
    assert local[0] <= 12 <= max(local)       # the straggler ran no more steps than the rest
