"""A save folder belongs to one run, and one job at a time: checked before any work.

What a run is about to write is checked on every rank that writes it, before step 1
(``check_writable``): a folder inside a regular file, a read-only place or a full quota is
one line and exit code 2 at start-up, not a traceback after the last step.

``--save-dir`` holds two small files beside the checkpoints — the list goes on in
docs/failures.md, "hpcdist/run/savedir.py"."""
from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid

from ..comm.stall import alive  # a process that still runs (a zombie does not)
from ..host import folders

RUN = "run.json"
LOCK = ".lock"
# What a run writes in its save folder (and its out folder's files, which may share it)
OURS = (RUN, f"{RUN}.tmp.*", LOCK, "latest", "latest.tmp.*", "step_*", "partial.*",
        ".hpcdist-probe-*", "train.log", "train.log.*", "metrics.jsonl", "metrics.jsonl.*",
        "ranks.json", "ranks.json.tmp.*", "comm_log.json", "comm_log.json.*",
        "tensorboard", "wandb")                 # (--tensorboard, --wandb: run/sinks.py)
HEARTBEAT_S = 10.0
STALE_S = 60.0


class SaveDirError(RuntimeError):
    """The save folder cannot be used by this run; the message says what to do."""


# ---- every path a run writes -------------------------------------------------------------

def check_writable(path: str, what: str, folder: bool = True) -> str | None:
    """Why ``path`` (a folder, or a file when ``folder`` is False) cannot be written by this
    process (None: it can). Creates a missing folder, as the run would; writes and removes
    a probe file in it."""
    if not path:
        return None
    target = path if folder else (os.path.dirname(path) or ".")
    if not folder and os.path.isdir(path):
        return f"{what} {path!r} is a folder; give a file name"
    probe = os.path.join(target, f".hpcdist-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(target, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        blocker = _file_in_the_way(target)
        reason = f"{blocker!r} is a file, not a folder" if blocker else (e.strerror or str(e))
        return f"{what} {path!r} cannot be written: {reason}"
    return None


def _file_in_the_way(folder: str) -> str | None:
    """The first part of ``folder``'s path that exists and is not a folder (None: none)."""
    parts = os.path.abspath(folder).split(os.sep)
    for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i])
        if os.path.exists(head) and not os.path.isdir(head):
            return os.path.relpath(head) if not os.path.isabs(folder) else head
        if not os.path.exists(head):
            return None
    return None


def writable_problems(cfg, rank: int) -> str | None:
    """The first path of the run this rank would fail to write: rank 0 writes the out
    folder, the trace and the communication log; every rank writes its checkpoint files."""
    checks = [(cfg.save_dir, "--save-dir", True)]
    if rank == 0:
        checks += [(cfg.out_dir, "--out-dir", True), (cfg.trace, "--trace", False)]
    for path, what, folder in checks:
        problem = check_writable(path, what, folder)
        if problem:
            return problem
    return None


# ---- whose folder it is --------------------------------------------------------------------

