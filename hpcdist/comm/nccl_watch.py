"""The watcher that aborts NCCL when a peer dies (``--on-failure shrink`` over NCCL).

NCCL has no revoke: a kernel waiting for a dead peer never returns, and the rank stuck in the
wait cannot act. This thread can: it looks at what MPI's runtime knows of dead processes and
at NCCL's asynchronous error of each live communicator, and on either runs
``ulfm.revoke_all`` (MPI's revokes and every registered NCCL abort). docs/failures.md."""
from __future__ import annotations

import threading
import time

from . import ulfm

WATCH_S = 0.05          # how often the watcher looks
_watcher: threading.Thread | None = None


def start(live: list) -> None:
    """Start (once a process) the thread that aborts NCCL when a peer dies: the rank stuck
    in a wait on the GPU cannot do it itself. It looks every WATCH_S at what MPI's runtime
    knows of dead processes and at NCCL's asynchronous error of each live communicator (a
    peer's closed connection), and on either runs ``ulfm.revoke_all``: MPI's revokes and
    every NCCL abort; the stuck wait returns and the rank's next MPI call reports the death."""
    global _watcher
    if _watcher is not None and _watcher.is_alive():
        return
    _watcher = threading.Thread(target=_watching, args=(live,), name="hpcdist-nccl-watcher",
                                daemon=True)
    _watcher.start()


def _nccl_error(live: list) -> bool:
    for nc in list(live):
        try:
            nc.comm.check_async_error()
        except Exception:          # CuPy's NcclError (ncclRemoteError, ...): a peer is gone
            if not nc.aborted:
                return True
    return False


def _watching(live: list) -> None:
    handled = -1                              # the era whose failure was acted on
    while True:
        time.sleep(WATCH_S)
        era = ulfm.era()
        if not ulfm.enabled() or era == handled:
            continue
        if ulfm.failure_known() or _nccl_error(live):
            ulfm.revoke_all(in_era=era)
            handled = era
