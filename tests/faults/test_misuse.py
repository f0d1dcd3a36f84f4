"""The misuse matrix: everyday mistakes, made on real mpiexec jobs. Each case asserts its one
line, its exit code, and that the files of an earlier run are byte-identical afterwards
(nothing lost, nothing taken over)."""
import hashlib
import json
import os
import re
import signal
import socket
import time

import pytest
from procs import finish

from test_faults import START_S, launch, ranks_json, run  # noqa: F401

pytestmark = pytest.mark.slow


def args(tmp_path, *extra, steps=12, out="out"):
    return ["-m", "hpcdist.train", "--steps", str(steps), "--log-every", "1000",
            "--batch-size", "8", "--eval-batch", "64", "--out-dir", str(tmp_path / out),
            *extra]


def snapshot(folder) -> dict:
    """{relative path: sha256} of every file below ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def wait_for_ranks(out_dir) -> list:
    """The rank table a job writes once every rank is up."""
    path = out_dir / "ranks.json"
    for _ in range(600):
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.02)
    pytest.fail(f"{path} never appeared")


def one_error_line(err: str, pattern: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err


@pytest.fixture
def earlier_run(tmp_path):
    """A finished run with checkpoints at steps 6 and 12 in tmp_path/ck; its files' hashes."""
    ck = tmp_path / "ck"
    rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), "--save-every", "6"), n=2)
    assert rc == 0, err[-3000:]
    return ck, snapshot(ck)


@pytest.mark.parametrize("flag,folder", [("--save-dir", True), ("--out-dir", True),
                                         ("--trace", False)])
def test_a_path_that_cannot_be_written_is_one_line_at_start_up(tmp_path, flag, folder):
    (tmp_path / "afile").write_text("not a folder")
    target = str(tmp_path / "afile" / ("ck" if folder else "t.json"))
    extra = [flag, target] if flag != "--out-dir" else []
    cmd = args(tmp_path, *extra, steps=100000) if flag != "--out-dir" else \
        ["-m", "hpcdist.train", "--steps", "100000", "--out-dir", target]
    rc, out, err, took = run(cmd, n=2)
    assert rc == 2
    one_error_line(err, rf"error: rank 0: {flag} '.*afile/.*' cannot be written: '.*afile' "
                        r"is a file, not a folder")
    assert "step" not in out and took < START_S + 2
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_a_forgotten_resume_is_refused_and_the_old_run_is_untouched(tmp_path, earlier_run):
    ck, before = earlier_run
    rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), steps=3, out="o2"), n=2)
    assert rc == 2
    one_error_line(err, r"--save-dir '.*ck' holds the checkpoints of run \w+ \(started .*\), "
                        r"up to step 12: add --resume to continue it, or --overwrite")
    assert snapshot(ck) == before


def test_overwrite_moves_the_old_run_aside_byte_for_byte(tmp_path, earlier_run):
    ck, before = earlier_run
    rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), "--overwrite", steps=3,
                               out="o2"), n=2)
    assert rc == 0, err[-3000:]
    assert re.search(rf"--overwrite: moved run \w+ .* from {ck} to {ck}.old-1 \(nothing "
                     r"deleted\)", out), out
    assert snapshot(str(ck) + ".old-1") == before
    assert json.loads((ck / "run.json").read_text())["id"] != \
        json.loads((tmp_path / "ck.old-1" / "run.json").read_text())["id"]


def test_resume_with_nothing_left_to_do_says_so(tmp_path, earlier_run):
    ck, before = earlier_run
    rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), "--resume", steps=12), n=2)
    assert rc == 0, err[-3000:]
    assert re.search(r"nothing to do: .*step_00000012 is at step 12 and --steps is 12; raise "
                     r"--steps", out), out
    assert "held-out" not in out
    assert snapshot(ck) == {k: v for k, v in before.items()}


