"""What a run spent its time on: spans for a Chrome trace, and per-collective timings.

A ``Recorder`` collects, on each rank, complete spans (forward, backward, optimizer step,
every collective with its bytes and algorithm) and per-call collective timings. Nothing is
recorded unless a recorder is active (``activate``); the hooks cost one global read otherwise.

At the end of a run — the list goes on in docs/observability.md, "hpcdist/host/timeline.py"."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import numpy as np


_active = None          # the Recorder hooks write to (None: recording is off)
_NULL = contextlib.nullcontext()


def active():
    return _active


def activate(recorder) -> None:
    global _active
    _active = recorder


def deactivate() -> None:
    activate(None)


def span(name: str, cat: str = "compute", **args):
    """A context manager recording a span on the active recorder (a no-op when none is)."""
    rec = _active
    return _NULL if rec is None else rec.span(name, cat, **args)


def collective(kind: str, algorithm: str, nbytes: int, world: int, link: str = "intra"):
    """A context manager timing one collective call on the active recorder; it yields a dict
    whose "bytes" may be set inside (None when no recorder is active: nothing is recorded).
    ``link``: the slowest link the call used — "intra" (inside a node), "inter" (across
    nodes) or "2-level" (a hierarchical algorithm: both, inter only for its middle phase)."""
    rec = _active
    return _NULL if rec is None else rec.collective(kind, algorithm, nbytes, world, link)


class Recorder:
    """Spans and collective timings of one rank (thread-safe: the progress thread records
    the non-blocking collectives it runs)."""

    def __init__(self, rank: int, max_events: int = 500_000):
        self.rank = rank
        self.max_events = max_events
        self.events = []            # (name, cat, thread, t0_ns, t1_ns, args)
        self.dropped = 0
        self.calls = {}             # (kind, algorithm, nbytes, world, link) -> [calls, s]
        self.threads = {}           # thread ident -> (index, name)
        self._lock = threading.Lock()
        self._thread()              # the creating (main) thread is track 0

    def _thread(self) -> int:
        ident = threading.get_ident()
        t = self.threads.get(ident)
        if t is None:
            with self._lock:
                t = self.threads.setdefault(
                    ident, (len(self.threads), threading.current_thread().name))
        return t[0]

    def add(self, name, cat, t0_ns, t1_ns, args=None) -> None:
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append((name, cat, self._thread(), t0_ns, t1_ns, args or {}))

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        """Times the body; yields the span's args, which the body may add to."""
        t0 = time.perf_counter_ns()
        try:
            yield args
        finally:
            self.add(name, cat, t0, time.perf_counter_ns(), args)

    @contextlib.contextmanager
    def collective(self, kind: str, algorithm: str, nbytes: int, world: int,
                   link: str = "intra"):
        """Times the body; yields a dict whose "bytes" the body may set once it knows them."""
        info = {"bytes": int(nbytes)}
        t0 = time.perf_counter_ns()
        try:
            yield info
        finally:
            t1 = time.perf_counter_ns()
            nbytes = int(info["bytes"])
            self.add(kind, "comm", t0, t1, {"bytes": nbytes, "algorithm": algorithm,
                                            "ranks": world, "link": link})
            key = (kind, algorithm, nbytes, world, link)
            with self._lock:
                entry = self.calls.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += (t1 - t0) * 1e-9


# ---- clocks ------------------------------------------------------------------------------------

