"""A rank dies while the others wait inside NCCL (run by test_recovery.py under mpirun --with-ft
ulfm, 3 ranks, on the GPU stand-in).

A real NCCL kernel waiting for a dead peer never returns and no MPI revoke reaches it: here
the survivors' NCCL call blocks until the communicator is aborted, as a kernel does. Rank 2
dies inside that call. Nothing on the survivors' own thread can end the wait, so only the
watcher thread (comm/nccl.py: MPI's runtime knows of the death) aborting the communicator
lets them out. Each survivor prints how long it waited and whether its abort ran.
"""
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

from hpcdist.comm import nccl, ulfm
from hpcdist.device import backend

backend.init("standin")
ulfm.enable_world()
nc = nccl.NcclCommunicator(MPI.COMM_WORLD)
rank = nc.rank
released = threading.Event()
stand_in_abort = nc.comm.abort


def abort():
    released.set()
    stand_in_abort()


def stuck_kernel(*args):
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if not released.wait(60):
        print(f"rank {rank}: never released", flush=True)
        os._exit(1)


nc.comm.abort, nc.comm.allReduce = abort, stuck_kernel
t0 = time.monotonic()
nc.allreduce(backend.xp().ones(4))
print(f"rank {rank}: released by the abort after {time.monotonic() - t0:.2f} s", flush=True)
sys.stdout.flush()
os._exit(0)          # (MPI_Finalize with a dead peer may wait: the job is over)