def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def has_checkpoints(folder: str) -> int | None:
    """The newest step a folder's checkpoints name (0 when only 'latest' is there), None when
    it holds none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    steps = [int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()]
    if steps:
        return max(steps)
    return 0 if "latest" in names else None


def holder(folder: str):
    """(the lock's contents, whether its job still runs), or (None, False) when unlocked."""
    path = os.path.join(folder, LOCK)
    lock = _read_json(path)
    if lock is None:
        if os.path.exists(path):               # being written this instant, or damaged
            try:
                age = time.time() - os.path.getmtime(path)
            except OSError:
                return None, False
            return {"host": "?", "pid": 0, "started": "?"}, age < STALE_S
        return None, False
    if lock.get("host") == socket.gethostname():
        return lock, alive(int(lock.get("pid", 0)))
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return None, False
    return lock, age < STALE_S


def describe(lock: dict) -> str:
    job = f", SLURM job {lock['job']}" if lock.get("job") else ""
    return f"host {lock.get('host')}, pid {lock.get('pid')}, started {lock.get('started')}{job}"


def _moved_aside(folder: str) -> str:
    n = 1
    while os.path.exists(f"{folder}.old-{n}"):
        n += 1
    os.rename(folder, f"{folder}.old-{n}")
    return f"{folder}.old-{n}"


class _Heartbeat(threading.Thread):
    def __init__(self, path):
        super().__init__(name="hpcdist-savedir-lock", daemon=True)
        self.path, self.stopping = path, threading.Event()

    def run(self):
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return


_held: dict = {}
_made_files: list = []      # what claim() created: undone when the run is refused after it
_made_dirs: list = []       # (folders deepest first; never a path that existed before)


def _missing_folders(path: str) -> list[str]:
    """The folders of ``path`` (itself included) that do not exist yet, deepest first: what
    creating it makes, and all that a refusal may take back."""
    missing, head = [], os.path.abspath(path)
    while head and not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    return missing


def claim(save_dir: str, resume: bool, overwrite: bool, argv=None, *, data: str = "",
          others_ok: bool = False, trace: str = "") -> list[str]:
    """Make ``save_dir`` this run's, for this job (rank 0 only). Returns the lines to print;
    raises SaveDirError when the folder belongs to a running job or to another run, holds
    files no run wrote (unless ``others_ok``), holds the training data ``data``, or
    (``resume``) does not exist: a mistyped name would start over; an empty folder starts
    at step 0 (a requeued job's first attempt)."""
    said = []
    if resume and not os.path.isdir(save_dir):
        raise SaveDirError(f"--resume: --save-dir {save_dir!r} does not exist (a mistyped "
                           "name?); an empty folder starts at step 0: create it for a first "
                           "run that later runs resume")
    problem = _not_a_run_folder(save_dir, data, others_ok, trace)
    if problem:
        raise SaveDirError(problem)
    _made_dirs[:0] = _missing_folders(save_dir)     # (check_writable makes them)
    problem = check_writable(save_dir, "--save-dir")
    if problem:
        raise SaveDirError(problem)
    lock, alive = holder(save_dir)
    if lock is not None and alive:
        raise SaveDirError(f"--save-dir {save_dir!r} is in use by another job ({describe(lock)})"
                           ": wait for it to end, or use another --save-dir")
    step = has_checkpoints(save_dir)
    run = _read_json(os.path.join(save_dir, RUN)) or {}
    command = " ".join(["python -m hpcdist.train"] + list(
        argv if argv is not None else sys.argv[1:]))
    overwriting = not resume and step is not None
    if overwriting:
        who = f"run {run['id']} (started {run.get('started', '?')})" if run.get("id") else \
            "another run"
        if not overwrite:
            raise SaveDirError(
                f"--save-dir {save_dir!r} holds the checkpoints of {who}, up to step {step}: "
                "add --resume to continue it, or --overwrite to move it aside and start afresh")
    os.makedirs(save_dir, exist_ok=True)
    if lock is not None:                        # its job is gone: take the lock over
        said.append(f"took over the lock of {save_dir}, left by a job that is gone "
                    f"({describe(lock)})")
        try:
            os.remove(os.path.join(save_dir, LOCK))
        except FileNotFoundError:
            pass
    _take_lock(save_dir)
    if overwriting:             # moved aside by commit(), once the whole run is validated
        _pending.append((save_dir, who, command))
        return said
    said += remove_partial_saves(save_dir)
    if not resume or not run.get("id"):
        _made_files.append(os.path.join(save_dir, RUN))
        _write_run(save_dir, command)
    return said


def _not_a_run_folder(save_dir: str, data: str, others_ok: bool, trace: str) -> str | None:
    """Why ``save_dir`` is not a folder for checkpoints: it holds the training data (never
    allowed: checkpoints and --overwrite's move would go among the shards), or files no run
    wrote there (a folder of photos, a model folder) unless ``others_ok``."""
    if data and os.path.exists(data) and folders.inside(data, save_dir):
        return (f"--save-dir {save_dir!r} holds the training data --data {data!r}: "
                "checkpoints go in a folder of their own")
    if others_ok:
        return None
    ours = OURS + ((os.path.basename(trace),) if trace else ())
    return folders.refusal(save_dir, "--save-dir", ours)


def _write_run(save_dir: str, command: str) -> None:
    _write_json(os.path.join(save_dir, RUN), {
        "id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": socket.gethostname(), "command": command})


_pending: list = []         # --overwrite's moves, held until the run is validated


def commit() -> list[str]:
    """The run is validated on every rank: carry out ``--overwrite`` (rank 0 only). The old
    run's folder, locked by this job since ``claim``, is renamed to ``NAME.old-N`` (nothing
    deleted) and a fresh folder takes its place; a run refused before this point has moved
    nothing. Returns the lines to print."""
    said = []
    for save_dir, who, command in _pending:
        _let_go(os.path.join(save_dir, LOCK))
        aside = _moved_aside(save_dir)
        try:
            os.remove(os.path.join(aside, LOCK))    # (ours: the old run's folder is unlocked)
        except FileNotFoundError:
            pass
        os.makedirs(save_dir)
        _take_lock(save_dir)
        _write_run(save_dir, command)
        said.append(f"--overwrite: moved {who} from {save_dir} to {aside} (nothing deleted)")
    _pending.clear()
    return said


def _let_go(path: str) -> None:
    """Stop the heartbeat of a lock this process holds (the file stays where it is)."""
    me_beat = _held.pop(path, None)
    if me_beat is not None:
        me_beat[1].stopping.set()
        me_beat[1].join()


def unclaim() -> None:
    """A run refused after ``claim``: remove the run.json it wrote and the folders it created
    (each only while empty, once ``release`` has given the lock back). Nothing that existed
    before ``claim`` is touched: a path that was the user's file or folder is never on the
    lists."""
    release()
    _pending.clear()
    for path in _made_files:
        try:
            os.remove(path)
        except OSError:
            pass
    for path in _made_dirs:
        try:
            os.rmdir(path)                  # (fails, harmlessly, on a folder that is not empty)
        except OSError:
            pass
    _made_files.clear()
    _made_dirs.clear()


def remove_partial_saves(save_dir: str) -> list[str]:
    """Remove what an interrupted save left (``partial.step_…`` folders, a step folder
    without its manifest, temporary files; a same-step swap cut off is put back); the lines
    that say so. Run by the job that holds the folder's lock."""
    said = []
    for stage in sorted(glob.glob(os.path.join(save_dir, "partial.*"))):
        step = os.path.join(save_dir, os.path.basename(stage).split(".")[-1])
        if ".replaced." in stage and not os.path.exists(step):   # cut off mid-swap: put back
            os.rename(stage, step)
            said.append(f"restored {step}, moved aside by a save of the same step that was "
                        "cut off")
            continue
        shutil.rmtree(stage, ignore_errors=True)
        said.append(f"removed {stage}, left incomplete by an interrupted save")
    for folder in sorted(glob.glob(os.path.join(save_dir, "step_*"))):
        if not os.path.isdir(folder):
            continue
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*"))
                       if os.path.isfile(p))
            shutil.rmtree(folder, ignore_errors=True)
            said.append(f"removed {folder}, left incomplete by an interrupted save "
                        f"({size / 2 ** 20:,.1f} MiB, no manifest)")
            continue
        for tmp in glob.glob(os.path.join(folder, "*.tmp.*")):
            os.remove(tmp)
            said.append(f"removed {tmp}, a temporary file left by an interrupted save")
    return said


