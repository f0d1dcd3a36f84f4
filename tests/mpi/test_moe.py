"""Mixture of experts over ranks against one process: in fp64, expert parallelism (and data,
tensor, pipeline and context parallelism and ZeRO beside it) trains like one process with
the global batch — loss and gradient norm every step to 1e-10 — dropless and with a capacity
factor (the same assignments dropped); checkpoints across EP sizes and into dense DP; a rank
that receives no tokens; the all-to-all's bytes against the formula."""
import pathlib
import shutil

import numpy as np
import pytest

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi

MOE = dict(n_layer=2, n_head=2, n_embd=16, experts=4, top_k=2, grad_clip=1.0, steps=4)


def _reference(cfg, replicas):
    """The one-process run every rank computes (in a folder of its own: ``cfg.out_dir`` may
    be one every rank shares, and eight runs rotating one train.log race)."""
    from mpi4py import MPI
    return one_process(cfg, ep=1, batch_size=cfg.batch_size * replicas,
                       out_dir=f"{cfg.out_dir}-ref{MPI.COMM_WORLD.Get_rank()}")


def _cases(world):
    """(settings) of the cases each world size runs: EP = world (odd sizes: 3 of 6
    experts), EP with DP beside it, softmax and sigmoid routers, shared experts."""
    out = []
    if world in (2, 4):
        out += [dict(ep=world), dict(ep=world, router="sigmoid", balance="bias", top_k=1),
                dict(ep=world, shared_experts=1, moe_every=2, z_loss_coef=1e-3)]
    if world == 3:
        out += [dict(ep=3, experts=6), dict(ep=3, experts=6, grad_accum=2)]
    if world in (4, 8):
        out += [dict(ep=2, experts=4)]                      # EP 2 x DP world/2
    if world == 5:
        out += [dict(ep=5, experts=5, top_k=3)]
    if world == 1:
        out += [dict(ep=1)]
    return out


def test_expert_parallel_trains_like_one_process(comm, tmp_path):
    for i, extra in enumerate(_cases(comm.size)):
        cfg = small(**{**MOE, **extra}, out_dir=str(tmp_path / str(i)))
        final, got = history(cfg, comm)
        ref_final, ref = _reference(cfg, comm.size)
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg=str(extra))
        np.testing.assert_allclose(final["test_loss"], ref_final["test_loss"], rtol=1e-10)
        assert final["accuracy"] == ref_final["accuracy"]
        # dropless drops nothing (Megatron-LM #1756: a "dropless" path that dropped)
        assert all(r["moe_dropped"] == 0 for r in final["history"]), extra


def test_a_capacity_factor_drops_what_one_process_drops(comm, tmp_path):
    if comm.size not in (2, 3, 4):
        pytest.skip("EP = world at 2, 3 and 4 ranks")
    cfg = small(**{**MOE, "experts": 2 * comm.size}, ep=comm.size, capacity_factor=0.5,
                out_dir=str(tmp_path / "cap"))
    final, got = history(cfg, comm)
    ref_final, ref = _reference(cfg, comm.size)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    dropped = [r["moe_dropped"] for r in final["history"]]
    assert dropped == [r["moe_dropped"] for r in ref_final["history"]]
    assert min(dropped) > 0                 # a factor of 0.5 must drop


def test_a_rank_whose_experts_get_no_tokens(comm, tmp_path):
    """Megatron-LM #1877: every token routed away from this rank's experts. A router whose
    weights favour expert 0 sends nothing to the other ranks; training goes on and equals
    one process."""
    if comm.size not in (2, 3):
        pytest.skip("EP = world at 2 and 3 ranks")
    from hpcdist import data, nn
    from hpcdist.parallel.strategy import build_strategy
    cfg = small(**{**MOE, "experts": comm.size, "top_k": 1}, ep=comm.size, aux_loss_coef=0.0,
                out_dir=str(tmp_path))
    model, strategy = build_strategy(cfg, comm, data.datasets_of(cfg)[0])
    moe = [m for m in model.modules() if isinstance(m, nn.moe.MoE)]
    for m in moe:
        m.router.weight.data[...] = 0.0      # ties go to the lowest index: expert 0 only
    train_set = data.datasets_of(cfg)[0]
    x, y = train_set.batch(np.arange(comm.rank * 3, comm.rank * 3 + 3))
    strategy.zero_grad()
    loss = float(strategy.forward_backward(x, y))
    strategy.sync()
    assert np.isfinite(loss)
    load = moe[0].load
    assert load[0] == load.sum() > 0 and not load[1:].any()


