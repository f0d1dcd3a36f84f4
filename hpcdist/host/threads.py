"""BLAS/OpenMP threads per rank: the cores a node has, shared among the ranks on it.

Without this, every rank of ``mpirun -n 8 python -m hpcdist.train`` starts one BLAS thread per
core, and 8 ranks on 2 cores fight over them (measured: 780 ms/step against 75 ms/step with
one thread each). torchrun sets one thread per process; we set cores // ranks-per-node.

The rest of this design: docs/training.md, "hpcdist/host/threads.py"."""
from __future__ import annotations

import os

USER_VARS = ("HPCDIST_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
SET_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# Ranks on this node, as MPICH (Hydra), Open MPI and MVAPICH tell each rank.
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")

# What hpcdist set itself is marked, so that a process it starts (a benchmark's mpiexec, a
# test's) does not take the parent's choice — one process on the node — for the user's.
MARK = "HPCDIST_THREADS_CHOSEN"


def _users_setting():
    for v in USER_VARS:
        value = os.environ.get(v, "").strip()
        if value.isdigit() and int(value) > 0 and value != os.environ.get(MARK):
            return v
    return None


_user = _users_setting()                               # decided at import
choice = ""                                            # what was chosen, for the run header
threads = 0
_applied = 0                                           # the count threadpoolctl last applied


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):                  # not Linux
        return os.cpu_count() or 1


def decide(local_size: int | None) -> tuple[int, str]:
    """(threads per rank, why) under the rule above; ``local_size`` None = unknown."""
    if _user is not None:
        n = int(os.environ[_user])
        return n, f"{n} per rank ({_user}={n}, yours)"
    cores, total = usable_cores(), os.cpu_count() or 1
    if cores < total:
        return cores, f"{cores} per rank (the launcher bound this rank to {cores} of {total} cores)"
    ranks = local_size or 1
    n = max(1, cores // ranks)
    return n, f"{n} per rank ({cores} cores / {ranks} rank{'s' * (ranks != 1)} on this node)"


def _env_local_size() -> int | None:
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _set(n: int, why: str) -> None:
    global threads, choice
    threads, choice = n, why
    if _user is None:
        for var in SET_VARS:
            os.environ[var] = str(n)
        os.environ[MARK] = str(n)


def early() -> None:
    """Set the thread variables before NumPy loads (hpcdist/__init__.py calls this first)."""
    if os.environ.get("HPCDIST_THREADS_AUTO", "1") == "0":
        return
    _set(*decide(_env_local_size()))


def configure(local_size: int) -> str:
    """Apply the rule with the exact number of ranks on this node to the BLAS/OpenMP libraries
    already loaded; return the choice (for the run header)."""
    if os.environ.get("HPCDIST_THREADS_AUTO", "1") == "0":
        return "left to the libraries (HPCDIST_THREADS_AUTO=0)"
    n, why = decide(local_size)
    _set(n, why)
    if n != _applied:
        _limit(n)
    return choice


def _limit(n: int) -> None:
    global _applied
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:                                # the environment variables must do
        return
    threadpool_limits(limits=n)
    _applied = n
    _hold_blas(n)


blas_single = False    # BLAS held to one thread a call: host/pool.py spreads the work itself


def limit(n: int) -> None:
    """This process on ``n`` threads (a benchmark's contenders): BLAS, OpenMP and numba as a
    run of ``n`` threads per rank has them."""
    global threads
    threads = n
    _limit(n)


def _hold_blas(n: int) -> None:
    """With more than one thread, BLAS on one thread a call where host/pool.py spreads the
    work itself (it says why and when)."""
    global blas_single
    from . import blas as callable_blas
    from threadpoolctl import threadpool_info
    # whether a BLAS is loaded (not from the limits' original counts: NumPy's and MKL's
    # differ, and threadpoolctl warns of it)
    blas = any(i.get("user_api") == "blas" for i in threadpool_info())
    blas_single = n > 1 and blas and callable_blas.split_here()
    if blas_single:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1, user_api="blas")


def release_blas() -> None:
    """BLAS back on this rank's threads (the kernels that would have split its work did not
    load)."""
    global blas_single
    if blas_single:
        blas_single = False
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=threads, user_api="blas")
