"""Stopping a run cleanly when the scheduler asks: SIGUSR1/SIGTERM -> checkpoint -> exit 75.

SLURM sends USR1 before a time limit (``--signal=B:USR1@T``, forwarded to the ranks by the
job scripts in jobs/) and TERM on preemption or ``scancel``. ``train`` polls a
``StopRequest`` once per step; when the ranks agree that one of them was signalled, it saves a
checkpoint and returns, and ``python -m hpcdist.train`` exits with ``EXIT_PREEMPTED``, on
which the job scripts requeue.
"""
from __future__ import annotations

import signal
import threading

import numpy as np

# Exit code of a run that stopped on a signal after saving a checkpoint: the job scripts in
# jobs/ requeue on it (75 is EX_TEMPFAIL, "try again later").
EXIT_PREEMPTED = 75


class StopRequest:
    """SIGUSR1 or SIGTERM ask a run with a checkpoint folder to save and stop: SLURM sends them
    before a time limit (``--signal``), on preemption and on ``scancel``. Ranks see a signal
    at different moments, so they agree: at the end of every step each rank starts a
    non-blocking 8-byte MAX allreduce of "signal seen" and reads the previous step's result,
    which is the same on every rank. A signal during step k stops every rank after step k+1;
    the exchange runs in the progress thread and costs the step nothing it would notice."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._previous = {}
        self._pending = None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False                      # Python delivers signals to the main thread only
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def _handle(self, signum, frame):
        self.signum = signum

    def poll(self, comm, more: bool = True) -> int:
        """The signal any rank had seen by the previous poll (0: none); then, if ``more``
        and none, starts the next exchange. Collective: every rank polls every step."""
        agreed = 0
        if self._pending is not None:
            agreed = int(self._pending.wait()[0])
            self._pending = None
        if more and not agreed:
            self._pending = comm.iallreduce(np.array([float(self.signum)]), op="max")
        return agreed

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