def test_experts_in_a_pipeline_train_like_one_process(comm, tmp_path):
    """PP 2 (x DP where the world allows): each stage's MoE layers, balanced by the bias
    (torchtitan #1689: balancing under pipeline parallelism) or by nothing, equal one process.
    A pipeline computes the Switch loss per micro-batch, one process per batch (different
    losses, both right): with it, the pipeline runs one micro-batch, which must then equal."""
    if comm.size not in (2, 4):
        pytest.skip("PP 2 at 2 and 4 ranks")
    for i, (schedule, extra) in enumerate([
            ("1f1b", dict(router="sigmoid", balance="bias", bias_rate=0.05)),
            ("zb-h1", dict(balance="none", top_k=1)),
            ("interleaved", dict(router="sigmoid", balance="bias", bias_rate=0.05)),
            ("1f1b", dict(aux_loss_coef=0.05, z_loss_coef=0.01, micro_batches=1,
                          grad_accum=2))]):
        cfg = small(**{**MOE, "n_layer": 4, "aux_loss_coef": 0.0, "micro_batches": 2,
                       **extra}, pp=2, schedule=schedule, batch_size=4,
                    virtual_stages=2 if schedule == "interleaved" else 1,
                    out_dir=str(tmp_path / str(i)))
        final, got = history(cfg, comm)
        ref_final, ref = one_process(cfg, pp=1, schedule="1f1b", virtual_stages=1,
                                     micro_batches=0, batch_size=4 * (comm.size // 2),
                                     out_dir=cfg.out_dir + "-ref")
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg=schedule)
        assert all(r["moe_load"] >= 1.0 for r in final["history"])   # this stage's layers


def test_zero_levels_with_experts_follow_level_zero(comm, tmp_path):
    """Experts replicated over DP (no --ep) are parameters like any other: ZeRO-1, -2 and -3
    (which gathers an MoE block's experts with the block) end where ZeRO-0 does."""
    cfg = small(**MOE, out_dir=str(tmp_path / "z0"))
    ref, ref_h = history(cfg, comm)
    for level in (1, 2, 3):
        got, got_h = history(cfg.__class__(**{**vars(cfg), "zero": level,
                                              "out_dir": str(tmp_path / f"z{level}")}), comm)
        np.testing.assert_allclose(got_h, ref_h, rtol=1e-10, atol=1e-12, err_msg=str(level))
        np.testing.assert_allclose(got["params"], ref["params"], rtol=1e-10, atol=1e-10)


def test_the_all_to_all_sends_what_the_formula_says(comm, tmp_path):
    """Over one forward and backward, the EP group's byte count (the Communicator's, at the
    wire) equals parallel.expert.bytes_per_layer summed over the MoE layers, from the rows
    each layer sent and received."""
    if comm.size not in (2, 3, 4):
        pytest.skip("EP = world at 2, 3 and 4 ranks")
    from hpcdist import data, nn
    from hpcdist.parallel.expert import bytes_per_layer
    from hpcdist.parallel.strategy import build_strategy
    cfg = small(**{**MOE, "experts": 2 * comm.size}, ep=comm.size, out_dir=str(tmp_path))
    train_set = data.datasets_of(cfg)[0]
    model, strategy = build_strategy(cfg, comm, train_set)
    layers = [m for m in model.modules() if isinstance(m, nn.moe.MoE)]
    ep = layers[0].exchange.comm
    x, y = train_set.batch(np.arange(comm.rank * 3, comm.rank * 3 + 3))
    strategy.zero_grad()
    before = ep.bytes_sent
    strategy.forward_backward(x, y)
    sent = ep.bytes_sent - before
    strategy.sync()           # the gradient buckets still in flight complete on every rank
    C = cfg.n_embd
    want = sum(bytes_per_layer(*m.exchange.rows, comm.rank, m.E, C, 8) for m in layers)
    assert sent == want > 0


def _compositions(world):
    """Layouts (settings) with experts each world size runs: EP beside TP (the experts whole
    on every rank of the group), PP (1F1B and ZB-H1), CP (ring and Ulysses) and ZeRO 1-3."""
    out = []
    if world == 2:
        out += [dict(tp=2, n_head=4), dict(cp=2), dict(ep=2, zero=1), dict(ep=2, zero=3)]
    if world == 3:
        out += [dict(ep=3, experts=6, zero=2), dict(cp=3, z_loss_coef=1e-2)]
    if world == 4:
        out += [dict(tp=2, ep=2, n_head=4), dict(cp=2, ep=2), dict(cp=2, ep=2, cp_impl="ulysses"),
                dict(pp=2, ep=2, schedule="1f1b", micro_batches=1, n_layer=4),
                dict(pp=2, ep=2, schedule="zb-h1", micro_batches=1, n_layer=4, top_k=1,
                     balance="none"),
                dict(ep=2, zero=3, checkpoint_activations=True), dict(ep=4, zero=2),
                dict(tp=2, ep=2, zero=2, n_head=4), dict(pp=2, ep=2, zero=1, micro_batches=1)]
    if world == 5:
        out += [dict(ep=5, experts=5, top_k=3, zero=3)]
    if world == 8:
        out += [dict(tp=2, pp=2, ep=2, n_head=4, micro_batches=1), dict(ep=2, zero=3),
                dict(cp=2, ep=4, zero=1)]
    return out


