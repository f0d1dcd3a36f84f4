"""The one path of every collective: check -> choose -> (short exchange | algorithm) -> wire.

``collective`` reads top to bottom: the memo (a repeated blocking short call goes straight
to its short exchange); check (the algorithm's name, the kind's checks, the ledger's
number); choose (select.py); then ``_watched``, the one place the watchdog and the timeline
are entered, around the short exchange (``_short``: the data rides in the agreement) or the
agreement and the algorithm. Non-blocking calls take the same path in the progress thread.

The rest of this design: docs/communication.md, "hpcdist/comm/dispatch.py"."""
from __future__ import annotations

import numpy as np

from ..host import timeline
from . import abort, ledger, select, ulfm, watchdog
from .collectives import ALLREDUCE, Args
from .handle import Done, Handle


def collective(c, kind, blocking: bool, buf, op=None, root=None, *, algorithm="auto", out=None,
               wire_dtype=None, total=None, counts=None, extra=None):
    """``kind`` (collectives.py) on ``buf`` over the Communicator ``c``: the result, or a
    Handle of it when not ``blocking``."""
    if blocking and counts is None and wire_dtype is None:           # the memo
        if type(buf) is np.ndarray:
            plan = c._memos.get((kind, buf.size, buf.dtype, op, root, algorithm, total,
                                 out is None))
            if plan is not None and plan.fits(buf, out):     # checked and chosen before
                return _short(c, c._wire, kind, None, plan, buf, a=plan.args_for(out))
        elif buf is None and timeline._active is None:
            plan = c._memos.get(kind)
            if plan is not None:
                return _short(c, c._wire, kind, None, plan, None, a=plan.args)
    a = Args(op, root, algorithm, out, wire_dtype, total, counts=counts, extra=extra,
             rank=c.rank, size=c.size)
    select.check_name(kind.name, a.algorithm)                                      # check
    call = c._ledger.open(kind.name, buf, blocking=blocking, **kind.check(buf, a))
    nbytes = kind.nbytes(buf, a)
    short = call.problem is None and (type(buf) is np.ndarray or buf is None
                                      or c._wire.staged(buf))
    call.algorithm = select.choose(kind.name, nbytes, c.size, a.algorithm,         # choose
                                   c._auto.get(kind.name, "auto"), short,
                                   topology=c.topology if a.counts is None else None)
    if call.algorithm == select.SHORT:
        if blocking and not c.debug and timeline.active() is None:
            _remember(c, kind, buf, a)
    else:
        a.algorithm = call.algorithm
    if blocking:
        return _watched(c, c._wire, kind, call, buf, a, nbytes=nbytes)

    def run(wire):
        return _counted(wire, lambda: _watched(c, wire, kind, call, buf, a, nbytes=nbytes))

    if c.size == 1:           # nothing to wait for: done now, no progress-thread handoff (13%
        return Handle(Done(lambda: run(c._bg_wire)), c._ledger, call,    # of a DDP step)
                      c._settle)
    return Handle(c._progress(run), c._ledger, call, c._settle)


def _counted(wire, fn):
    """(fn(), (bytes, inter-node bytes) it sent on ``wire``). A non-blocking call's bytes
    count in ``bytes_sent`` when its handle is waited, not as the progress thread sends them:
    a training step's window then holds exactly the calls it waited for (DiLoCo's exchange
    issued in one step and waited in a later one; a thread's bytes between two windows were
    counted in neither, and a step's record came out short on a loaded machine). The progress
    thread runs one call at a time, so the wire's change is this call's."""
    before = wire.total()
    out = fn()
    after = wire.total()
    return out, (after[0] - before[0], after[1] - before[1])


def agree_only(c, kind: str, buf, op=None, root=None, length=None) -> int:
    """The check and the agreement of a collective whose data moves elsewhere (the NCCL
    backend): numbered, checked and agreed like ours, then nothing is exchanged; returns the
    call's number. ``length``: what every rank must agree on where it is not ``buf``'s size
    (an allgather's total)."""
    call = c._ledger.open(kind, buf, op=op, root=root, length=length)
    c._ledger.agree(c._wire.exchanges, call)
    return call.seq


