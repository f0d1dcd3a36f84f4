"""In-job recovery over MPI's fault-tolerance interface (ULFM): a rank that dies costs the
survivors one shrink, not the job (``--on-failure shrink``; docs/failures.md, "In-job recovery").

A survivor that sees MPI_ERR_PROC_FAILED (or MPI_ERR_REVOKED) revokes every communicator
hpcdist made, so each other survivor's wait ends too, and runs every registered abort (NCCL's
communicators: ``on_revoke``; a watcher thread in comm/nccl_watch.py starts that where the
stuck rank cannot). Every step ends in one agreement (``MPI_Comm_agree``) on a communicator of
its own before the optimizer changes any state: every survivor applies the step or none does.
A failed agreement raises ``RankLost``; the survivors shrink to themselves and go on. Open MPI 5
has it (``mpirun --with-ft ulfm --mca btl tcp,self``); MPICH's ch4 does not (MPICH #7426).
"""
from __future__ import annotations

import os
import sys
import threading

from mpi4py import MPI

from .ulfm_launch import LAUNCH

_comms: list = []                   # every communicator hpcdist made since the last recovery
_aborts: list = []                  # what ends other communicators' waits (NCCL's abort)
_world = None                       # the world recovery runs over (COMM_WORLD, or the survivors)
_lock = threading.RLock()           # a revoke (the NCCL watcher's thread) never meets a shrink
_stale = False                      # between a shrink and the next enable: old failures known
_ft = None                          # the agreement's own communicator (None: recovery off)
_commits = 0                        # steps agreed since the process started
_era = 0                            # recoveries so far: a wait from an earlier era is dropped


class RankLost(Exception):
    """A peer died: the step in flight is discarded on every survivor. ``committed``: what
    the survivors resume from (set by train's loop: step, sampler state, the model's state)."""

    def __init__(self, message: str = "a rank died"):
        super().__init__(message)
        self.committed = None


def problem() -> str | None:
    """Why in-job recovery cannot run under this MPI (None: it can), in one line."""
    version = MPI.Get_library_version()
    if "Open MPI" not in version:
        name = version.split(",")[0].split("\n")[0].strip()
        return (f"--on-failure shrink needs MPI's fault-tolerance interface (ULFM), which "
                f"{name or 'this MPI'} lacks: run under Open MPI 5 (`make venv-ompi`, then "
                f"`.venv-ompi/bin/{LAUNCH} -n N python -m hpcdist.train ...`)")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "") not in ("1", "true"):
        return (f"--on-failure shrink needs Open MPI's fault tolerance switched on: launch "
                f"with `{LAUNCH} -n N ...` (the shared-memory transport hangs on a failure)")
    return None


def enable(world) -> None:
    """Recovery on over ``world``: the agreement gets its own duplicate (collective)."""
    global _ft, _world, _stale
    ft = world.Dup()
    with _lock:
        _comms.clear()
        _aborts.clear()
        _world, _ft, _stale = world, ft, False


def enable_world() -> None:
    """Recovery on over MPI_COMM_WORLD, before hpcdist makes any communicator (collective)."""
    enable(MPI.COMM_WORLD)


def enabled() -> bool:
    return _ft is not None


def rank() -> int:
    """This rank's place among the ranks alive at the last recovery."""
    return _ft.Get_rank() if _ft is not None else MPI.COMM_WORLD.Get_rank()


def rank_count() -> int:
    """How many ranks the world has now (since the last recovery)."""
    return _ft.Get_size() if _ft is not None else MPI.COMM_WORLD.Get_size()


def register(mpi_comm) -> None:
    """A communicator to revoke when a peer dies (every one hpcdist makes)."""
    if _ft is not None:
        _comms.append(mpi_comm)


def on_revoke(abort) -> None:
    """``abort()`` runs when a peer dies, beside the MPI revokes (an NCCL communicator's)."""
    if _ft is not None:
        _aborts.append(abort)


def world():
    """The communicator recovery runs over now (None with recovery off): COMM_WORLD at the
    start, the survivors (with any ranks that joined) after a recovery."""
    return _world


def failure_known() -> bool:
    """Whether this process has learnt of a dead peer (MPI's runtime tells it; no message
    needed). Thread-safe under MPI_THREAD_MULTIPLE: the NCCL watcher asks from its thread."""
    ft = _ft
    if ft is None or _stale:
        return False
    try:
        return ft.Get_failed().Get_size() > 0
    except MPI.Exception as e:
        return is_failure(e)
    except (NotImplementedError, AttributeError):
        return False


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI telling of a dead peer (or of a revoke that followed one)."""
    if _ft is None or isinstance(exc, RankLost):
        return _ft is not None
    if not isinstance(exc, MPI.Exception):
        return False
    # (Testall on requests reports a dead peer as MPI_ERR_IN_STATUS: hpcdist's waits test
    # many at once, and under recovery no other error of theirs is expected)
    return exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                     MPI.ERR_REVOKED, MPI.ERR_IN_STATUS)


def revoke_all(in_era: int | None = None) -> None:
    """Interrupt every survivor's pending call on every communicator hpcdist made (NCCL's
    by their abort); ``in_era``: only if no recovery has happened since that era began."""
    with _lock:
        if in_era is not None and (in_era != _era or _stale):
            return
        for comm in list(_comms):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass
        for abort in list(_aborts):
            abort()


def commit(ok: bool = True) -> None:
    """The step's agreement, before any state changes: returns when every rank is alive and
    ``ok``; else raises RankLost on every survivor alike. A no-op with recovery off."""
    global _commits
    if _ft is None:
        return
    try:
        flag = _ft.Agree(1 if ok else 0)
    except MPI.Exception as e:
        if not is_failure(e):
            raise
        flag = 0
    if not flag:
        raise RankLost()
    _commits += 1


def commits() -> int:
    return _commits


def era() -> int:
    return _era


def shrink():
    """(the survivors' communicator, the ranks lost, numbered as they were in the world
    before: runs/ranks.json's) after a RankLost (collective over the survivors)."""
    old = _ft
    try:
        old.Ack_failed()
        failed = old.Get_failed()
        lost = sorted(failed.Translate_ranks(list(range(failed.Get_size())), old.Get_group()))
    except (MPI.Exception, NotImplementedError, AttributeError):
        lost = []
    survivors = old.Shrink()
    global _era, _stale
    with _lock:
        _era += 1
        _comms.clear()
        _aborts.clear()
        _stale = True
    return survivors, lost


def spawned() -> bool:
    """Whether the survivors of a job started this process to join them (--respawn)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def respawn(survivors, count: int, argv: list):
    """Start ``count`` processes of ``python -m hpcdist.train argv`` and merge them in after
    the survivors (collective over the survivors); the merged communicator."""
    inter = survivors.Spawn(sys.executable, ["-m", "hpcdist.train", *argv], maxprocs=count,
                            root=0)
    merged = inter.Merge(high=False)
    inter.Disconnect()
    return merged


def join():
    """In a process ``respawn`` started: the merged communicator (the survivors, then us)."""
    parent = MPI.Comm.Get_parent()
    merged = parent.Merge(high=True)
    parent.Disconnect()
    return merged
