"""What SIGTERM and SIGUSR1 mean in this process, decided once, at the entry point.

Two meanings, never switched back and forth during a run:

- ``EXIT`` (the default, library use): a SIGTERM ends the rank at once; the watchdog says
  where it was and exits with 143 (comm/watchdog.py). SIGUSR1 keeps its default.
- ``STOP`` (a run that checkpoints, chosen by ``python -m hpcdist.train --save-dir``): from
  the moment it is chosen until the process exits, SIGTERM and SIGUSR1 only record a stop
  request. The training loop polls it (preemption.StopRequest), saves and exits with the
  requeue code; before the first step it exits with that code at once (nothing new to save),
  after the last step the run simply finishes.

The meaning used to be read off whichever handler was installed when the watchdog thread got
round to a signal, and ``train`` installed its handler late and put the old one back early: a
SIGTERM in those windows (or one read after the restore) ended a checkpointing run with 143
instead of 75, and the job dropped out of the queue.
"""
from __future__ import annotations

import signal
import threading

EXIT, STOP = "exit", "stop"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_mode = EXIT
_requested = 0          # the first stop signal received (0: none)


def mode() -> str:
    return _mode


def checkpoint_on_signal() -> bool:
    """From now on SIGTERM/SIGUSR1 request a stop (``STOP``). Main thread only (Python
    delivers signals there); returns False elsewhere, and nothing changes."""
    global _mode
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
    _mode = STOP
    return True


def exit_on_signal() -> None:
    """Back to ``EXIT`` (a library caller's ``train`` ends): default SIGUSR1, and SIGTERM
    handled by the watchdog again."""
    global _mode, _requested
    if _mode != STOP or threading.current_thread() is not threading.main_thread():
        return
    _mode, _requested = EXIT, 0
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _exit_handler)


_exit_handler = signal.SIG_DFL     # SIGTERM in EXIT mode; the watchdog sets its own (see there)


def set_exit_handler(handler) -> None:
    """The SIGTERM handler of ``EXIT`` mode from now on (the watchdog's, once it runs:
    it leaves the decision to its thread, which reads the wakeup fd)."""
    global _exit_handler
    _exit_handler = handler


def note(signum: int) -> None:
    """Record a stop request (from the handler, or from the watchdog thread, which sees the
    signal through the wakeup fd even while the main thread is inside an MPI call)."""
    global _requested
    if _mode == STOP and not _requested and signum in STOP_SIGNALS:
        _requested = signum


def requested() -> int:
    """The stop signal received so far (0: none)."""
    return _requested


def _handler(signum, frame):
    note(signum)
