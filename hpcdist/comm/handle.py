"""Handles of non-blocking collectives: ``wait()`` returns the result, ``test()`` polls."""
from __future__ import annotations

from . import abort, watchdog


class Handle:
    """A non-blocking collective in flight: ``wait()`` returns its result, ``test()`` polls.

    An error that nobody retrieves is not lost: the next call on the communicator raises it,
    and a handle dropped unwaited with an error ends the job (``abort.fatal``)."""

    def __init__(self, future, owner=None, call=None):
        self._future, self._owner, self._call = future, owner, call
        self._waited = False
        if owner is not None:
            owner._handles.append(self)

    def test(self) -> bool:
        return self._future.done()

    def wait(self):
        self._waited = True
        if self._owner is not None and self._owner._handles:
            self._owner._forget(self)
        if self._future.done():
            return self._future.result()
        call = self._call
        with watchdog.waiting(self._owner.label if self._owner else "?",
                              call.seq if call else 0,
                              f"wait for {call.kind if call else 'a non-blocking call'}",
                              0, "all ranks"):
            return watchdog.wait_future(self._future)

    def _unretrieved_error(self):
        if self._waited or not self._future.done():
            return None
        return self._future.exception()

    def __del__(self):
        try:
            e = self._unretrieved_error()
        except Exception:
            return
        if e is not None:
            what = f"call #{self._call.seq} {self._call.kind}" if self._call else "a call"
            abort.fatal(f"non-blocking {what} failed and its handle was dropped without "
                        f"wait(): {type(e).__name__}: {e}")


class _Done:
    """A future that already holds its result (used when no progress thread is available)."""

    def __init__(self, fn):
        self._value, self._error = None, None
        try:
            self._value = fn()
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
