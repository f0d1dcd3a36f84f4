"""Stopping a run cleanly when the scheduler asks: SIGUSR1/SIGTERM -> checkpoint -> exit 75.

SLURM sends USR1 before a time limit (``--signal=B:USR1@T``, forwarded to the ranks by the
job scripts in jobs/) and TERM on preemption or ``scancel``. ``train`` polls a
``StopRequest`` once per step; when the ranks agree that one of them was signalled, it saves a
checkpoint and returns, and ``python -m hpcdist.train`` exits with ``EXIT_PREEMPTED``, on
which the job scripts requeue.
"""
from __future__ import annotations

import numpy as np

from ..host import signals

# Exit code of a run that stopped on a signal after saving a checkpoint: the job scripts in
# jobs/ requeue on it (75 is EX_TEMPFAIL, "try again later").
EXIT_PREEMPTED = 75


class StopRequest:
    """SIGUSR1 or SIGTERM ask a run with a checkpoint folder to save and stop: SLURM sends them
    before a time limit (``--signal``), on preemption and on ``scancel``. What the signals
    mean is decided once, at the entry point (``signals.checkpoint_on_signal``); this object
    only reads the request. Ranks see a signal at different moments, so they agree: at the
    end of every step each rank starts a non-blocking 8-byte MAX allreduce of "signal seen"
    and reads the previous step's result, which is the same on every rank. A signal during
    step k stops every rank after step k+1; the exchange runs in the progress thread and
    costs the step nothing it would notice."""

    def __init__(self):
        self._pending = None

    @property
    def signum(self) -> int:
        return signals.requested()

    def before_first_step(self, comm) -> int:
        """The stop signal any rank has received before the first step (0: none), agreed
        with one blocking allreduce. Collective."""
        return int(comm.allreduce(np.array([float(self.signum)]), op="max")[0])

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