def test_experts_compose_with_every_dimension(comm, tmp_path):
    """Each layout of ``_compositions`` equals one process with the global batch."""
    cases = _compositions(comm.size)
    if not cases:
        pytest.skip(f"no composition case at {comm.size} ranks")
    for i, extra in enumerate(cases):
        cfg = small(**{**MOE, **extra}, out_dir=str(tmp_path / str(i)))
        final, got = history(cfg, comm)
        split = cfg.tp * cfg.pp * cfg.cp
        ref_final, ref = one_process(cfg, tp=1, pp=1, cp=1, ep=1, zero=0,
                                     checkpoint_activations=False, micro_batches=0,
                                     schedule="1f1b", batch_size=cfg.batch_size * (comm.size // split),
                                     out_dir=cfg.out_dir + "-ref")
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg=str(extra))
        np.testing.assert_allclose(final["test_loss"], ref_final["test_loss"], rtol=1e-10)


@pytest.mark.parametrize("zero", [0, 2])
def test_checkpoints_load_across_ep_sizes_and_into_dense_dp(comm, shared_dir, zero):
    """Saved at step 3 of 6 by EP = the largest size dividing 4 experts and the world (ZeRO
    level ``zero``), resumed at every EP size that divides both (1: the experts whole on every
    rank, dense data parallelism), with and without ZeRO: the six steps equal one process."""
    sizes = [e for e in (1, 2, 4) if comm.size % e == 0]
    shared_dir = pathlib.Path(shared_dir) / f"zero{zero}"
    cfg = small(**{**MOE, "steps": 6}, save_every=3, ep=max(sizes), zero=zero,
                save_dir=str(shared_dir / "ck"), out_dir=str(shared_dir / "a"))
    _, first = history(cfg, comm)
    ref_final, ref = _reference(cfg.__class__(**{**vars(cfg), "save_dir": "", "zero": 0}),
                                comm.size)
    np.testing.assert_allclose(first, ref, rtol=1e-10, atol=1e-12)
    for ep in sizes:
        for level in (0, 3):
            folder = shared_dir / f"ck-{ep}-{level}"
            if comm.rank == 0:                  # the save at step 3 alone
                shutil.copytree(shared_dir / "ck", folder)
                shutil.rmtree(folder / "step_00000006")
                (folder / "latest").write_text("step_00000003")
            comm.allreduce(np.zeros(1))
            c2 = small(**{**MOE, "steps": 6}, ep=ep, zero=level, save_dir=str(folder), resume=True,
                       out_dir=str(shared_dir / f"b-{ep}-{level}"))
            final, rest = history(c2, comm)
            np.testing.assert_allclose(rest, ref[3:], rtol=1e-10, atol=1e-12,
                                       err_msg=f"ep {ep} zero {level}")
            np.testing.assert_allclose(final["test_loss"], ref_final["test_loss"], rtol=1e-10)


def test_the_shared_expert_runs_while_the_dispatch_travels(comm, tmp_path, monkeypatch):
    """EP = world with a shared expert: each MoE layer starts the dispatch's all-to-all,
    runs the shared expert, then waits (the calls' order, recorded); training with the
    overlap off gives the same numbers bit for bit."""
    if comm.size not in (2, 3):
        pytest.skip("EP = world at 2 and 3 ranks")
    from hpcdist import data, nn
    from hpcdist.parallel.expert import ExpertExchange
    from hpcdist.parallel.strategy import build_strategy
    cfg = small(**{**MOE, "experts": 2 * comm.size, "shared_experts": 1}, ep=comm.size,
                out_dir=str(tmp_path / "on"))
    train_set = data.datasets_of(cfg)[0]
    model, strategy = build_strategy(cfg, comm, train_set)
    events = []
    for m in [m for m in model.modules() if isinstance(m, nn.moe.MoE)]:
        start = m.exchange.ialltoall

        def traced(buf, counts=None, recv_counts=None, start=start):
            handle = start(buf, counts, recv_counts)
            wait = handle.wait
            events.append("start")
            handle.wait = lambda: (events.append("wait"), wait())[1]
            return handle
        m.exchange.ialltoall = traced
        forward = m.shared[0].forward
        m.shared[0].forward = lambda *a, f=forward: (events.append("shared"), f(*a))[1]
    x, y = train_set.batch(np.arange(comm.rank * 3, comm.rank * 3 + 3))
    strategy.zero_grad()
    strategy.forward_backward(x, y)
    strategy.sync()
    at = [i for i, e in enumerate(events) if e == "shared"]
    assert len(at) == cfg.n_layer and all(events[i - 1:i + 2] == ["start", "shared", "wait"]
                                          for i in at), events
    _, on = history(cfg, comm)
    monkeypatch.setattr(ExpertExchange, "overlap", False)
    _, off = history(small(**{**vars(cfg), "out_dir": str(tmp_path / "off")}), comm)
    assert np.array_equal(on, off)