def clock_offsets(mpi, rounds: int = 20, with_rtt: bool = False):
    """On rank 0: every rank's ``perf_counter_ns`` minus rank 0's, in ns (None elsewhere);
    with ``with_rtt``, also the round trip (ns) each estimate came from.

    Rank 0 exchanges ``rounds`` ping-pongs with each rank; rank r answers with its clock
    reading t_r. With rank 0's send and receive times t1, t2, the offset is
    t_r - (t1 + t2) / 2, off by at most half the round trip; the round with the shortest
    round trip wins. Collective over ``mpi``.
    """
    P, r = mpi.Get_size(), mpi.Get_rank()
    stamp = np.zeros(1, dtype=np.int64)
    if r != 0:
        for _ in range(rounds):
            mpi.Recv(stamp, 0, 11)
            stamp[0] = time.perf_counter_ns()
            mpi.Send(stamp, 0, 11)
        return None
    offsets = np.zeros(P, dtype=np.int64)
    rtts = np.zeros(P, dtype=np.int64)
    for peer in range(1, P):
        best = None
        for _ in range(rounds):
            t1 = time.perf_counter_ns()
            mpi.Send(stamp, peer, 11)
            mpi.Recv(stamp, peer, 11)
            t2 = time.perf_counter_ns()
            if best is None or t2 - t1 < best[0]:
                best = (t2 - t1, int(stamp[0]) - (t1 + t2) // 2)
        rtts[peer], offsets[peer] = best
    return (offsets, rtts) if with_rtt else offsets


class ClockSync:
    """Offsets to rank 0's clock measured twice (``start`` and ``stop``); ``to_rank0`` maps a
    rank's timestamps onto rank 0's clock, interpolating the offset linearly in between."""

    def __init__(self):
        self.t = []                 # rank 0's clock at each measurement
        self.offsets = []           # arrays of per-rank offsets (rank 0 only)

    def measure(self, mpi) -> None:
        mpi.Barrier()
        t = time.perf_counter_ns()
        off = clock_offsets(mpi)
        if off is not None:
            self.t.append(t)
            self.offsets.append(off)

    def to_rank0(self, rank: int, t_ns: np.ndarray) -> np.ndarray:
        if not self.offsets:
            return t_ns
        if len(self.offsets) == 1 or self.t[-1] == self.t[0]:
            return t_ns - self.offsets[0][rank]
        o0, o1 = float(self.offsets[0][rank]), float(self.offsets[-1][rank])
        slope = (o1 - o0) / (self.t[-1] - self.t[0])          # drift per rank-0 ns
        # local = t0 + o(t0); o linear in rank 0's time t0: solve for t0
        return ((t_ns - o0 + slope * self.t[0]) / (1 + slope)).astype(np.int64)


# ---- gathering to rank 0 -------------------------------------------------------------------------

def gather_json(mpi, obj):
    """Every rank's JSON-serialisable ``obj``, as a list on rank 0 (None elsewhere), sent as
    bytes with MPI point-to-point (no pickling)."""
    P, r = mpi.Get_size(), mpi.Get_rank()
    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    if r != 0:
        mpi.Send(np.array([raw.size], dtype=np.int64), 0, 12)
        mpi.Send(raw, 0, 13)
        return None
    out = [obj]
    for peer in range(1, P):
        n = np.zeros(1, dtype=np.int64)
        mpi.Recv(n, peer, 12)
        buf = np.empty(int(n[0]), dtype=np.uint8)
        mpi.Recv(buf, peer, 13)
        out.append(json.loads(buf.tobytes().decode()))
    return out


# ---- Chrome trace ---------------------------------------------------------------------------------

def write_chrome_trace(path: str, recorder: Recorder, clocks: ClockSync, mpi,
                       metadata: dict | None = None) -> str | None:
    """Merge every rank's spans into one Chrome trace at ``path`` (written by rank 0).
    Collective; returns the path on rank 0, None elsewhere."""
    mine = {"rank": recorder.rank, "events": recorder.events, "dropped": recorder.dropped,
            "threads": {str(i): name for i, name in recorder.threads.values()}}
    everyone = gather_json(mpi, mine)
    if everyone is None:
        return None
    zero = clocks.t[0] if clocks.t else min(
        (e[3] for rank in everyone for e in rank["events"]), default=0)
    events = []
    for rank in everyone:
        r = rank["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
        for tid, name in rank["threads"].items():
            label = "main" if name == "MainThread" else f"progress thread {name}"
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": int(tid),
                           "args": {"name": label}})
        if not rank["events"]:
            continue
        t = np.array([[e[3], e[4]] for e in rank["events"]], dtype=np.int64)
        t = clocks.to_rank0(r, t)
        for (name, cat, tid, _, _, args), (t0, t1) in zip(rank["events"], t):
            events.append({"name": name, "cat": cat, "ph": "X", "pid": r, "tid": tid,
                           "ts": (int(t0) - zero) / 1e3, "dur": max(int(t1 - t0), 0) / 1e3,
                           "args": args})
    offsets = {str(r): [int(o[r]) for o in clocks.offsets] for r in range(mpi.Get_size())}
    out = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"tool": "hpcdist", "clock": "perf_counter, aligned to rank 0",
                         "clock_offsets_ns": offsets,
                         "dropped_events": {str(r["rank"]): r["dropped"] for r in everyone},
                         **(metadata or {})}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    return path