def claim_out_dir(out_dir: str, save_dir: str = "") -> None:
    """Make ``out_dir`` this job's while it runs (rank 0 only): two live runs in one folder
    would move each other's metrics.jsonl aside and overwrite ranks.json. A lock left by a
    job that is gone is taken over."""
    if not out_dir or (save_dir and os.path.realpath(out_dir) == os.path.realpath(save_dir)):
        return                                   # the save folder's lock covers it
    os.makedirs(out_dir, exist_ok=True)
    lock, alive = holder(out_dir)
    if lock is not None and alive:
        raise SaveDirError(f"--out-dir {out_dir!r} is in use by another job ({describe(lock)})"
                           ": its metrics.jsonl and ranks.json would be mixed with this run's; "
                           "pass another --out-dir")
    if lock is not None:
        try:
            os.remove(os.path.join(out_dir, LOCK))
        except FileNotFoundError:
            pass
    _take_lock(out_dir, "--out-dir")


def _take_lock(save_dir: str, what: str = "--save-dir") -> None:
    path = os.path.join(save_dir, LOCK)
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "job": os.environ.get("SLURM_JOB_ID", "")}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:                     # another job took it a moment ago
        other, _ = holder(save_dir)
        raise SaveDirError(f"{what} {save_dir!r} is in use by another job "
                           f"({describe(other or {})}): wait for it to end, or use another "
                           f"{what}") from None
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    beat = _Heartbeat(path)
    beat.start()
    _held[path] = (me, beat)


@atexit.register
def release() -> None:
    """Give back the locks this process holds (at exit; a killed job's lock goes stale)."""
    for path, (me, beat) in list(_held.items()):
        beat.stopping.set()
        lock = _read_json(path)
        if lock is not None and lock.get("pid") == me["pid"] and lock.get("host") == me["host"]:
            try:
                os.remove(path)
            except OSError:
                pass
        del _held[path]
