"""In-job recovery under Open MPI's ULFM (``--on-failure shrink``): a rank killed with
SIGKILL mid-run, and the survivors finish the run in the same job.

The jobs run under ``.venv-ompi`` (``make venv-ompi``: Open MPI's wheel and mpi4py), launched
as hpcdist's docs print (``mpirun --with-ft ulfm --mca btl tcp,self``). Skipped, saying why,
where that venv is absent. Oracles: the same run on N-1 ranks resumed from the committed
state (fp64, exactly), and the checkpoint a run leaves.
"""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from hpcdist.comm.ulfm_launch import RESPAWN_FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OMPI = os.path.join(ROOT, ".venv-ompi", "bin")
LIMIT = 120

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(OMPI, "mpirun")),
    reason="no .venv-ompi (Open MPI's wheel): `make venv-ompi` builds it; make test does")


def launch(n, *args, ft=True, program=("-m", "hpcdist.train"), **env):
    """``mpirun -n N python PROGRAM ARGS`` under Open MPI (``ft``: with ULFM), in a session."""
    full = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HPCDIST_TIMEOUT="60",
                OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    full.update(env)
    cmd = [os.path.join(OMPI, "mpirun"), "--oversubscribe"] + \
        (["--with-ft", "ulfm", "--mca", "btl", "tcp,self", *RESPAWN_FLAGS.split()]
         if ft else []) + \
        ["-n", str(n), os.path.join(OMPI, "python"), *program, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, cwd=ROOT, start_new_session=True)


def finish(proc, limit=LIMIT):
    """(exit code, output); the whole launcher's process group is killed past ``limit``."""
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"no exit within {limit} s (hung):\n{out[-4000:]}")
    return proc.returncode, out


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_params(save_dir):
    from hpcdist import checkpoint
    reader = checkpoint.Reader(checkpoint.latest(str(save_dir)))
    return reader.step, {n: reader.tensor(n) for n in reader.tensors}


def same_as_resumed(a, ref, sizes, at, steps, args, after=None):
    """Run ``a``'s steps after ``at`` and its final model equal (exactly) the reference: the
    same run on ``sizes[0]`` ranks to step ``at``, saved, then resumed on ``sizes[1]`` (with
    ``after`` in place of ``args``: the layout the survivors took)."""
    rc, out = finish(launch(sizes[0], *args, "--steps", str(at), "--out-dir", str(ref),
                            "--save-dir", str(ref / "ck"), ft=False))
    assert rc == 0, out[-4000:]
    rc, out = finish(launch(sizes[1], *(args if after is None else after), "--steps",
                            str(steps), "--resume", "--out-dir", str(ref), "--save-dir",
                            str(ref / "ck"), ft=False))
    assert rc == 0, out[-4000:]
    # every step's record, those the lost run had not yet written (--log-every 1000) included:
    # before the failure the same as the reference's first run, after it as its resumed one
    got = {r["step"]: r["loss"] for r in records(a) if "loss" in r}
    want = {r["step"]: r["loss"] for r in records(ref) if "loss" in r}
    assert sorted(got) == list(range(1, steps + 1)) and got == want
    step_a, pa = final_params(a / "ck")
    step_r, pr = final_params(ref / "ck")
    assert step_a == step_r == steps and sorted(pa) == sorted(pr)
    for name in pa:
        np.testing.assert_array_equal(pa[name], pr[name], err_msg=name)


COMMON = ["--dtype", "fp64", "--steps", "10", "--lr", "3e-3", "--min-lr", "3e-3", "--warmup",
          "0", "--log-every", "1000", "--batch-size", "12"]


@pytest.mark.parametrize("n, victim, layout", [(3, 0, ()),
                                               (4, 2, ("--zero", "2", "--save-every", "3",
                                                       "--mirror-every", "0"))])