def _watched(c, wire, kind, call, buf, a, *, nbytes: int = 0):
    """The watchdog and the timeline around the data's move: the one place every checked
    call enters them. (A memo hit — never taken while the timeline records — is watched by
    the ledger's lean wait, registered only if its exchange does not complete at once.)"""
    label = call.algorithm if a.wire_dtype is None else f"ring({a.wire_dtype.name} wire)"
    wait = watchdog.enter(c.label, call.seq, call.kind if call.blocking else
                          f"{call.kind} (non-blocking)", nbytes, c._peers)
    try:
        link = "intra" if c.topology.nodes == 1 else (
            "2-level" if label == "hierarchical" else "inter")
        with timeline.collective(call.kind, label, nbytes, c.size, link) as record:
            if call.algorithm == select.SHORT:
                return _short(c, wire, kind, call, None, buf, a=a)
            c._ledger.agree(wire.exchanges, call)      # a mismatch raises alike on every rank
            try:
                return kind.run(wire, buf, a, record)                 # the algorithm, the wire
            except BaseException as e:
                # peers may be mid-exchange: end the job (a dead peer under --on-failure
                # shrink: the one who waits for the handle recovers)
                if not call.blocking and not ulfm.is_failure(e):
                    abort.fatal(f"non-blocking call #{call.seq} {call.kind} failed in the "
                                f"progress thread: {type(e).__name__}: {e}", e)
                raise
    finally:
        watchdog.leave(wait)


def _short(c, wire, kind, call, plan, buf, *, a):
    """The short exchange: this rank's payload rides in the agreement, which folds
    every rank's; then the kind takes its result out. ``plan``: a memo hit's (numbered and
    agreed with its cached key); else ``call``'s."""
    if plan is None:
        host = wire.stage_in(buf) if buf is not None else None
        size, dtype, fold, _ = kind.short_form(host, a)
        ex = wire.exchanges.get(size, dtype)
        kind.fill(ex, host, a)
        c._ledger.agree(wire.exchanges, call, ex, fold)
    else:
        ex = wire.exchanges.get(*plan.payload)
        kind.fill(ex, None if buf is None else buf.reshape(-1), a)
        c._ledger.agree_static(wire.exchanges, ex, plan.fold, plan.static, plan.fields)
    return kind.extract(wire, ex, buf, a)


# ---- the memo -------------------------------------------------------------------------------

def _remember(c, kind, buf, a) -> None:
    if buf is None:
        c._memos[kind] = Memo(kind, None, a)
    elif (type(buf) is np.ndarray and a.counts is None and a.wire_dtype is None
          and (a.out is None or kind is ALLREDUCE)):
        c._memos[(kind, buf.size, buf.dtype, a.op, a.root, a.algorithm, a.total,
                  a.out is None)] = Memo(kind, buf, a)


class Memo:
    """A blocking short call as made before: its exchange's shape, fold and key."""

    __slots__ = ("kind", "args", "args_out", "payload", "fold", "fields", "static",
                 "check_out", "writes")

    def __init__(self, kind, buf, a):
        host = None if buf is None else buf.reshape(-1)
        self.kind, self.writes = kind, kind.writes_buf
        # the call's arguments but ``out`` (which the key leaves out): the same for every
        # call this plan takes
        self.args = Args(a.op, a.root, a.algorithm, None, None, a.total, extra=a.extra,
                         rank=a.rank, size=a.size)
        self.args_out = Args(a.op, a.root, a.algorithm, None, None, a.total, extra=a.extra,
                             rank=a.rank, size=a.size)
        size, dtype, self.fold, self.fields = kind.short_form(host, a)
        self.payload = (size, dtype)
        name, length, dtype, op, root = self.fields
        self.static = ledger.static_key(name, True, select.SHORT, length, dtype, op,
                                        root=root, k=-1, ok=True)
        self.check_out = a.out is not None

    def args_for(self, out):
        if out is None:
            return self.args
        a = self.args_out                      # (blocking calls: one at a time)
        a.out = out
        return a

    def fits(self, buf, out) -> bool:
        """Whether this call may take the plan: what the key leaves out still holds."""
        if not buf.flags.c_contiguous or timeline._active is not None:
            return False
        if self.check_out and out is not buf and not (
                type(out) is np.ndarray and out.shape == buf.shape and out.dtype == buf.dtype
                and out.flags.c_contiguous and out.flags.writeable):
            return False
        return not self.writes or buf.flags.writeable
