"""What SIGTERM and SIGUSR1 mean in this process, decided once, at the entry point.

Two meanings, never switched back and forth during a run — the list goes on in
docs/failures.md, "hpcdist/host/signals.py"."""
from __future__ import annotations

import signal
import threading

EXIT, STOP = "exit", "stop"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 130      # the shell's code for Ctrl-C (128 + SIGINT)

_mode = EXIT
_stopping: tuple = ()   # the signals that request a stop in STOP mode
_requested = 0          # the first stop signal received (0: none)


def mode() -> str:
    return _mode


def checkpoint_on_signal(checkpoint: bool = True) -> bool:
    """From now on SIGINT — and with ``checkpoint`` SIGTERM and SIGUSR1 — request a stop
    (``STOP``). Main thread only (Python delivers signals there); returns False elsewhere,
    and nothing changes."""
    global _mode, _stopping
    if threading.current_thread() is not threading.main_thread():
        return False
    _stopping = STOP_SIGNALS if checkpoint else (signal.SIGINT,)
    for sig in _stopping:
        signal.signal(sig, _handler)
    _mode = STOP
    return True


def stops(signum: int) -> bool:
    """Whether ``signum`` requests a stop now."""
    return _mode == STOP and signum in _stopping


def exit_on_signal() -> None:
    """Back to ``EXIT`` (a library caller's ``train`` ends): default SIGUSR1, and SIGTERM
    handled by the watchdog again."""
    global _mode, _requested, _stopping, _interrupts
    if _mode != STOP or threading.current_thread() is not threading.main_thread():
        return
    _mode, _requested, _stopping, _interrupts = EXIT, 0, (), 0
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _exit_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    if not _requested and stops(signum):
        _requested = signum


def requested() -> int:
    """The stop signal received so far (0: none)."""
    return _requested


_interrupts = 0         # SIGINTs this process's handler has run for (the watchdog's thread
                        # notes a signal too, possibly first: not counted here)


def _handler(signum, frame):
    global _interrupts
    _interrupts += signum == signal.SIGINT
    if _interrupts > 1:                             # a second Ctrl-C: stop now, not later
        raise KeyboardInterrupt("a second Ctrl-C: stopped at once, without a checkpoint (a "
                                "save in progress was abandoned; the last complete one stays "
                                "'latest')")
    note(signum)
