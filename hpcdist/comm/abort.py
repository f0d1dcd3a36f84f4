"""End the whole MPI job when any rank dies: print that rank's traceback, then MPI_Abort.

Without this, an exception on one rank leaves the others blocked in their next collective
until the job's time limit. ``install()`` covers the main thread and every other thread (the
progress thread of non-blocking collectives included); the first ``Communicator()`` calls it
unless told not to (``abort_on_error=False`` or ``HPCDIST_ABORT=0``).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import traceback

_installed = False


def _abort(rank: int, size: int, exc_type, exc, tb) -> None:
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):   # a forced stop
        sys.stderr.write(f"[hpcdist] rank {rank}: {exc or 'interrupted'}; ending the job\n")
        sys.stderr.flush()
        end_job(130)
        return
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"\n[hpcdist] rank {rank} of {size} (host {socket.gethostname()}, pid "
                     f"{os.getpid()}) failed; ending the job:\n{text}")
    sys.stderr.flush()
    end_job(1)


# MPICH's launcher tears the job down on MPI_Abort before its proxy has forwarded the rank's
# last output: without a pause the traceback above is lost about one time in three (seen
# under `mpiexec ... 2> file`). 0.25 s was enough in 50 of 50 tries here.
FLUSH_PAUSE_S = 0.25


def end_job(code: int) -> None:
    """MPI_Abort with ``code``, after giving the launcher time to forward what we printed."""
    from mpi4py import MPI
    import time
    time.sleep(FLUSH_PAUSE_S)
    MPI.COMM_WORLD.Abort(code)


def install() -> None:
    """Abort the job on an uncaught exception in any thread of any rank (idempotent).

    On a single-rank run the normal Python behaviour is kept.
    """
    global _installed
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if _installed or size == 1:
        return
    _installed = True
    sys.excepthook = lambda t, e, tb: _abort(rank, size, t, e, tb)
    threading.excepthook = lambda a: _abort(rank, size, a.exc_type, a.exc_value,
                                            a.exc_traceback)


def fatal(message: str, exc: BaseException | None = None) -> None:
    """An error no caller will see (a progress-thread failure, a dropped handle): end the job
    where ``install()`` ran, else print it."""
    if exc is None:
        exc = RuntimeError(message)
    elif message:
        exc = RuntimeError(message).with_traceback(exc.__traceback__)
    if _installed:
        from mpi4py import MPI
        _abort(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), type(exc), exc,
               exc.__traceback__)
    else:
        sys.stderr.write(f"[hpcdist] {message}\n")
