"""Nothing waits forever: deadlines on every wait for another rank, and a report that names
who did not arrive.

The rest of this design: docs/communication.md, "hpcdist/comm/watchdog.py"."""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ..host import signals
from . import ulfm
from .stall import Wait, alive, format_report, stacks  # noqa: F401 (Wait: ledger's)

DEFAULT_TIMEOUT_S = 300.0
EXIT_TIMEOUT = 124                  # as timeout(1): the job ended on a missed deadline
EXIT_DEAD = 137                     # as a shell reports SIGKILL: a rank on this host died
LIVENESS_S = 0.05                   # how often the watchdog checks its host's other ranks
YIELD_S = 10e-3                     # poll (yielding the core) this long, then sleep between polls
MAX_SLEEP_S = 2e-3                  # longest sleep between polls of a long wait
TAG_REQUEST, TAG_REPLY = 1, 2

_waits: dict = {}                   # thread id -> [Wait, ...] (innermost last)
_ledger: dict = {}                  # communicator label -> last call number started
_timeout = None
_thread = None


def timeout() -> float:
    """The deadline in seconds (``set_timeout``, else ``HPCDIST_TIMEOUT``, else 300)."""
    if _timeout is not None:
        return _timeout
    value = os.environ.get("HPCDIST_TIMEOUT", "")
    try:
        t = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"HPCDIST_TIMEOUT must be a number of seconds, got {value!r}") from None
    if not t > 0 or t != t or t == float("inf"):
        raise ValueError(f"HPCDIST_TIMEOUT must be a positive number of seconds, got {value!r}")
    return t


def set_timeout(seconds: float | None) -> None:
    """Set the deadline for every later wait (None: back to ``HPCDIST_TIMEOUT``)."""
    global _timeout
    if seconds is not None and not (0 < seconds < float("inf")):
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds}")
    _timeout = seconds


def grace() -> float:
    """How long the watchdog waits for other ranks' answers before naming them unresponsive."""
    return min(10.0, max(1.0, timeout() / 10))


class waiting:
    """``with waiting(comm_label, seq, kind, nbytes, peers):`` registers a wait of this thread."""

    __slots__ = ("wait",)

    def __init__(self, comm, seq, kind, nbytes=0, peers="all ranks"):
        self.wait = Wait(comm, seq, kind, nbytes, peers)

    def __enter__(self):
        _push(self.wait)
        return self.wait

    def __exit__(self, *exc):
        stack = _waits.get(threading.get_ident())
        if stack:
            stack.pop()
        return False


def enter(comm, seq, kind, nbytes=0, peers="all ranks") -> Wait:
    """Register a wait of this thread (the function form of ``waiting``, for hot paths)."""
    w = Wait(comm, seq, kind, nbytes, peers)
    _push(w)
    return w


def _push(w: Wait) -> None:
    stack = _waits.get(threading.get_ident())
    if stack is None:
        stack = _waits[threading.get_ident()] = []
    stack.append(w)


def leave(wait: Wait) -> None:
    """End the wait ``enter`` returned."""
    stack = _waits.get(threading.get_ident())
    if stack and stack[-1] is wait:
        stack.pop()


def note_call(comm_label: str, seq: int) -> None:
    """Record that this rank started call ``seq`` on ``comm_label`` (the status shows it)."""
    _ledger[comm_label] = seq


def wait_requests(requests, wait: Wait | None = None) -> None:
    """Complete MPI requests without burning a core on a long wait: poll, yielding the core
    between polls (``sched_yield``: no timer granularity, and on an oversubscribed node the
    rank we wait for gets to run); after ``YIELD_S`` the wait is long, and polls are spaced
    by sleeps growing to ``MAX_SLEEP_S``. (Sleeping from the start cost 2.6x on an 8-byte
    allreduce at N=4 on 2 cores: Linux sleeps at least ~60 us; spinning without yielding
    cost 300x there, and even at N=2 on 2 cores yielding was 15% faster.)

    ``wait``: registered (``enter``) only if the requests are not complete at once — hot
    paths pass one instead of registering every call."""
    testall = MPI.Request.Testall
    if testall(requests):
        return
    if wait is not None:
        wait.since = time.monotonic()
        _push(wait)
    try:
        end_yield = time.perf_counter() + YIELD_S
        while not testall(requests):
            if time.perf_counter() < end_yield:
                os.sched_yield()
                continue
            pause, era = 50e-6, ulfm.era()
            while not testall(requests):
                time.sleep(pause)
                pause = min(pause * 2, MAX_SLEEP_S)
                if ulfm.era() != era:          # the survivors went on without this wait
                    raise ulfm.RankLost("a wait outlived the recovery that replaced it")
            return
    finally:
        if wait is not None:
            leave(wait)


def wait_future(future):
    """``future.result()`` without blocking forever in one call (signals stay deliverable)."""
    import concurrent.futures
    while True:
        try:
            return future.result(timeout=0.5)
        except concurrent.futures.TimeoutError:
            continue


# ---- status and reports ------------------------------------------------------------------

