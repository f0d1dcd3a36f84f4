"""Pure logic of the parallel layer and single-process checks (no mpiexec)."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import hpcdist as hd
from hpcdist import nn
from hpcdist.parallel import plan_buckets
from hpcdist.parallel.compression import TopKCompression, make_compression
from hpcdist.parallel.mixed_precision import LossScaler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


def test_buckets_cover_params_in_reverse_and_respect_caps():
    sizes = [MB // 4] * 10                       # 1 MiB each in float32
    plan = plan_buckets(sizes, 4, bucket_mb=3, first_bucket_mb=1)
    covered = [i for _, _, members in plan for i in members]
    assert covered == list(reversed(range(10)))  # last layer first, each once
    assert [len(m) for _, _, m in plan] == [1, 3, 3, 3]
    for (lo, hi, members), nxt in zip(plan, plan[1:]):
        assert nxt[1] == lo                       # contiguous, walking down the buffer
    assert plan[-1][0] == 0 and plan[0][1] == sum(sizes)


def test_one_bucket_when_everything_fits():
    plan = plan_buckets([10, 20, 30], 4, 25, 1)
    assert plan == [(0, 60, [2, 1, 0])]


def test_loss_scaler_growth_backoff_hysteresis():
    s = LossScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    assert all(s.update(False) for _ in range(3)) and s.scale == 16.0
    assert not s.update(True) and s.scale == 16.0      # hysteresis absorbs the first
    assert not s.update(True) and s.scale == 8.0       # the second backs off
    assert s.skipped == 2
    off = LossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(False) and not off.update(True)


def test_topk_compress_decompress_and_density_warmup():
    c = TopKCompression(density=0.01, warmup_steps=10)
    assert abs(c.current_density() - 0.25) < 1e-12
    c.step = 5
    assert 0.01 < c.current_density() < 0.25
    c.step = 10
    assert c.current_density() == 0.01
    g = np.arange(-50, 50, dtype=np.float32)
    (idx, vals), n = c.compress(g)
    assert len(idx) == 1 and vals[0] == -50
    dense = c.decompress((idx, vals), n)
    assert dense[0] == -50 and np.count_nonzero(dense) == 1
    with pytest.raises(ValueError, match="unknown compression"):
        make_compression("zip")


def _grads_of(model, idx, tgt):
    for p in model.parameters():
        p.grad = None
    _, loss = model(idx, tgt)
    loss.backward()
    return {n: p.grad.copy() for n, p in model.named_parameters()}, float(loss.data)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpointing_gives_identical_gradients(float64, dropout):
    cfg = dict(block_size=6, vocab_size=7, n_layer=3, n_head=2, n_embd=8, dropout=dropout)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 7, (4, 6)), rng.integers(0, 7, (4, 6))
    nn.manual_seed(3)
    plain = nn.GPT(nn.GPTConfig(**cfg))
    nn.manual_seed(3)
    ckpt = nn.GPT(nn.GPTConfig(**cfg, checkpoint_activations=True))
    hd.backend.seed(11)
    g1, l1 = _grads_of(plain, idx, tgt)
    hd.backend.seed(11)
    g2, l2 = _grads_of(ckpt, idx, tgt)
    assert l1 == l2
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)


def test_activation_checkpointing_holds_fewer_activations(float64):
    from hpcdist.autograd.recompute import graph_bytes
    cfg = dict(block_size=16, vocab_size=7, n_layer=4, n_head=2, n_embd=32)
    idx = np.zeros((8, 16), dtype=np.int64)
    held = {}
    for on in (False, True):
        nn.manual_seed(0)
        m = nn.GPT(nn.GPTConfig(**cfg, checkpoint_activations=on))
        _, loss = m(idx, idx)
        held[on] = graph_bytes(loss)
    assert held[True] < held[False] / 3


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def test_failure_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HPCDIST_FAIL_AT="1:3")
    t0 = time.time()
    r = subprocess.run([_mpiexec(), "-n", "3", sys.executable, "-m", "hpcdist.train",
                        "--steps", "50", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    took = time.time() - t0
    assert r.returncode != 0
    assert re.search(r"rank 1 of 3 \(host \S+, pid \d+\) failed", r.stderr) and "injected failure on rank 1 at step 3" in r.stderr
    assert "Traceback" in r.stderr
    assert took < 60, f"the job took {took:.0f} s to end"


def test_world_dependent_config_error_on_every_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([_mpiexec(), "-n", "3", sys.executable, "-m", "hpcdist.train",
                        "--length", "3", "--num-digits", "3", "--batch-size", "10",
                        "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "fewer than one global step needs" in lines[0], r.stderr


def test_the_composition_table_in_the_docs_is_the_code_s():
    """docs/compositions.md's matrix is what the trainer's checks say today, every pair."""
    from hpcdist.run import compositions
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "docs", "compositions.md")).read()
    block = text.split("<!-- generated: python -m hpcdist.run.compositions -->\n")[1]
    assert block.split("<!-- end generated -->")[0] == compositions.markdown()


def test_the_compositions_of_issue_41_run_and_the_pipeline_refusal_says_why():
    from hpcdist.run import compositions as C
    got = C.pairs()
    for a, b in [("ZeRO-3", "TP"), ("ZeRO-3", "TP + SP"), ("ZeRO-3", "recompute"),
                 ("bf16", "PP 1F1B"), ("fp16", "PP ZB-H1"), ("bf16", "PP interleaved"),
                 ("CP ring", "dropout"), ("CP Ulysses", "dropout"), ("PP 1F1B", "Top-K"),
                 ("PP 1F1B", "PowerSGD"), ("ZeRO-1", "PP 1F1B"), ("NCCL", "ZeRO-3")]:
        key = (a, b) if (a, b) in got else (b, a)
        assert got[key] is None, (a, b, got[key])
    assert "like Megatron-LM and DeepSpeed" in got[("ZeRO-2", "PP 1F1B")]
    assert got[("ZeRO-1", "ZeRO-3")] == "same"
