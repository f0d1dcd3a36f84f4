"""Handles of non-blocking collectives: ``wait()`` returns the result, ``test()`` polls."""
from __future__ import annotations

from . import abort, ulfm, watchdog


class Handle:
    """A non-blocking collective in flight: ``wait()`` returns its result, ``test()`` polls.

    An error that nobody retrieves is not lost: the ledger raises it at the next call on the
    communicator, and a handle dropped unwaited with an error ends the job (``abort.fatal``)."""

    def __init__(self, future, ledger=None, call=None, settle=None):
        """``settle``: the future's value is (result, bytes the call sent) and
        ``settle(bytes)`` is told them once, when the handle is waited (the communicator's
        count: dispatch.py says why)."""
        self.future, self.ledger, self.call = future, ledger, call
        self.waited = False
        self.settle = settle
        if ledger is not None:
            ledger.track(self)

    def test(self) -> bool:
        return self.future.done()

    def wait(self):
        self.waited = True
        if self.ledger is not None:
            self.ledger.release(self)
        if self.future.done():
            return self._settled(self.future.result())
        call = self.call
        with watchdog.waiting(self.ledger.label if self.ledger else "?",
                              call.seq if call else 0,
                              f"wait for {call.kind if call else 'a non-blocking call'}",
                              0, "all ranks"):
            return self._settled(watchdog.wait_future(self.future))

    def _settled(self, value):
        if self.settle is None:
            return value
        result, sent = value
        settle, self.settle = self.settle, None
        settle(sent)
        self.future = Done(lambda: result)          # (a second wait returns the result)
        return result

    def unretrieved_error(self):
        """The error of a finished call that nobody waited for (None otherwise)."""
        if self.waited or not self.future.done():
            return None
        return self.future.exception()

    def __del__(self):
        try:
            e = self.unretrieved_error()
        except Exception:
            return
        if e is not None and not ulfm.is_failure(e):      # (a dead peer: recovered from)
            what = f"call #{self.call.seq} {self.call.kind}" if self.call else "a call"
            abort.fatal(f"non-blocking {what} failed and its handle was dropped without "
                        f"wait(): {type(e).__name__}: {e}")


class Done:
    """A future that already holds its result (no progress thread, or nothing to wait for).
    ``Handle(Done(fn))`` is a handle of work done now; ``Done()`` one with nothing to do."""

    def __init__(self, fn=None):
        self._value, self._error = None, None
        try:
            self._value = fn() if fn is not None else None
        except BaseException as e:  # re-raised by result(), as a real future would
            self._error = e

    def done(self):
        return True

    def result(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self):
        return self._error

    # a handle's interface too, for callers that hand it back as one (compression)
    test = done
    wait = result