def status(rank: int) -> dict:
    now = time.monotonic()
    waits = [w.as_dict(now) for stack in list(_waits.values()) for w in list(stack)]
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "waits": waits,
            "ledger": dict(_ledger), "stacks": stacks()}


class Watchdog(threading.Thread):
    """The per-process deadline thread; see the module docstring."""

    def __init__(self, world):
        super().__init__(name="hpcdist-watchdog", daemon=True)
        self.mpi = world.Dup()                 # its own messages never meet anyone else's
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        # every rank's host, once (setup, like Dup): reports name the node that went quiet
        me = np.zeros(64, dtype=np.uint8)
        name = socket.gethostname().encode()[:64]
        me[:len(name)] = np.frombuffer(name, dtype=np.uint8)
        table = np.empty(64 * self.size, dtype=np.uint8)
        self.mpi.Allgather(me, table)
        self.hosts = [bytes(table[64 * r:64 * (r + 1)]).rstrip(b"\0").decode(errors="replace")
                      for r in range(self.size)]
        pids = np.empty(self.size, dtype=np.int64)
        self.mpi.Allgather(np.array([os.getpid()], dtype=np.int64), pids)
        here = socket.gethostname()
        # the other ranks on this host, by process id: a rank that dies (SIGKILL, the OOM
        # killer) is named by its neighbours at once instead of by the launcher's PID
        self.neighbours = {r: int(pids[r]) for r in range(self.size)
                           if self.hosts[r] == here and r != self.rank}
        self._next_liveness = 0.0
        # Linux tells at once when a process exits (a pidfd turns readable): the neighbours'
        # deaths wake this thread instead of waiting for the next check
        self._pidfds = {}
        for r, pid in self.neighbours.items():
            try:
                self._pidfds[r] = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pass
        self.urgent = False                    # a SIGTERM arrived and someone else handles it
        self.stand_down_until = 0.0            # a lower rank is reporting
        self._wake_r = None
        self.stopping = threading.Event()

    # -- signals -----------------------------------------------------------------------
    def watch_signals(self) -> None:
        """Route SIGTERM/SIGINT through a wakeup fd this thread reads (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return
        if old != -1:                          # someone else uses it (asyncio): leave it
            signal.set_wakeup_fd(old)
            os.close(r), os.close(w)
            return
        self._wake_r = r
        signals.set_exit_handler(_note_signal)   # what SIGTERM does in EXIT mode from now on
        if not signals.stops(signal.SIGTERM) and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _note_signal)

    def _read_signals(self) -> None:
        if self._wake_r is None:
            return
        while select.select([self._wake_r], [], [], 0)[0]:
            data = os.read(self._wake_r, 64)
            for signum in data:
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        if signals.stops(signum):
            signals.note(signum)               # decided at the entry point, not now
            self.urgent = True
            return
        handler = signal.getsignal(signum)
        if handler is _note_signal:            # nobody else handles it: say where, then end
            name = signal.Signals(signum).name
            now = time.monotonic()
            waits = [w for stack in list(_waits.values()) for w in list(stack)]
            where = "; ".join(f"waiting {now - w.since:.1f} s in {w.describe()}" for w in waits) \
                or "not waiting on another rank"
            last = ", ".join(f"{c} #{n}" for c, n in _ledger.items()) or "none"
            sys.stderr.write(f"[hpcdist] rank {self.rank} (host {socket.gethostname()}, pid "
                             f"{os.getpid()}) ended by {name}: {where}; last calls: {last}\n")
            sys.stderr.flush()
            time.sleep(0.25)                   # let the launcher forward it (abort.end_job)
            os._exit(128 + signum)             # as the shell reports a death by that signal
        else:                                  # e.g. train's checkpoint-on-SIGTERM
            self.urgent = True

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except MPI.Exception:
            if not ulfm.enabled():
                raise
            # a peer died under --on-failure shrink: the survivors recover, and restart()
            # starts a watchdog over them
        finally:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()

    def _run(self) -> None:
        request = np.zeros(2, dtype=np.int64)
        recv = self.mpi.Irecv(request, MPI.ANY_SOURCE, TAG_REQUEST)
        while not self.stopping.is_set():
            died = False                       # a neighbour's pidfd turned readable
            if self._pidfds:
                died = bool(select.select(list(self._pidfds.values()), [], [], 0.05)[0])
            elif self.stopping.wait(0.05):
                break
            self._read_signals()               # our own SIGTERM first: it may explain theirs
            while recv.Test():                 # another rank asks for our status
                self._answer(int(request[0]), int(request[1]))
                recv = self.mpi.Irecv(request, MPI.ANY_SOURCE, TAG_REQUEST)
            overdue = self._overdue()
            if overdue is not None and time.monotonic() >= self.stand_down_until:
                self._report(overdue, recv, request)
            poll = len(self.neighbours) > len(self._pidfds) and \
                time.monotonic() >= self._next_liveness        # some have no pidfd
            if died or poll:
                self._next_liveness = time.monotonic() + LIVENESS_S
                self._check_neighbours()
        recv.Cancel()                           # before MPI_Finalize (see stop())
        recv.Wait()

    def _check_neighbours(self) -> None:
        """End the job naming a rank on this host whose process is gone (the lowest live
        rank of the host reports; the others stand by for it)."""
        dead = sorted(r for r, pid in self.neighbours.items() if not alive(pid))
        if not dead:
            return
        for r in dead:                      # a dead pidfd stays readable: stop watching it
            fd = self._pidfds.pop(r, None)
            if fd is not None:
                os.close(fd)
        live = [r for r in self.neighbours if r not in dead] + [self.rank]
        if self.rank != min(live):
            self.neighbours = {r: p for r, p in self.neighbours.items() if r not in dead}
            return
        now = time.monotonic()
        waits = [w.as_dict(now) for stack in list(_waits.values()) for w in list(stack)]
        where = "; ".join(f"waiting {w['waited_s']:.1f} s in {w['what']}" for w in waits) \
            or "not waiting on another rank"
        names = ", ".join(f"rank {r} (host {self.hosts[r]}, pid {self.neighbours[r]})"
                          for r in dead)
        if ulfm.enabled():                     # --on-failure shrink: the survivors go on
            sys.stderr.write(f"[hpcdist watchdog] {names} died: its process is gone; the "
                             "survivors recover (--on-failure shrink).\n")
            self.neighbours = {r: p for r, p in self.neighbours.items() if r not in dead}
            return
        sys.stderr.write(f"[hpcdist watchdog] {names} died: its process is gone (killed by a "
                         f"signal such as SIGKILL, the OOM killer, or a crash outside Python); "
                         f"rank {self.rank} was {where}; ending the job.\n")
        sys.stderr.flush()
        from . import abort
        abort.end_job(EXIT_DEAD)

    def _overdue(self):
        limit = grace() if self.urgent else timeout()
        now = time.monotonic()
        for stack in list(_waits.values()):
            for w in list(stack):
                if now - w.since > limit:
                    return w
        return None

    def _answer(self, source: int, reporting: int) -> None:
        if reporting and source < self.rank:   # a lower rank reports: do not report too
            self.stand_down_until = time.monotonic() + 3 * grace()
        body = np.frombuffer(json.dumps(status(self.rank)).encode(), dtype=np.uint8)
        self.mpi.Isend(body.copy(), source, TAG_REPLY)   # small; completes eagerly or at Abort

    def _report(self, overdue: Wait, recv, request) -> None:
        me = status(self.rank)
        statuses = {self.rank: me}
        ask = np.array([self.rank, 1], dtype=np.int64)
        for r in range(self.size):
            if r != self.rank:
                self.mpi.Isend(ask, r, TAG_REQUEST)
        end = time.monotonic() + grace()
        while len(statuses) < self.size and time.monotonic() < end:
            st = MPI.Status()
            if self.mpi.Iprobe(MPI.ANY_SOURCE, TAG_REPLY, st):
                body = np.empty(st.Get_count(MPI.BYTE), dtype=np.uint8)
                self.mpi.Recv(body, st.Get_source(), TAG_REPLY)
                s = json.loads(bytes(body).decode())
                statuses[s["rank"]] = s
            while recv.Test():
                self._answer(int(request[0]), int(request[1]))
                recv = self.mpi.Irecv(request, MPI.ANY_SOURCE, TAG_REQUEST)
            if time.monotonic() < self.stand_down_until:
                return                          # a lower rank took over; keep answering
            time.sleep(0.005)
        silent = [r for r in range(self.size) if r not in statuses]
        why = ("was asked to stop (SIGTERM) while waiting" if self.urgent
               else "waited past its deadline in")
        deadline = grace() if self.urgent else timeout()
        sys.stderr.write(format_report(me, overdue, statuses, silent, deadline, why,
                                       hosts=self.hosts, grace_s=grace()))
        sys.stderr.flush()
        from . import abort
        abort.end_job(EXIT_TIMEOUT)


def _note_signal(signum, frame):
    """Python-level SIGTERM handler: the watchdog thread acts on the wakeup fd."""


def start(world) -> None:
    """Start the watchdog over ``world`` once per process (collective over ``world``)."""
    global _thread
    if _thread is not None or os.environ.get("HPCDIST_WATCHDOG", "1") == "0":
        return
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return                                  # it could not talk to the other ranks
    _thread = Watchdog(world)
    _thread.watch_signals()
    _thread.start()
    atexit.register(stop)                       # runs before mpi4py's MPI_Finalize (LIFO)


def restart(world) -> None:
    """A watchdog over ``world`` (the survivors, after a recovery) in place of the one over
    the world that was (collective over ``world``)."""
    global _thread
    stop()
    _thread = None
    start(world)


def stop() -> None:
    """Stop the watchdog thread (at exit, before MPI finalizes)."""
    if _thread is not None and _thread.is_alive():
        _thread.stopping.set()
        _thread.join(timeout=2.0)
