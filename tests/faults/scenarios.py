"""Faults injected into library use of hpcdist: ``mpiexec -n 4 python scenarios.py NAME``.

Each scenario is what a real program does wrong on one rank (rank ``BAD`` = 1 unless it says
otherwise). test_faults.py runs each one under a hard timeout and checks how the job ends:
how fast, with which exit code, and that the rank named is the one the fault was put into.
Nothing here catches the errors: the point is what a user's program sees when it does not.
"""
import os
import sys
import time

import numpy as np

from hpcdist.comm import Communicator

BAD = 1


def extra_call_then_barrier(comm):
    """One rank calls one extra allreduce; then every rank calls barrier."""
    if comm.rank == BAD:
        comm.allreduce(np.full(4, 100.0))
    comm.barrier()


def extra_call_same_size(comm):
    """One rank calls one extra allreduce of the size every rank calls next: without debug
    mode the calls match field for field; the extra one is left waiting alone."""
    x = np.ones(4)
    if comm.rank == BAD:
        comm.allreduce(np.full(4, 100.0))
    comm.allreduce(x)
    print(f"rank {comm.rank} finished its calls", flush=True)
    # Stay alive until the waiting rank's deadline ends the job: had these ranks exited,
    # MPICH's launcher sometimes SIGKILLs the job as they exit (exit code 9, 1 run in 30,
    # with and without short calls), before the watchdog can name the rank left waiting.
    time.sleep(10 * float(os.environ.get("HPCDIST_TIMEOUT", "3")))


def skipped_call(comm):
    """One rank skips an allreduce the others make, then everyone allreduces again."""
    if comm.rank != BAD:
        comm.allreduce(np.ones(8))
    comm.allreduce(np.ones(3))


def other_collective(comm):
    """One rank broadcasts where the others allreduce."""
    x = np.ones(5)
    comm.bcast(x) if comm.rank == BAD else comm.allreduce(x)


def blocking_vs_nonblocking(comm):
    """One rank waits on an iallreduce where the others call allreduce."""
    x = np.ones(5)
    comm.iallreduce(x).wait() if comm.rank == BAD else comm.allreduce(x)


def big_endian(comm):
    """One rank passes a big-endian float32 buffer (once: results 3, 1, 3, 2 instead of 4)."""
    x = np.ones(4, dtype=">f4" if comm.rank == BAD else "<f4")
    print(f"rank {comm.rank} got {comm.allreduce(x)}", flush=True)


def readonly_out(comm):
    """One rank passes a read-only out= buffer."""
    x = np.ones(4)
    out = np.empty(4)
    if comm.rank == BAD:
        out.flags.writeable = False
    comm.allreduce(x, out=out)


def wrong_shape_out(comm):
    x = np.ones(4)
    comm.allreduce(x, out=np.empty(5 if comm.rank == BAD else 4))


def exception_main(comm):
    """One rank raises while the others are in an allreduce."""
    if comm.rank == BAD:
        raise RuntimeError(f"injected failure on rank {comm.rank}")
    comm.allreduce(np.ones(4))


def _break_ring(comm):
    import dataclasses

    from hpcdist.comm import registry

    def broken(mpi, buf, op):
        raise MemoryError(f"injected failure inside the ring on rank {comm.rank}")
    if comm.rank == BAD:
        ring = registry.get("ring")
        registry.register(dataclasses.replace(ring, runs={**ring.runs, "allreduce": broken}))


def exception_progress_waited(comm):
    """A failure inside a non-blocking collective's data exchange, and its handle waited."""
    _break_ring(comm)
    comm.iallreduce(np.ones(1000), algorithm="ring").wait()


def exception_progress_not_waited(comm):
    """The same failure, and nobody ever waits on the handle."""
    _break_ring(comm)
    handle = comm.iallreduce(np.ones(1000), algorithm="ring")   # noqa: F841 (kept, never waited)
    time.sleep(30)


def mismatch_not_waited(comm):
    """A non-blocking call whose arguments disagree, never waited; the program goes on."""
    comm.iallreduce(np.ones(4 + (comm.rank == BAD)))
    time.sleep(0.5)
    comm.allreduce(np.ones(2))


def stall(comm):
    """One rank stops (SIGSTOP) before a collective the others enter."""
    import signal
    for _ in range(3):
        comm.allreduce(np.ones(4))
    if comm.rank == int(os.environ.get("FAULT_RANK", BAD)):
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.allreduce(np.ones(4))


def sigterm_in_collective(comm):
    """The scheduler's SIGTERM reaches a rank blocked in a collective (no handler of its own):
    rank BAD is late, and terminates rank 2 while rank 2 waits for it."""
    import signal
    pids = comm.allgather(np.array([os.getpid()]))
    comm.allreduce(np.ones(4))
    if comm.rank == BAD:
        time.sleep(1.0)
        os.kill(int(pids[2]), signal.SIGTERM)
        time.sleep(30)
    comm.allreduce(np.ones(4))


def nccl_stalled_receive(comm):
    """Over NCCL (the NCCL stand-in), rank 0 waits for a message that rank BAD
    never sends; the other ranks wait in a barrier."""
    from hpcdist.device import backend
    from hpcdist.comm.nccl import NcclCommunicator
    backend.init("standin", comm.local_rank)
    nc = NcclCommunicator(host=comm)
    nc.allreduce(backend.xp().ones(4))
    if comm.rank == 0:
        nc.irecv(BAD, 3, shape=(4,), dtype=np.float64).wait()
    comm.barrier()


if __name__ == "__main__":
    name = sys.argv[1]
    c = Communicator()
    globals()[name](c)
    print(f"rank {c.rank}: {name} returned", flush=True)
