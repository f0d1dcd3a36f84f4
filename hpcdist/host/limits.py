"""The process limits a run cannot start under, asked before MPI_Init (whose own failure is a
C error stack on every rank)."""
from __future__ import annotations

import os
import sys

MIN_FILE_SIZE = 16 << 20     # MPICH's shared memory maps files of 4 MiB and more


def file_size_problem() -> str | None:
    """Why MPI cannot start under this process's file-size limit (``ulimit -f``), asked before
    MPI_Init: below ``MIN_FILE_SIZE`` MPI's shared-memory files (4 MiB a segment, measured
    with the MPICH wheel: ``ulimit -f 4096`` fails, 8192 starts) cannot be written and
    MPI_Init aborts with a C stack of its own."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft == resource.RLIM_INFINITY or soft >= MIN_FILE_SIZE:
        return None
    return (f"the file-size limit (ulimit -f) is {soft // 1024:,} KiB: MPI's shared memory "
            f"needs files of 4 MiB and more, and checkpoints larger still; raise it to at "
            f"least {MIN_FILE_SIZE >> 10:,} (ulimit -f unlimited)")


def refuse_before_mpi(prog: str) -> None:
    """Exit 2 with one line (from the launcher's rank 0 alone) when a limit stops MPI."""
    problem = file_size_problem()
    if problem is None:
        return
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
        print(f"{prog}: error: {problem}", file=sys.stderr)
    sys.exit(2)
