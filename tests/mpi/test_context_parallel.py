"""Context parallelism against its oracles: in fp64 every layout with --cp trains like one
process (loss and gradient norm per step, to 1e-10), in both variants; the bytes each step
sends over the context-parallel group equal the formula; checkpoints load across CP sizes."""
import numpy as np
import pytest

from hpcdist.parallel import context
from hpcdist.train import train

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi

# 6 heads: cp 2 and 3 divide them (ulysses; 4 heads where tp 2 takes half); sort of 5 digits:
# 9 positions, which split unevenly into 2 x cp chunks for every cp (19 at cp 5).
CP_MODEL = dict(n_head=6, n_embd=24, n_layer=2, length=5, grad_clip=1.0)

# (settings, world): each case at the smallest world that shows it
CASES = [
    ({"cp": 2}, 2),
    ({"cp": 3}, 3),
    ({"cp": 2, "tp": 2, "n_head": 4}, 4),
    ({"cp": 2}, 4),                                                      # with DP 2
    ({"cp": 2, "pp": 2, "micro_batches": 3}, 4),
    ({"cp": 2, "pp": 2, "schedule": "gpipe", "micro_batches": 2}, 4),
    ({"cp": 2, "pp": 2, "schedule": "zb-h1", "micro_batches": 3}, 4),
    ({"cp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2, "micro_batches": 2,
      "n_layer": 4}, 4),
    ({"cp": 2, "zero": 1}, 4), ({"cp": 2, "zero": 2}, 4), ({"cp": 2, "zero": 3}, 4),
    ({"cp": 2, "checkpoint_activations": True}, 2),
    ({"cp": 2, "grad_accum": 2}, 2),
    ({"cp": 2, "tp": 2, "n_head": 4, "sequence_parallel": True, "pp": 2, "micro_batches": 3}, 8),
    ({"cp": 5, "length": 10}, 5),
    # dropout: each rank draws its rows' (and its attention blocks') part of one process's
    # masks (one replica: the replicas of DP draw streams of their own)
    ({"cp": 2, "dropout": 0.2}, 2),
    ({"cp": 3, "dropout": 0.2}, 3),
    ({"cp": 2, "dropout": 0.2, "checkpoint_activations": True}, 2),
]


def _history(cfg, comm, on_build=None):
    return history(cfg, comm, on_build=on_build)


def _reference(cfg, replicas):
    return one_process(cfg, cp=1, cp_impl="ring", tp=1, pp=1, zero=0, sequence_parallel=False,
                       schedule="1f1b", batch_size=cfg.batch_size * replicas)


def _cases(world):
    return [c for c, w in CASES if w == world]


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_cp_trains_like_one_process(comm, tmp_path, impl):
    cases = _cases(comm.size)
    if not cases:
        pytest.skip(f"no context-parallel case runs on {comm.size} ranks")
    for i, extra in enumerate(cases):
        heads = extra.get("n_head", CP_MODEL["n_head"]) // extra.get("tp", 1)
        if impl == "ulysses" and heads % extra["cp"]:
            continue                        # ulysses needs cp to divide a TP rank's heads
        cfg = small(**{**CP_MODEL, **extra}, cp_impl=impl, out_dir=str(tmp_path / str(i)))
        final, got = _history(cfg, comm)
        replicas = comm.size // (cfg.cp * cfg.tp * cfg.pp)
        ref_final, ref = _reference(cfg, replicas)
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12, err_msg=f"{impl} {extra}")
        np.testing.assert_allclose(final["test_loss"], ref_final["test_loss"], rtol=1e-10)
        assert final["accuracy"] == ref_final["accuracy"]


def test_cp_with_compression_starts_where_one_process_does(comm, tmp_path):
    """Gradient compression over DP x CP (lossy: no per-step oracle): the first step's loss
    is the one-process loss of the same batch, and training goes on finitely."""
    if comm.size != 4:
        pytest.skip("cp 2 x dp 2")
    for scheme in ("topk", "powersgd"):
        cfg = small(**CP_MODEL, cp=2, compress=scheme, density=0.5,
                    out_dir=str(tmp_path / scheme))
        _, got = _history(cfg, comm)
        _, ref = _reference(cfg.__class__(**{**vars(cfg), "compress": "none"}), 2)
        np.testing.assert_allclose(got[0, 0], ref[0, 0], rtol=1e-10)   # before any update
        assert np.all(np.isfinite(got))


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_bytes_per_step_equal_the_formula(comm, tmp_path, impl):
    if comm.size not in (2, 3):
        pytest.skip("the formula is checked at cp 2 and 3")
    seen = []

    def probe(strategy):
        cp_comm = strategy.mesh.cp_comm
        inner = strategy.forward_backward

        def counted(x, y, scale=1.0):
            before = cp_comm.bytes_sent
            loss = inner(x, y, scale)
            seen.append((cp_comm.bytes_sent - before, x.shape))
            return loss
        strategy.forward_backward = counted
    cfg = small(**CP_MODEL, cp=comm.size, cp_impl=impl, out_dir=str(tmp_path))
    train(cfg, comm, log=lambda *a: None, on_build=probe)
    for sent, (B, T) in seen:
        total = comm.allreduce(np.array([sent], dtype=np.int64))[0]
        want = cfg.n_layer * context.bytes_per_layer(impl, comm.size, B, T, cfg.n_embd, 8)
        assert total == want, (impl, total, want)


def test_the_layout_balances_causal_work():
    for n in (2, 3, 4, 8):
        for T in (64, 257, 1000):
            w = context.work(T, n)
            assert sum(w) == T * (T + 1) // 2
            assert max(w) / min(w) < 1 + 4.0 / (T / n)       # equal but for chunk rounding
            # every position held once
            pos = np.sort(np.concatenate([context.positions(T, n, r) for r in range(n)]))
            np.testing.assert_array_equal(pos, np.arange(T))


def test_checkpoints_load_across_cp_sizes(comm, shared_dir):
    if comm.size != 2:
        pytest.skip("cp 2 <-> tp 2 on 2 ranks (one replica each: the same batches)")
    for impl, before, after in (("ring", {"cp": 2}, {"tp": 2}),
                                ("ulysses", {"tp": 2}, {"cp": 2})):
        whole = small(**CP_MODEL, **before, cp_impl=impl if "cp" in before else "ring",
                      out_dir=f"{shared_dir}/{impl}-whole")
        _, ref = _history(whole, comm)
        save = f"{shared_dir}/{impl}-ckpt"
        train(small(**CP_MODEL, **before, cp_impl=whole.cp_impl, steps=2, save_dir=save,
                    out_dir=f"{shared_dir}/{impl}-a"), comm, log=lambda *a: None)
        _, got = _history(small(**CP_MODEL, **after, cp_impl=impl if "cp" in after else "ring",
                                save_dir=save, resume=True, out_dir=f"{shared_dir}/{impl}-b"),
                          comm)
        np.testing.assert_allclose(got, ref[2:], rtol=1e-10, err_msg=f"{before} -> {after}")
