"""What the watchdog knows and says: a wait (``Wait``), whether a process lives, and the report
when a wait runs past its deadline — every rank's state and stacks, who did not arrive, the
nodes that went quiet (watchdog.py gathers them)."""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback


class Wait:
    """What one thread is waiting in."""

    __slots__ = ("comm", "seq", "kind", "nbytes", "peers", "since")

    def __init__(self, comm, seq, kind, nbytes, peers):
        self.comm, self.seq, self.kind, self.nbytes, self.peers = comm, seq, kind, nbytes, peers
        self.since = time.monotonic()

    def describe(self) -> str:
        size = f" {self.nbytes:,} B" if self.nbytes else ""
        call = f" call #{self.seq}" if self.seq else ""      # point-to-point has no number
        return f"{self.comm}{call} {self.kind}{size} with {self.peers}"

    def as_dict(self, now) -> dict:
        return {"what": self.describe(), "comm": self.comm, "seq": self.seq, "kind": self.kind,
                "waited_s": round(now - self.since, 3)}


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stacks() -> str:
    """The Python stacks of every thread of this process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for tid, frame in sys._current_frames().items():
        out.append(f"  thread {names.get(tid, tid)}:\n"
                   + "".join("    " + line for line in traceback.format_stack(frame)))
    return "".join(out)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def silent_by_node(silent: list, hosts: list | None) -> str:
    """The unresponsive ranks grouped by host, saying where a whole node went quiet."""
    if not hosts or len(set(hosts)) == 1:
        return _ranks(silent)
    parts = []
    for host in dict.fromkeys(hosts[r] for r in sorted(silent)):
        mine = [r for r in silent if hosts[r] == host]
        whole = len(mine) == hosts.count(host)
        parts.append(f"{_ranks(mine)} on {host}" + (
            f" (every rank of {host}: the node or its link is down)" if whole else ""))
    return "; ".join(parts)


def format_report(me: dict, overdue, statuses: dict, silent: list, deadline: float,
                  why: str, *, hosts: list | None = None, grace_s: float = 0.0) -> str:
    """One readable report: this rank's wait, every rank's state, who did not arrive
    (``hosts[r]``: rank r's host, to name the nodes that went quiet)."""
    lines = [f"[hpcdist watchdog] rank {me['rank']} (host {me['host']}, pid {me['pid']}) "
             f"{why} {overdue.describe()} (deadline {deadline:g} s, HPCDIST_TIMEOUT / --timeout); "
             "ending the job."]
    behind = sorted(r for r, s in statuses.items()
                    if not any(w["comm"] == overdue.comm and w["seq"] == overdue.seq
                               for w in s["waits"]))
    if silent:
        lines.append(f"  unresponsive: {silent_by_node(silent, hosts)} — no heartbeat answer "
                     f"within {grace_s:g} s (stopped, wedged, dead, or already exited)")
    if behind and overdue.seq:         # point-to-point has no number that others share
        lines.append(f"  not in {overdue.comm} call #{overdue.seq}: {_ranks(behind)}")
    for r in sorted(statuses):
        s = statuses[r]
        where = "; ".join(f"waiting {w['waited_s']:.1f} s in {w['what']}" for w in s["waits"]) \
            or "not waiting on any rank (computing, or done with this communicator)"
        last = ", ".join(f"{c} #{n}" for c, n in s["ledger"].items()) or "none"
        lines.append(f"  rank {r} (host {s['host']}, pid {s['pid']}): {where}; "
                     f"last calls: {last}")
    for r in silent:
        lines.append(f"  rank {r}: no answer")
    for r in sorted(statuses):
        lines.append(f"--- Python stacks of rank {r}:\n{statuses[r]['stacks']}")
    return "\n".join(lines) + "\n"
