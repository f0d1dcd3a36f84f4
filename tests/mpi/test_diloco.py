"""DiLoCo, Streaming DiLoCo and hybrid sharding against their oracles: DDP (H = 1 with SGD
inside), a serial step-by-step reference computed in one process (rounds, fragments,
overlap, Nesterov outside), exact resume, and the bytes across groups against the formula."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist import data
from hpcdist.comm import Communicator
from hpcdist.parallel.diloco import fragment_bounds
from hpcdist.train import train

import helpers

pytestmark = pytest.mark.mpi

SGD = dict(optimizer="sgd", momentum=0.0, weight_decay=0.0)


def quiet(*a, **k):
    pass


def sizes_dividing(world):
    return [k for k in (1, 2) if world % k == 0]


def test_h1_with_sgd_inside_equals_ddp(comm, tmp_path):
    """H = 1, outer lr 1, no outer momentum: each meeting averages the groups' models after
    one SGD step, which is DDP's step on the averaged gradient."""
    ddp = train(helpers.small(**SGD, steps=5, out_dir=str(tmp_path / "d")), comm, log=quiet)
    for k in sizes_dividing(comm.size):
        got = train(helpers.small(**SGD, steps=5, strategy="diloco", group_size=k,
                                  inner_steps=1, outer_lr=1.0, outer_momentum=0.0,
                                  out_dir=str(tmp_path / f"g{k}")), comm, log=quiet)
        np.testing.assert_allclose(got["params"], ddp["params"], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose([r["loss"] for r in got["history"]],
                                   [r["loss"] for r in ddp["history"]], rtol=1e-10)
    if comm.size % 4 == 0:                 # TP inside each group: its slices meet their own
        tp = train(helpers.small(**SGD, steps=5, tp=2, out_dir=str(tmp_path / "t")), comm,
                   log=quiet)
        got = train(helpers.small(**SGD, steps=5, tp=2, strategy="diloco", group_size=4,
                                  inner_steps=1, outer_lr=1.0, outer_momentum=0.0,
                                  out_dir=str(tmp_path / "gt")), comm, log=quiet)
        np.testing.assert_allclose(got["params"], tp["params"], rtol=1e-10, atol=1e-10)


def reference(cfg, G, K):
    """The outer loop computed serially in one process, step by step: G groups of K replicas
    (group g reads the batches of world ranks gK..gK+K-1), SGD inside, each fragment's
    pseudo-gradient averaged at its steps, the outer Nesterov SGD by hand, the mixing of an
    overlapped exchange, and every round ended at the last step."""
    from hpcdist.parallel.strategy import make_model
    train_set, _ = data.datasets_of(cfg)
    solo = Communicator(MPI.COMM_SELF)
    try:
        model = make_model(cfg, solo, None, train_set)
    finally:
        solo.close()
    params = model.parameters()
    flat = lambda: np.concatenate([p.data.reshape(-1) for p in params])  # noqa: E731

    def put(v):
        o = 0
        for p in params:
            p.data[...] = v[o:o + p.size].reshape(p.shape)
            o += p.size
    samplers = [data.DistributedSampler(len(train_set), cfg.batch_size, r, G * K,
                                        seed=cfg.seed) for r in range(G * K)]
    theta = [flat() for _ in range(G)]
    outer, mom = flat(), np.zeros_like(flat())
    frags = fragment_bounds([p.size for p in params], cfg.fragments)
    H, F, tau = cfg.inner_steps, cfg.fragments, cfg.outer_overlap
    flight = None

    def meet(f, deltas):
        nonlocal outer
        a, b = frags[f]
        avg = np.mean(deltas, axis=0)
        m = mom[a:b]
        m *= cfg.outer_momentum
        m += avg
        step = avg + cfg.outer_momentum * m if cfg.outer_nesterov else m
        outer[a:b] -= cfg.outer_lr * step

    for n in range(1, cfg.steps + 1):
        for g in range(G):
            put(theta[g])
            grad = 0
            for k in range(K):
                x, y = train_set.batch(samplers[g * K + k].next_batch())
                for p in params:
                    p.grad = None
                model(x, y)[1].backward()
                grad = grad + np.concatenate([p.grad.reshape(-1) for p in params])
            theta[g] = theta[g] - cfg.lr * grad / K
        due = [f for f in range(F) if n % H == f * H // F]
        if flight is not None and (n >= flight[1] or due or n == cfg.steps):
            f, _, deltas = flight
            meet(f, deltas)
            a, b = frags[f]
            for g in range(G):
                theta[g][a:b] = cfg.outer_mix * theta[g][a:b] + (1 - cfg.outer_mix) * outer[a:b]
            flight = None
        for f in range(F) if n == cfg.steps else due:
            a, b = frags[f]
            deltas = [outer[a:b] - t[a:b] for t in theta]
            if tau and n != cfg.steps:
                flight = (f, n + tau, deltas)
                continue
            meet(f, deltas)
            for g in range(G):
                theta[g][a:b] = outer[a:b]
    return outer


OUTER = {"fedavg": dict(outer_lr=1.0, outer_momentum=0.0),
         "nesterov": dict(outer_lr=0.7, outer_momentum=0.9),
         "streaming": dict(outer_lr=0.7, outer_momentum=0.9, fragments=2),
         "overlapped": dict(outer_lr=0.7, outer_momentum=0.9, fragments=2, inner_steps=4,
                            outer_overlap=1, outer_mix=0.5)}


@pytest.mark.parametrize("kind", list(OUTER))
def test_rounds_equal_the_serial_reference(comm, tmp_path, kind):
    """7 steps of H = 3 (the last round shorter), on groups of 1 and 2 ranks."""
    for k in sizes_dividing(comm.size):
        cfg = helpers.small(**SGD, steps=7, strategy="diloco", group_size=k,
                            **{"inner_steps": 3, **OUTER[kind]}, out_dir=str(tmp_path / str(k)))
        got = train(cfg, comm, log=quiet)
        want = reference(cfg, comm.size // k, k)
        np.testing.assert_allclose(got["params"], want, rtol=1e-10, atol=1e-10,
                                   err_msg=f"{kind}, groups of {k}")
        # the steps' records add up to the run's bytes, the meetings at the end included
        steps = sum(r["bytes_sent"] for r in got["history"])
        assert steps == pytest.approx(got["bytes_per_step"] * len(got["history"]), rel=1e-12)
        if k == 1 and comm.size > 1:                   # nothing inside a group: all across
            assert steps == got["outer_bytes"] > 0, (kind, steps, got["outer_bytes"])


@pytest.mark.parametrize("wire", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_outer_wire_averages_within_its_rounding(comm, wire):
    """Each rank's pseudo-gradient (chunks of very different scales) averaged over the
    world in ``wire``: the same bits everywhere, off the exact mean by at most the rounding
    of the wire (half a code of each chunk's scale, for the quantized ones)."""
    from hpcdist.parallel.outer_wire import CHUNK, LEVELS, OuterWire
    rng = np.random.default_rng(comm.rank)
    n = 3 * CHUNK + 17
    delta = rng.standard_normal(n) * np.repeat([1e-3, 1.0, 30.0, 1e-6], CHUNK)[:n]
    exact = comm.mpi.allreduce(delta) / comm.size
    got = OuterWire(comm, wire).start(delta.copy()).wait()
    every = comm.mpi.allgather(got)
    assert all(np.array_equal(every[0], g) for g in every)
    if wire in LEVELS:
        scales = [np.abs(d.reshape(-1)[:n]) for d in comm.mpi.allgather(delta)]
        bound = np.zeros(n)
        for d in scales:         # each rank's copy rounds by at most half its chunk's step
            pad = np.zeros(4 * CHUNK)
            pad[:n] = d
            bound += np.repeat(pad.reshape(4, CHUNK).max(axis=1), CHUNK)[:n] / LEVELS[wire] / 2
        bound = bound / comm.size * (1 + 1e-6) + 1e-300
    else:
        eps = {"fp32": 1e-15, "fp16": 2 ** -10, "bf16": 2 ** -7}[wire]
        bound = eps * comm.mpi.allreduce(np.abs(delta)) / comm.size * max(comm.size, 2) + 1e-12
        if wire == "fp16":                        # below fp16's normal range: absolute
            bound += 6e-8 * comm.size
    assert np.all(np.abs(got - exact) <= bound), np.abs(got - exact).max()


@pytest.mark.parametrize("wire", ["bf16", "int4"])
def test_low_precision_wires_train_alike_everywhere(comm, tmp_path, wire):
    """Every group ends with the same bits; the quantization error is reported."""
    got = train(helpers.small(steps=6, strategy="diloco", group_size=1, inner_steps=2,
                              outer_wire=wire, out_dir=str(tmp_path / wire)), comm, log=quiet)
    every = comm.mpi.allgather(got["params"])
    assert all(np.array_equal(every[0], p) for p in every)
    if wire == "int4":
        assert 0 < got["outer_quant_error"] < 0.3


def test_resume_continues_exactly(comm, shared_dir):
    """A checkpoint ends a round; saved every H steps, a resumed run equals one that never
    stopped (AdamW inside: each group's own optimizer state comes back)."""
    kw = dict(strategy="diloco", group_size=1, inner_steps=2, save_every=2,
              out_dir=f"{shared_dir}/o")
    whole = train(helpers.small(**kw, steps=6, save_dir=f"{shared_dir}/a"), comm, log=quiet)
    train(helpers.small(**kw, steps=4, save_dir=f"{shared_dir}/b"), comm, log=quiet)
    rest = train(helpers.small(**kw, steps=6, save_dir=f"{shared_dir}/b", resume=True), comm,
                 log=quiet)
    np.testing.assert_array_equal(rest["params"], whole["params"])
    assert len(rest["history"]) == 2


def test_hybrid_sharding_equals_ddp_and_counts_bytes(comm, tmp_path, monkeypatch):
    """ZeRO 1-3 sharded in groups of K, replicated across G = P / K: DDP's trajectory; the
    gradient shards cross the groups by a ring allreduce of 2 (G - 1) / G x L / K values a
    rank and step."""
    monkeypatch.setenv("HPCDIST_ALLREDUCE", "ring")
    ddp = train(helpers.small(n_layer=2, out_dir=str(tmp_path / "d")), comm, log=quiet)
    L = ddp["params"].size
    for level in (1, 2, 3):
        for k in sizes_dividing(comm.size):
            cross = []
            got = train(helpers.small(n_layer=2, zero=level, shard_group="node", shard_size=k,
                                      out_dir=str(tmp_path / f"{level}{k}")), comm, log=quiet,
                        on_build=cross.append)
            np.testing.assert_allclose(got["params"], ddp["params"], rtol=1e-10, atol=1e-10,
                                       err_msg=f"ZeRO-{level} in groups of {k}")
            G = comm.size // k
            sent = comm.mpi.allreduce(cross[0].cross.bytes_sent)
            steps = len(got["history"])
            assert sent == 2 * (G - 1) * L * 8 * steps, (level, k, sent)


def test_a_checkpoint_mid_round_ends_it_and_any_strategy_resumes_it(comm, shared_dir):
    """Saved at step 3 of rounds of 2, the round ends there (every group then holds one
    model), and the run resumed from it equals the one that never stopped; the checkpoint
    resumes as DDP too, and a DDP checkpoint as DiLoCo (the outer momentum starts at zero)."""
    kw = dict(strategy="diloco", group_size=1, inner_steps=2, save_every=3)
    whole = train(helpers.small(**kw, steps=5, save_dir=f"{shared_dir}/a",
                                out_dir=f"{shared_dir}/o"), comm, log=quiet)
    train(helpers.small(**kw, steps=3, save_dir=f"{shared_dir}/b", out_dir=f"{shared_dir}/o"),
          comm, log=quiet)
    rest = train(helpers.small(**kw, steps=5, save_dir=f"{shared_dir}/b", resume=True,
                               out_dir=f"{shared_dir}/o"), comm, log=quiet)
    np.testing.assert_array_equal(rest["params"], whole["params"])
    said = []
    ddp = train(helpers.small(steps=7, save_dir=f"{shared_dir}/b", resume=True,
                              out_dir=f"{shared_dir}/o"), comm, log=said.append)
    assert len(ddp["history"]) == 2
    assert comm.rank or any("resumed as" in s for s in said), said
    back = train(helpers.small(steps=9, save_dir=f"{shared_dir}/b", resume=True,
                               out_dir=f"{shared_dir}/o", **kw), comm, log=quiet)
    assert len(back["history"]) == 2 and np.isfinite(back["test_loss"])
