"""The job templates in jobs/, submitted as they are to a real one-node SLURM.

``tests/slurm/local-slurm.sh up`` installs (apt-get) and starts munged, slurmctld and slurmd
on this machine; the module stops them again if it started them. Where SLURM cannot start
(no root, no apt-get) every test here skips with the script's reason.

The long jobs are all submitted at the start of the module and run side by side (the node
has 8 declared CPUs); each test then waits for its own job, polling ``scontrol show job``,
and checks its final state, exit code and log. Every wait has a deadline; a job past it is
cancelled and its log shown.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "slurm" / "local-slurm.sh"
SLURM_DIR = os.environ.get("HPCDIST_SLURM_DIR", "/tmp/hpcdist-slurm")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

pytestmark = pytest.mark.timeout(600)


class Cluster:
    def __init__(self, env, tmp: Path):
        self.env, self.tmp = env, tmp
        self.logs = []

    def sbatch(self, template, *train_args, opts=(), env=None, check=True):
        """Submit jobs/<template> from the repository root; returns the job id (or the
        CompletedProcess when ``check`` is False)."""
        e = {**self.env, "PYTHON": sys.executable, **(env or {})}
        r = subprocess.run(["sbatch", "--parsable", *opts, f"jobs/{template}", *train_args],
                           cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
        if not check:
            return r
        assert r.returncode == 0, f"sbatch {template} refused: {r.stderr}"
        return r.stdout.strip().split(";")[0]

    def show(self, job) -> dict:
        r = subprocess.run(["scontrol", "show", "job", "-o", job], env=self.env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def log(self, job) -> str:
        info = self.show(job)
        path = Path(info["StdOut"])
        self.logs.append(path)
        return path.read_text() if path.exists() else ""

    def wait(self, job, timeout=300, until=TERMINAL) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.show(job)
            if info["JobState"] in until:
                return info
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], env=self.env, timeout=30)
                pytest.fail(f"job {job} still {info['JobState']} after {timeout} s; "
                            f"log:\n{self.log(job)}")
            time.sleep(0.5)

    def wait_for_log(self, job, pattern, timeout=120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.log(job)
            if re.search(pattern, text):
                return text
            state = self.show(job)["JobState"]
            if state in TERMINAL or time.monotonic() > deadline:
                pytest.fail(f"job {job} ({state}) never logged {pattern!r}; log:\n{text}")
            time.sleep(0.3)


def _running(name: str) -> bool:
    pidfile = Path(SLURM_DIR) / f"{name}.pid"
    return pidfile.exists() and Path(f"/proc/{pidfile.read_text().strip()}").exists()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    was_up = all(_running(n) for n in ("munged", "slurmctld", "slurmd"))
    r = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(f"SLURM cannot start here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, f"local SLURM did not start:\n{r.stderr}"
    env = dict(os.environ, SLURM_CONF=f"{SLURM_DIR}/slurm.conf")
    c = Cluster(env, tmp_path_factory.mktemp("slurm"))
    yield c
    for path in c.logs:                          # the templates' logs land where sbatch ran
        if path.exists() and path.parent == REPO and path.name.startswith("hpcdist-"):
            path.unlink()
    if not was_up:
        subprocess.run([str(SCRIPT), "down"], capture_output=True, timeout=120)


# Every long job, submitted once at the start so they run side by side.
TRAIN = ["--steps", "300", "--log-every", "50"]
PREEMPT = ["--steps", "700", "--log-every", "25", "--save-every", "0", "--dropout", "0.1"]
# constant lr, so a run stopped at 30 of 60 steps follows the 60-step run exactly
ELASTIC = ["--dtype", "fp64", "--warmup", "0", "--lr", "3e-3", "--min-lr", "3e-3",
           "--log-every", "10", "--save-every", "0"]


@pytest.fixture(scope="module")
def jobs(cluster):
    t = cluster.tmp
    run = lambda name: {"HPCDIST_RUN_DIR": str(t / name)}                # noqa: E731
    return {
        "preempted": cluster.sbatch("train-cpu.sbatch", *PREEMPT, opts=["-n", "2"],
                                    env=run("preempted")),
        "reference": cluster.sbatch("train-cpu.sbatch", *PREEMPT, opts=["-n", "2"],
                                    env=run("reference")),
        "train": cluster.sbatch("train-cpu.sbatch", *TRAIN, "--trace", str(t / "trace.json"),
                                "--comm-log", opts=["-n", "2"], env=run("train")),
        "mpirun": cluster.sbatch("train-cpu.sbatch", "--steps", "60", "--log-every", "30",
                                 opts=["-n", "3"], env={**run("mpirun"), "LAUNCHER": "mpirun"}),
        "bench": cluster.sbatch("bench-collectives.sbatch", "--max-bytes", "65536",
                                "--collectives", "allreduce,allgather", opts=["-n", "3"],
                                env=run("bench")),
        "test": cluster.sbatch("test.sbatch", "-k", "ring or sampler", opts=["-n", "3"],
                               env=run("test")),
        # elastic: 2 tasks save at step 30; a 4-task job resumes them (below); 1 task reference
        "elastic": cluster.sbatch("train-cpu.sbatch", *ELASTIC, "--steps", "30",
                                  "--batch-size", "16", opts=["-n", "2"], env=run("elastic")),
        "elastic_ref": cluster.sbatch("train-cpu.sbatch", *ELASTIC, "--steps", "60",
                                      "--batch-size", "32", opts=["-n", "1"],
                                      env=run("elastic_ref")),
        **_recovery_job(cluster, run("recovery")),
    }


OMPI_PYTHON = REPO / ".venv-ompi" / "bin" / "python"


def _recovery_job(cluster, env) -> dict:
    """A ZeRO-2 job under --on-failure shrink (Open MPI's mpirun, as the templates launch it
    for that flag), rank 1 of 3 killed with SIGKILL as step 20 begins; none without
    .venv-ompi (make test builds it before these tests)."""
    if not OMPI_PYTHON.exists():
        return {}
    return {"recovery": cluster.sbatch(
        "train-cpu.sbatch", "--steps", "60", "--log-every", "20", "--zero", "2",
        "--on-failure", "shrink", opts=["-n", "3"],
        env={**env, "LAUNCHER": "mpirun", "PYTHON": str(OMPI_PYTHON),
             # (this node declares 8 CPUs to SLURM and has 2: Open MPI would not bind 3)
             "MPIRUN_ARGS": "--bind-to none",
             "HPCDIST_SIGNAL_AT": "1:20:SIGKILL", "OMPI_ALLOW_RUN_AS_ROOT": "1",
             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})}


def _final_params(run_dir: Path, steps: int) -> np.ndarray:
    from hpcdist import checkpoint
    reader = checkpoint.Reader(str(run_dir / "checkpoints" / f"step_{steps:08d}"))
    return np.concatenate([reader.tensor(n).reshape(-1) for n in sorted(reader.tensors)
                           if n.startswith("param/")])


def test_signalled_job_checkpoints_requeues_and_matches_an_uninterrupted_run(cluster, jobs):
    """USR1 to the batch shell (what SLURM sends before the time limit with
    --signal=B:USR1@T; here ``scancel --batch --signal=USR1``, so the test does not wait out
    SLURM's 30 s timer): the ranks agree on a step, checkpoint, exit 75, the script requeues,
    the second attempt resumes and ends with the same parameters as a run never stopped."""
    job = jobs["preempted"]
    cluster.wait_for_log(job, r"step +50/700")
    r = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    info = cluster.wait(job, timeout=400)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert int(info["Restarts"]) >= 1, log
    stopped = re.search(r"stopped after step (\d+) of 700 on SIGUSR1", log)
    assert stopped, log
    step = int(stopped.group(1))
    assert 50 <= step < 700
    assert f"resuming from {cluster.tmp / 'preempted' / 'checkpoints'}/step_{step:08d} " \
        f"('latest') at step {step}" in log, log
    assert "attempt 2" in log and "requeueing" in log
    ref = cluster.wait(jobs["reference"], timeout=400)
    assert ref["JobState"] == "COMPLETED" and int(ref["Restarts"]) == 0, cluster.log(jobs["reference"])
    a = _final_params(cluster.tmp / "preempted", 700)
    b = _final_params(cluster.tmp / "reference", 700)
    assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"


def test_training_job_reaches_accuracy_and_writes_trace_and_comm_log(cluster, jobs):
    info = cluster.wait(jobs["train"])
    log = cluster.log(jobs["train"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "preflight: ok (2 ranks" in log and "launcher srun" in log
    final = [json.loads(line) for line in
             (cluster.tmp / "train" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["event"] == "final" and final["world"] == 2
    assert final["accuracy"] >= 0.95, final
    m = re.search(r"held-out accuracy \(exact-match\): ([\d.]+)%", log)
    assert m and float(m.group(1)) / 100 == pytest.approx(final["accuracy"], abs=1e-4)
    trace = json.loads((cluster.tmp / "trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    assert re.search(r"^allreduce +rabenseifner +intra +405760 +300 ", log, re.M), log
    assert (cluster.tmp / "train" / "comm_log.json").exists()


def test_mpirun_launcher_inside_the_allocation(cluster, jobs):
    info = cluster.wait(jobs["mpirun"])
    log = cluster.log(jobs["mpirun"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert "launcher mpirun" in log and "world size 3" in log and "held-out accuracy" in log


def test_a_rank_killed_in_a_shrink_job_costs_no_requeue(cluster, jobs):
    """SIGKILL of rank 1 of a 3-task ZeRO-2 job: the two survivors restore step 19 from their
    buddies' memory and finish the 60 steps in the same allocation; the job COMPLETED, 0:0."""
    if "recovery" not in jobs:
        pytest.skip("no .venv-ompi (make venv-ompi): Open MPI's ULFM")
    info = cluster.wait(jobs["recovery"], timeout=400)
    log = cluster.log(jobs["recovery"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["Restarts"] == "0", info
    assert "rank 1 of 3 lost in step 20; 2 ranks go on in this job" in log, log
    assert "resuming from the committed state in the buddies' memory at step 19" in log, log
    assert "step    60/60" in log and "held-out accuracy" in log, log


def test_collectives_benchmark_job(cluster, jobs):
    info = cluster.wait(jobs["bench"])
    log = cluster.log(jobs["bench"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    out = json.loads((cluster.tmp / "bench" / "bench_collectives_n3.json").read_text())
    rows = [r for r in out["rows"] if r["collective"] == "allreduce"]
    assert out["ranks"] == 3 and [r["bytes"] for r in rows][-1] == 65536
    assert all(r["time_us"] > 0 and r["mpi_time_us"] > 0 for r in rows)
    assert "collectives benchmark | 3 ranks" in log


def test_test_suite_job_passes(cluster, jobs):
    info = cluster.wait(jobs["test"], timeout=400)
    log = cluster.log(jobs["test"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert re.search(r"== unit tests.*\n.*\n\d+ passed", log), log
    assert re.search(r"== MPI tests on 3 ranks", log) and "size: 3" in log
    assert "failed" not in log


@pytest.mark.parametrize("template, opts, args, message", [
    ("train-cpu.sbatch", ["-n", "1"], ["--compress", "topk"], "compresses nothing"),
    ("train-cpu.sbatch", ["-n", "2"], ["--batch-size", "0"], "--batch-size must be positive"),
    ("train-gpu.sbatch", ["--ntasks-per-node=2", "-c", "1", "--gpus-per-task=0"], [],
     "the job has no GPUs: submit with --gpus-per-task=1"),
    ("train-gpu.sbatch", ["--ntasks-per-node=2", "-c", "1"], [], "--device gpu on this node"),
    ("train-gpu.sbatch", ["--ntasks-per-node=2", "-c", "1"], ["--device", "cpu"], "use jobs/train-cpu.sbatch"),
    ("train-gpu-multinode.sbatch", ["-N", "1", "--ntasks-per-node=2", "--gpus-per-node=1",
                                    "-c", "1"], [],
     "2 tasks per node but 1 GPUs per node: one rank per GPU needs --ntasks-per-node=1"),
])
def test_bad_settings_stop_the_job_at_once(cluster, template, opts, args, message):
    """A missing or contradictory setting ends the job in seconds, before any rank runs,
    with exit code 2 and a message that says what to set. (The node declares 2 GPUs with no
    devices behind them, so the GPU templates' checks run on a real GRES allocation.)"""
    t0 = time.monotonic()
    job = cluster.sbatch(template, *args, opts=opts, env={"HPCDIST_RUN_DIR": str(cluster.tmp / "bad")})
    info = cluster.wait(job, timeout=120)
    log = cluster.log(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log
    assert message in log, log
    assert "hpcdist | GPT" not in log                          # no rank started training
    assert time.monotonic() - t0 < 60


def test_impossible_request_is_refused_at_submission(cluster):
    """The GPU template's defaults (4 ranks x 8 CPUs x 1 GPU) do not fit this node: sbatch
    says so at once (EnforcePartLimits=ALL) instead of queueing a job that never starts."""
    r = cluster.sbatch("train-gpu.sbatch", check=False)
    assert r.returncode != 0
    assert "Batch job submission failed" in r.stderr


def test_template_outside_a_checkout_says_where_to_submit(cluster, tmp_path):
    job = cluster.sbatch("train-cpu.sbatch", opts=["-n", "1", "-o", str(tmp_path / "x-%j.out")],
                         env={"HPCDIST_DIR": str(tmp_path)})
    info = cluster.wait(job, timeout=60)
    log = cluster.log(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0"
    assert "submit from the hpcdist checkout or set HPCDIST_DIR" in log


def test_elastic_resubmission_at_another_task_count_resumes_exactly(cluster, jobs):
    """A job of 2 tasks saves; the same run resubmitted with 4 tasks (the same global batch)
    resumes from its checkpoint and ends where one task running all 60 steps ends."""
    first = cluster.wait(jobs["elastic"], timeout=400)
    assert first["JobState"] == "COMPLETED", cluster.log(jobs["elastic"])
    second = cluster.sbatch("train-cpu.sbatch", *ELASTIC, "--steps", "60", "--batch-size", "8",
                            opts=["-n", "4"], env={"HPCDIST_RUN_DIR": str(cluster.tmp / "elastic")})
    info = cluster.wait(second, timeout=400)
    log = cluster.log(second)
    assert info["JobState"] == "COMPLETED", log
    assert re.search(r"resuming from \S+step_00000030 \('latest'\) at step 30 \(written by "
                     r"\{'world': 2.*resumed as \{'world': 4", log), log
    ref = cluster.wait(jobs["elastic_ref"], timeout=400)
    assert ref["JobState"] == "COMPLETED", cluster.log(jobs["elastic_ref"])
    a = _final_params(cluster.tmp / "elastic", 60)
    b = _final_params(cluster.tmp / "elastic_ref", 60)
    # atol as in tests/mpi/test_ddp.py: entries whose exact gradient is 0 get round-off
    # gradients that Adam's eps-normalised step turns into ~1e-12 moves (7 of 101,440 here)
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