def test_a_second_job_on_the_same_save_folder_is_refused_naming_the_holder(tmp_path,
                                                                            earlier_run):
    ck, _ = earlier_run
    first = launch(args(tmp_path, "--save-dir", str(ck), "--resume", steps=100000,
                        out="o1"), n=2)
    try:
        pid0 = wait_for_ranks(tmp_path / "o1")[0]["pid"]
        rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), "--resume", steps=20,
                                   out="o2"), n=2)
        assert rc == 2
        one_error_line(err, rf"--save-dir '.*ck' is in use by another job \(host "
                            rf"{socket.gethostname()}, pid {pid0}, started .*\): wait for it")
    finally:
        first.send_signal(signal.SIGINT)                    # Ctrl-C: saves, exits 130
        rc, out, err, _ = finish(first)
    assert rc == 130, err[-3000:]
    assert not (ck / ".lock").exists()


def test_a_lock_left_by_a_dead_job_is_taken_over_with_a_line(tmp_path, earlier_run):
    ck, _ = earlier_run
    dead = {"host": socket.gethostname(), "pid": 2 ** 22 + 12345, "started": "yesterday",
            "job": ""}
    (ck / ".lock").write_text(json.dumps(dead))
    rc, out, err, _ = run(args(tmp_path, "--save-dir", str(ck), "--resume", steps=14), n=2)
    assert rc == 0, err[-3000:]
    assert re.search(rf"took over the lock of .*ck, left by a job that is gone \(host "
                     rf"{socket.gethostname()}, pid {dead['pid']}, started yesterday\)", out)


@pytest.mark.parametrize("save", [True, False])
def test_ctrl_c_stops_after_a_step_in_one_line(tmp_path, save):
    ck = tmp_path / "ck"
    proc = launch(args(tmp_path, *(["--save-dir", str(ck)] if save else []), steps=100000))
    ranks_json(tmp_path)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)                         # mpiexec forwards it to every rank
    rc, out, err, _ = finish(proc)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stops = re.findall(r"stopped after step (\d+) of 100000 on SIGINT(.*)", out)
    assert len(stops) == 1, out
    if save:
        step = int(stops[0][0])
        assert "the checkpoint above holds the run; exit code 130" in stops[0][1]
        assert (ck / "latest").read_text().strip() == f"step_{step:08d}"
    else:
        assert "nothing saved (no --save-dir); exit code 130" in stops[0][1]


def test_a_launch_that_promised_more_tasks_than_mpi_started_is_refused(tmp_path):
    for var in ("SLURM_NTASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        rc, out, err, _ = run(args(tmp_path), n=0, **{var: "2"})  # no launcher: 1 rank
        assert rc == 2, (var, err[-2000:])
        if var.startswith("OMPI"):           # mpi4py (built with MPICH) warns first: keep ours
            err = err.strip().splitlines()[-1]
        one_error_line(err, rf"\b2 tasks \({var}" if var != "SLURM_NTASKS" else
                       r"the job has 2 tasks \(SLURM_NTASKS\) but this process is a world of "
                       r"1 rank")
        assert "--allow-singletons" in err
    rc, out, err, _ = run(args(tmp_path, "--allow-singletons", steps=2), n=0, SLURM_NTASKS="2")
    assert rc == 0, err[-2000:]


def test_help_is_printed_once(tmp_path):
    rc, out, err, _ = run(["-m", "hpcdist.train", "--help"], n=4)
    assert rc == 0
    assert out.count("usage: python -m hpcdist.train") == 1


def test_a_sigkilled_rank_is_named_by_hpcdist_19_of_20_times(tmp_path):
    """kill -9 of a rank under mpiexec's defaults (which SIGKILL every other rank at once):
    the killed rank's supervisor process names it, its host and its pid."""
    named, tries = 0, 20
    for i in range(tries):
        out_dir = tmp_path / f"k{i}"
        proc = launch(["-m", "hpcdist.train", "--steps", "100000", "--log-every", "100000",
                       "--batch-size", "8", "--out-dir", str(out_dir)])
        table = wait_for_ranks(out_dir)
        rank = i % 4
        victim = table[rank]["pid"]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        rc, out, err, _ = finish(proc)
        assert rc != 0
        said = re.findall(r"\[hpcdist\] rank (\d+) of 4 \(host (\S+), pid (\d+)\) was killed "
                          r"by SIGKILL", err)
        assert all((int(r), int(p)) == (rank, victim) for r, _, p in said), err[-2000:]
        named += bool(said) and said[0][1] == socket.gethostname()
    assert named >= 19, f"named {named} of {tries}"
