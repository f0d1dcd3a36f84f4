"""Helpers shared by the benchmarks: launching under mpiexec, tables, result files.

A bench owns the jobs it starts (``start_job`` / ``run_job``): each in a process group of its
own (its launcher and every rank under it), signalled only through that group, and ended —
SIGTERM, then SIGKILL — on any exit of the bench: a time limit, Ctrl-C, SIGTERM, an
exception."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys

_JOBS: list = []                    # the jobs this bench started that may still run


def start_job(cmd, **kw) -> subprocess.Popen:
    """``cmd`` as a job of this bench: a process group of its own, ended with the bench."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    _JOBS.append(proc)
    return proc


def end_job(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End ``proc``'s process group: SIGTERM, ``grace`` seconds, SIGKILL; then reap it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    try:                              # ranks the launcher left behind in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _session(proc.pid):    # and in the session (Open MPI's: a group per rank)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc in _JOBS:
        _JOBS.remove(proc)


def _session(sid: int) -> list:
    """The PIDs of session ``sid`` (from /proc; none where there is no /proc)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:           # (state, ppid, pgrp, session, ...)
                out.append(int(name))
    return out


def owns(proc: subprocess.Popen, pid: int) -> bool:
    """Whether ``pid`` is a process of job ``proc`` (in its session), alive: a PID read from a
    file (ranks.json) may be another run's, or reused. The session, not the process group:
    Open MPI's launcher gives each rank a process group of its own (MPICH's keeps one)."""
    try:
        return proc.poll() is None and os.getsid(pid) == proc.pid
    except ProcessLookupError:
        return False


@atexit.register
def end_jobs() -> None:
    for proc in list(_JOBS):
        end_job(proc)


def exit_on_sigterm() -> None:
    """SIGTERM ends the bench through its exit handlers (its jobs ended with it)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def run_job(cmd, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` as a job of this bench: past
    ``timeout`` (or on any exception) its whole group is ended, then TimeoutExpired raised."""
    proc = start_job(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        end_job(proc)
        raise
    if proc in _JOBS:
        _JOBS.remove(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpiexec() -> str:
    """The venv's mpiexec (MPICH wheel) when there is one, else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def run_ranks(n: int, args: list, timeout: float = 1800) -> list:
    """Run ``python -m hpcdist.bench ARGS`` on n ranks; return rank 0's JSON result lines."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = run_job([mpiexec(), "-n", str(n), sys.executable, "-m", "hpcdist.bench", *args],
                timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark on {n} ranks failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines()
            if line.startswith("RESULT ")]


def relaunch(name: str, ranks: int, argv) -> list:
    """Run benchmark ``name``'s worker on ``ranks`` ranks with the same options."""
    rest = [a for a in (argv or []) if a != "--worker"]
    return run_ranks(ranks, [name, "--worker", *rest])


def emit(record: dict) -> None:
    """A worker's result line, read back by ``run_ranks``."""
    print("RESULT " + json.dumps(record), flush=True)


def table(rows: list, columns: list) -> str:
    """A fixed-width text table: columns are (header, key, format)."""
    head = " ".join(f"{h:>{max(len(h), 10)}s}" for h, _, _ in columns)
    lines = [head]
    for r in rows:
        cells = []
        for h, k, fmt in columns:
            v = r.get(k)
            cells.append(f"{(format(v, fmt) if v is not None else '-'):>{max(len(h), 10)}s}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def write_json(path: str, payload) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or a clear exit without it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def train_args(flags: dict, out: str) -> list:
    """The trainer's command-line arguments for ``flags`` (TrainConfig fields) and ``out``."""
    args = ["--out-dir", out]
    for k, v in flags.items():
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool):                   # train's flags are BooleanOptionalAction
            args.append(flag if v else f"--no-{k.replace('_', '-')}")
        else:
            args += [flag, str(v)]
    return args
