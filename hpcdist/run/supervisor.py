"""Name a rank that is killed: each ``python -m hpcdist.train`` process forks, before MPI
starts, into a small supervisor (the process the launcher started) and the rank itself.

Why: a rank killed with SIGKILL (``kill -9``, the OOM killer) cannot say anything, and the
launcher ends every other rank with SIGKILL the moment it notices: MPICH's mpiexec then
prints a PID that was not always the killed rank's. The supervisor is the killed rank's
parent, so ``waitpid`` tells it exactly how its rank ended, and it is still alive to say so,
before the launcher knows anything — the list goes on in docs/failures.md,
"hpcdist/run/supervisor.py"."""
from __future__ import annotations

import os
import signal
import socket
import sys

FORWARD = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
           signal.SIGQUIT, signal.SIGCONT)
_tell_fd = None          # the rank's end of the pipe to its supervisor


def start() -> None:
    """Fork here (before MPI starts); returns in the rank, never in the supervisor."""
    global _tell_fd
    if os.environ.get("HPCDIST_SUPERVISE", "1") == "0" or not hasattr(os, "fork") \
            or sys.platform != "linux":
        return
    sys.stdout.flush(), sys.stderr.flush()
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # the rank
        os.close(r)
        _die_with(parent)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        _tell_fd = w
        return
    os.close(w)
    _supervise(pid, r)


def tell(rank: int, size: int) -> None:
    """The rank says which rank it is (after MPI started), for the supervisor's report."""
    global _tell_fd
    if _tell_fd is not None:
        try:
            os.write(_tell_fd, f"{rank} {size}\n".encode())
            os.close(_tell_fd)
        except OSError:
            pass
        _tell_fd = None


def _die_with(parent: int) -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                   # the supervisor is already gone
        os._exit(1)


def _launcher_rank() -> str:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return os.environ[var]
    return "?"


def _supervise(child: int, r: int) -> None:
    """Wait for the rank, forwarding signals; report a death by signal; exit as it did."""
    # Every descriptor stays open here, the launcher's PMI socket too: the launcher takes
    # its closing for the rank's end, and it must not learn of that before we have said so.
    for sig in FORWARD:
        signal.signal(sig, lambda s, f: _forward(child, s))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        info = os.read(r, 64).decode().split() if _readable(r) else []
        rank, size = (info + [_launcher_rank(), "?"])[:2] if info else (_launcher_rank(), "?")
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        why = ("the OOM killer or a kill -9" if sig == signal.SIGKILL
               else "a crash outside Python" if sig in (signal.SIGSEGV, signal.SIGBUS,
                                                        signal.SIGABRT, signal.SIGFPE,
                                                        signal.SIGILL) else "a signal")
        then = "the survivors recover (--on-failure shrink)" if _shrinks() else "the job ends"
        os.write(2, f"[hpcdist] rank {rank} of {size} (host {socket.gethostname()}, pid "
                    f"{child}) was killed by {name}: {why}; {then}\n".encode())
        # under --on-failure shrink the job goes on without this rank, and its exit code is
        # the survivors' (Open MPI's launcher would report this one's 137 otherwise)
        os._exit(0 if _shrinks() else 128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _shrinks() -> bool:
    """Whether this run recovers in the job: --on-failure shrink on the command line, or
    ``on_failure = "shrink"`` in its --config file (the flag wins, as in config.py)."""
    argv = sys.argv[1:]
    flags = dict(zip(argv, argv[1:]))
    flags.update(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if "--on-failure" in flags:
        return flags["--on-failure"] == "shrink"
    try:
        import tomllib
        with open(flags["--config"], "rb") as f:
            table = tomllib.load(f)
        return (table.get("on_failure") or table.get("on-failure")) == "shrink"
    except Exception:                           # no file, no tomllib (3.10), a bad file
        return False


def _readable(fd: int) -> bool:
    import select
    return bool(select.select([fd], [], [], 0)[0])


def _forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass
