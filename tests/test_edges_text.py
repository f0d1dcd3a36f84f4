"""The edges a new user met on real text (issue 61): nothing lost, nothing partial, one line
for each mistake. Each test here failed on the main before it."""
import json
import os
import subprocess
import sys

import pytest

from hpcdist import train
from test_edges import ROOT, one_line, py


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edges3")
    cfg = train.parse_config(["--steps", "4", "--save-dir", str(tmp / "ck"), "--out-dir",
                              str(tmp / "o"), "--batch-size", "8"])
    train.train(cfg, log=lambda *a: None)
    return tmp / "ck"


def test_sample_refuses_ids_outside_the_vocabulary_in_one_line(saved):
    for ids, pattern in (("99999", r"--ids 99999 is not a token id of this model: it has 10 "
                                   r"\(0 to 9\)"),
                         ("-1", r"--ids -1 is not a token id"),
                         ("3,x", r"--ids takes comma-separated token ids")):
        rc, _, err = py("-m", "hpcdist.sample", str(saved), "--ids", ids, "--tokens", "2")
        assert rc == 2
        one_line(err, pattern)
    rc, out, err = py("-m", "hpcdist.sample", str(saved), "--ids", "1,2", "--tokens", "2")
    assert rc == 0 and out.strip().startswith("1,2,"), err


def test_resume_refuses_a_missing_folder_and_an_empty_one_starts(tmp_path):
    """A mistyped --save-dir with --resume is refused, nothing created; an existing empty
    folder starts at step 0 (a requeued job's first attempt: jobs/common.sh makes it)."""
    rc, _, err = py("-m", "hpcdist.train", "--steps", "2", "--save-dir", str(tmp_path / "nope"),
                    "--resume", "--out-dir", str(tmp_path / "o"))
    assert rc == 2 and not (tmp_path / "nope").exists()
    one_line(err, r"--resume: --save-dir .*nope' does not exist \(a mistyped name\?\)")
    (tmp_path / "empty").mkdir()
    rc, out, err = py("-m", "hpcdist.train", "--steps", "2", "--save-dir",
                      str(tmp_path / "empty"), "--resume", "--out-dir", str(tmp_path / "o"))
    assert rc == 0 and "starting at step 0" in out, err
    assert "mkdir -p \"$RUN_DIR/checkpoints\"" in open(os.path.join(ROOT, "jobs",
                                                                    "common.sh")).read()


def test_a_refused_run_leaves_nothing_in_the_save_folder_it_made(tmp_path):
    rc, _, err = py("-m", "hpcdist.train", "--steps", "2", "--tp", "2", "--save-dir",
                    str(tmp_path / "ck"), "--out-dir", str(tmp_path / "o"))
    assert rc == 2 and "not divisible by --tp 2" in err
    assert not (tmp_path / "ck").exists()                   # no folder, no stray run.json


def test_resume_with_another_seed_is_refused(saved, tmp_path):
    """The data order (and dropout) is the run's: the sampler keeps epoch and position, so
    another seed would reshuffle the rest of the epoch."""
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    rc, _, err = py("-m", "hpcdist.train", "--steps", "6", "--batch-size", "8", "--save-dir",
                    str(ck), "--resume", "--seed", "7", "--out-dir", str(tmp_path / "o"))
    assert rc == 2
    one_line(err, r"--seed 7 contradicts --resume: .* holds a run with --seed 1337; drop --seed")