def test_a_killed_rank_costs_one_step_and_the_rest_equals_n_minus_1_ranks(tmp_path, n, victim,
                                                                           layout):
    """kill -9 of one rank as step 7 begins: the job finishes (exit 0), says which rank it
    lost and where it went on from, and steps 7-10 and the final model equal (fp64, exactly)
    a run of N-1 ranks resumed from the committed state: step 6 held in memory by every
    replica (DDP), or the step-6 checkpoint (ZeRO-2 with --mirror-every 0: its sharded
    state in no peer's memory)."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    rc, out = finish(launch(n, *COMMON, *layout, "--on-failure", "shrink", "--out-dir",
                            str(a), "--save-dir", str(a / "ck"),
                            HPCDIST_SIGNAL_AT=f"{victim}:7:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert f"rank {victim} of {n} lost in step 7; {n - 1} ranks go on in this job" in out, \
        out[-3000:]
    events = [r for r in records(a) if r.get("event") == "recovered"]
    assert [(e["lost"], e["step"], e["resumed_from"], e["world"]) for e in events] == \
        [([victim], 7, 6, n - 1)]
    # the reference: the same to step 6 on N ranks, saved there, then N-1 ranks resume
    same_as_resumed(a, ref, (n, n - 1), 6, 10, [*COMMON, *layout])


def test_a_rank_lost_before_the_first_committed_step_starts_again_from_the_seed(tmp_path):
    """ZeRO-2 at 4 ranks without a checkpoint or a mirror, rank 2 killed as step 1 begins:
    nothing was committed, so the survivors start again from the state the seed makes, and
    every step and the final model equal (fp64, exactly) a run of 3 ranks from the start."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    args = [*COMMON, "--zero", "2", "--mirror-every", "0"]
    rc, out = finish(launch(4, *args, "--on-failure", "shrink", "--out-dir", str(a),
                            "--save-dir", str(a / "ck"), HPCDIST_SIGNAL_AT="2:1:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "rank 2 of 4 lost in step 1; 3 ranks go on in this job" in out and \
        "starting again from the initial state" in out, out[-3000:]
    events = [r for r in records(a) if r.get("event") == "recovered"]
    assert [(e["lost"], e["resumed_from"], e["world"]) for e in events] == [([2], 0, 3)]
    rc, out = finish(launch(3, *args, "--out-dir", str(ref), "--save-dir", str(ref / "ck"),
                            ft=False))
    assert rc == 0, out[-4000:]
    got = {r["step"]: r["loss"] for r in records(a) if "loss" in r}
    want = {r["step"]: r["loss"] for r in records(ref) if "loss" in r}
    assert sorted(got) == list(range(1, 11)) and got == want
    step_a, pa = final_params(a / "ck")
    step_r, pr = final_params(ref / "ck")
    assert step_a == step_r == 10 and sorted(pa) == sorted(pr)
    for name in pa:
        np.testing.assert_array_equal(pa[name], pr[name], err_msg=name)


MIRRORED = [(("--zero", "3"), ("--zero", "3"), ""),
            (("--tp", "2"), (), "--tp 2 x --pp 1 x --cp 1 does not divide the 3 ranks left"),
            (("--pp", "2"), (), "--tp 1 x --pp 2 x --cp 1 does not divide the 3 ranks left"),
            (("--experts", "4", "--ep", "2"), ("--experts", "4"),
             "--ep 2 does not divide the 3 replicas left: the 4 experts go over 1 rank(s)")]


@pytest.mark.parametrize("layout, after, said", MIRRORED)
def test_a_sharded_layout_restores_from_a_buddys_memory_losing_no_step(tmp_path, layout,
                                                                        after, said):
    """ZeRO-3, TP 2 x DP 2, PP 2 x DP 2, EP 2 x DP 2 (Mixtral-style experts) at 4 ranks,
    rank 2 killed as step 7 begins: the survivors take the step-6 state from their buddies'
    memory (--mirror-every 1; the last checkpoint is step 4's) and steps 7-10 and the final
    model equal (fp64, exactly) the run saved at step 6 on 4 ranks and resumed on 3 in the
    layout the survivors took."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    args = [*COMMON, *layout, "--save-every", "4"]
    rc, out = finish(launch(4, *args, "--on-failure", "shrink", "--out-dir", str(a),
                            "--save-dir", str(a / "ck"), HPCDIST_SIGNAL_AT="2:7:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "rank 2 of 4 lost in step 7; 3 ranks go on in this job" in out and said in out \
        and "resuming from the committed state in the buddies' memory at step 6" in out, \
        out[-3000:]
    events = [r for r in records(a) if r.get("event") == "recovered"]
    assert [(e["lost"], e["resumed_from"], e["world"]) for e in events] == [([2], 6, 3)]
    before = [r for r in records(a) if "loss" in r and r["step"] <= 4]   # (read at the save)
    assert len(before) == 4 and all(r.get("mirror_bytes", 0) > 0 for r in before)
    same_as_resumed(a, ref, (4, 3), 6, 10, args, [*COMMON, *after, "--save-every", "4"])


def test_a_rank_and_its_buddy_lost_together_restore_the_checkpoint(tmp_path):
    """Ranks 1 and 2 of 4 (2 holds 1's mirror) killed in step 7 of a ZeRO-2 run: no
    survivor holds rank 1's state, so the two survivors restore the step-4 checkpoint."""
    a = tmp_path / "a"
    rc, out = finish(launch(4, *COMMON, "--zero", "2", "--save-every", "4", "--on-failure",
                            "shrink", "--out-dir", str(a), "--save-dir", str(a / "ck"),
                            HPCDIST_SIGNAL_AT="1:7:SIGKILL,2:7:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "a lost rank's state was in no survivor's memory" in out, out[-3000:]
    events = [r for r in records(a) if r.get("event") == "recovered"]
    assert events and events[0]["resumed_from"] == 4 and events[-1]["world"] == 2


def test_a_kill_from_outside_at_any_moment_is_survived(tmp_path):
    """SIGKILL from outside at an unplanned moment of a 4-rank run (mid-step, in a
    collective, in the agreement): the three others finish the run in the job, keeping the
    global batch of 48 (--shrink-batch keep: 16 a rank)."""
    out_dir = tmp_path / "o"
    proc = launch(4, "--steps", "60", "--log-every", "1000", "--on-failure", "shrink",
                  "--shrink-batch", "keep", "--batch-size", "12", "--out-dir", str(out_dir))
    ranks = out_dir / "ranks.json"
    t0 = time.time()
    while not ranks.exists() and time.time() - t0 < 60:
        time.sleep(0.05)
    time.sleep(1.0)
    table = json.loads(ranks.read_text())
    os.kill(table[3]["pid"], signal.SIGKILL)
    rc, out = finish(proc)
    assert rc == 0, out[-4000:]
    assert "rank 3 of 4 lost in step" in out and "held-out accuracy" in out
    recs = records(out_dir)
    assert [(e["world"], e["batch_size"]) for e in recs if e.get("event") == "recovered"] == \
        [(3, 16)]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps[-1] == 60 and all(np.isfinite(r["loss"]) for r in recs if "loss" in r)


@pytest.mark.parametrize("layout", [(), ("--zero", "3"), ("--vocab-multiple", "64")])
def test_with_respawn_a_new_process_joins_and_the_run_equals_the_one_never_hit(tmp_path,
                                                                               layout):
    """--respawn: the survivors spawn a replacement for the rank killed as step 5 begins,
    it takes the settings and the committed state (step 4: every replica's, or ZeRO-3's
    shards from the buddies' memory) from rank 0 over MPI, and the job goes on at 3 ranks:
    steps 5-8 and the final model equal (fp64, exactly) a 3-rank run resumed from a step-4
    checkpoint (no dropout here: a recovery reseeds the dropout streams, a resume at the
    same layout restores them). With the vocabulary padded, the state every replica holds
    travels at its logical shape and is padded again where it lands."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    common = [*COMMON, *layout, "--steps", "8"]
    rc, out = finish(launch(3, *common, "--on-failure", "shrink", "--respawn", "--out-dir",
                            str(a), "--save-dir", str(a / "ck"), HPCDIST_SIGNAL_AT="1:5:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "rank 1 of 3 lost in step 5; 3 ranks go on in this job" in out, out[-3000:]
    assert "1 new rank(s) joined (--respawn)" in out
    assert ("the committed state in the buddies' memory" if "--zero" in layout else
            "the state every replica held") in out, out[-3000:]
    events = [r for r in records(a) if r.get("event") == "recovered"]
    assert [(e["lost"], e["resumed_from"], e["world"]) for e in events] == [([1], 4, 3)]
    same_as_resumed(a, ref, (3, 3), 4, 8, common)


def test_hybrid_sharding_with_respawn_restores_from_memory_and_equals_the_run_never_hit(
        tmp_path):
    """ZeRO-3 sharded within groups of 2 and replicated across them (--shard-group node
    --shard-size 2, HSDP) at 4 ranks: rank 1 killed as step 5 begins, a replacement spawned,
    the step-4 state restored from the buddies' memory; steps 5-8 and the final model equal
    (fp64, exactly) the 4-rank run resumed from its step-4 checkpoint."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    common = [*COMMON, "--zero", "3", "--shard-group", "node", "--shard-size", "2",
              "--steps", "8"]
    rc, out = finish(launch(4, *common, "--on-failure", "shrink", "--respawn", "--out-dir",
                            str(a), "--save-dir", str(a / "ck"), HPCDIST_SIGNAL_AT="1:5:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "rank 1 of 4 lost in step 5; 4 ranks go on in this job" in out, out[-3000:]
    assert "the committed state in the buddies' memory" in out, out[-3000:]
    same_as_resumed(a, ref, (4, 4), 4, 8, common)


def test_without_the_fault_tolerance_switch_the_flag_is_refused_in_one_line(tmp_path):
    rc, out = finish(launch(2, "--on-failure", "shrink", "--out-dir", str(tmp_path), ft=False))
    assert rc == 2, out[-3000:]
    assert "launch with `mpirun --with-ft ulfm --mca btl tcp,self -n N" in out


def test_over_nccl_the_survivors_abort_and_build_new_communicators(tmp_path):
    """--backend nccl (the GPU stand-in's NCCL), ZeRO-3 at 4 ranks, rank 2 killed as step 7
    begins: the NCCL communicators are aborted, the survivors make new ones over the 3 left,
    restore step 6 from the buddies' memory, and steps 7-10 and the final model equal (fp64,
    exactly) the same NCCL run saved at step 6 and resumed on 3 ranks."""
    a, ref = tmp_path / "a", tmp_path / "ref"
    args = [*COMMON, "--zero", "3", "--device", "standin", "--backend", "nccl"]
    rc, out = finish(launch(4, *args, "--on-failure", "shrink", "--out-dir", str(a),
                            "--save-dir", str(a / "ck"), HPCDIST_SIGNAL_AT="2:7:SIGKILL"))
    assert rc == 0, out[-4000:]
    assert "rank 2 of 4 lost in step 7; 3 ranks go on in this job" in out and \
        "resuming from the committed state in the buddies' memory at step 6" in out and \
        out.count("NCCL carries the device arrays") == 2, out[-3000:]
    same_as_resumed(a, ref, (4, 3), 6, 10, args)


def test_a_rank_stuck_in_nccl_when_a_peer_dies_is_released_by_the_watcher():
    """NCCL's kernels wait for a dead peer forever and no MPI revoke reaches them: with the
    survivors blocked inside an NCCL call (a stand-in call that returns only when aborted),
    the watcher thread sees the death through MPI's runtime and aborts the communicators
    (tests/ulfm/nccl_stuck.py; without the watcher both wait until killed)."""
    _, out = finish(launch(3, program=(os.path.join(HERE, "nccl_stuck.py"),)), limit=90)
    waits = {}
    for line in out.splitlines():
        if "released by the abort after" in line:
            waits[int(line.split()[1].rstrip(":"))] = float(line.split()[-2])
    assert sorted(waits) == [0, 1] and max(waits.values()) < 10, out[-3000:]