def test_checkpoint_tools_exit_codes_and_a_closed_pipe(saved, tmp_path):
    """inspect into ``head`` ends quietly; verify: 1 for damage, 2 where it cannot run (no
    checkpoint there), as the other tools' errors."""
    r = subprocess.run(f"{sys.executable} -m hpcdist.checkpoint inspect {saved} | head -1",
                       shell=True, capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert "step 4" in r.stdout and "BrokenPipe" not in r.stderr and r.stderr == ""
    rc, _, err = py("-m", "hpcdist.checkpoint", "verify", str(tmp_path / "none"))
    assert rc == 2
    one_line(err, r"no checkpoint here")


def test_export_onto_a_full_disk_leaves_nothing_and_the_retry_works(saved, tmp_path):
    out = tmp_path / "hf"
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(out), "--format",
                    "safetensors", limit_bytes=100_000)
    assert rc == 2
    one_line(err, r"error: .*(File too large|No space left)")
    assert os.listdir(tmp_path) == []                       # no folder, no 0-byte tokenizer
    rc, out_text, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(out),
                           "--format", "safetensors")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors"]
    assert os.listdir(tmp_path) == ["hf"]
    (out / "notes.txt").write_text("mine")     # a folder with other files: refused, then kept
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(out), "--format",
                    "safetensors", "--overwrite")
    assert rc == 2 and "'notes.txt'" in err, err
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(out), "--format",
                    "safetensors", "--overwrite", "--allow-other-files")
    assert rc == 0 and (out / "notes.txt").read_text() == "mine", err
    assert os.listdir(tmp_path) == ["hf"]


def test_a_log_folder_that_fills_up_warns_once_and_training_goes_on(tmp_path):
    """metrics.jsonl and train.log on a disk that fills at step 12 (a file-size limit): one
    warning per file naming it, the run trains to its end (exit 0: nothing of the training is
    lost; --save-dir elsewhere would checkpoint as before), the records up to the failure
    kept."""
    env_before = os.environ.get("HPCDIST_FSIZE_AT")
    os.environ["HPCDIST_FSIZE_AT"] = "0:12:3000"
    try:
        rc, out, err = py("-m", "hpcdist.train", "--steps", "30", "--log-every", "5",
                          "--out-dir", str(tmp_path / "o"), "--batch-size", "8")
    finally:
        if env_before is None:
            os.environ.pop("HPCDIST_FSIZE_AT")
        else:
            os.environ["HPCDIST_FSIZE_AT"] = env_before
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err and "step    30/30" in out and "held-out accuracy" in out
    warned = [ln for ln in err.splitlines() if "warning: writing" in ln]
    assert len(warned) == len(set(warned)) >= 1, err
    assert all("failed (File too large)" in ln for ln in warned)
    assert any("metrics.jsonl" in ln for ln in warned)
    steps = [json.loads(ln)["step"] for ln in open(tmp_path / "o" / "metrics.jsonl")
             if '"step"' in ln and '"event"' not in ln]
    assert steps[:10] == list(range(1, 11)) and steps[-1] < 30


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:                   # a zombie is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


def test_a_bench_owns_its_jobs_and_ends_them_on_any_exit(tmp_path):
    """A job a bench starts is a process group of its own: a time limit ends the launcher
    and what it started; only its PIDs count as its own; SIGTERM to the bench ends its jobs
    (bench recovery once left a 3-rank --steps 100000 job running and signalled stale
    PIDs of another run's ranks.json)."""
    import signal
    import time
    from hpcdist.bench import common
    marker = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        common.run_job(["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"], timeout=1)
    time.sleep(0.3)
    assert _gone(int(marker.read_text())) and not common._JOBS
    proc = common.start_job(["sh", "-c", "sleep 60 & wait"])
    assert common.owns(proc, proc.pid) and not common.owns(proc, os.getpid())
    common.end_job(proc)
    assert proc.poll() is not None and not common.owns(proc, proc.pid)
    bench = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom hpcdist.bench import common\n"
         "common.exit_on_sigterm()\np = common.start_job(['sleep', '60'])\n"
         "print(p.pid, flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    child = int(bench.stdout.readline())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.3)
    assert _gone(child)
    from hpcdist.bench import recovery                     # ranks.json: only the job's PIDs
    proc = common.start_job(["sleep", "60"])
    try:
        (tmp_path / "ranks.json").write_text(json.dumps(
            [{"rank": 0, "pid": proc.pid}, {"rank": 1, "pid": os.getpid()},
             {"rank": 2, "pid": bench.pid}]))
        assert recovery.live_pids(str(tmp_path), proc) == {0: proc.pid}
    finally:
        common.end_job(proc)
