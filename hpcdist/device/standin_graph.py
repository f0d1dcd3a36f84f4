"""The GPU stand-in's CUDA graphs: a capture records each launch as it runs it, and a replay
runs the recorded launches again — not the Python that issued them — so, as on a GPU, a replay
reads the arrays it recorded (their values now) and the scalars it recorded (their values
then): a learning rate, a step count or a decision taken in Python at the capture stays frozen
here as there. standin.py calls ``record`` for each operation that launches: ``run`` computes
it again on the same arrays and its value refills ``result`` (the array the capture returned)
in place; an operation that writes in place is replayed by running it. An operation inside
another's implementation is not recorded twice (``inside``). The capture runs the work as it
records it (NumPy cannot defer it), so the first launch after a capture is skipped. The
design: docs/gpu.md, "hpcdist/device/graphs.py"."""
from __future__ import annotations

import contextlib

import numpy as _np

from .surface import LAUNCHES


class _Recorder:
    ops: list | None = None          # the capturing graph's launches; None outside a capture
    depth = 0                        # inside a recorded operation's own implementation

    @property
    def on(self) -> bool:
        return self.ops is not None and not self.depth


RECORDER = _Recorder()


def _plain(x):
    """A plain NumPy view (the replay computes on the host arrays under the device ones)."""
    return _np.ndarray.view(x, _np.ndarray) if isinstance(x, _np.ndarray) else x


def _refill(target, value) -> None:
    """Write the replay's ``value`` into the array the capture returned (nothing to do where
    the operation wrote it in place)."""
    if isinstance(target, (tuple, list)):
        for t, v in zip(target, value):
            _refill(t, v)
        return
    if not isinstance(target, _np.ndarray):
        return
    value = _np.asarray(value)
    t = _plain(target)
    if value.shape != t.shape:
        raise RuntimeError(f"a CUDA graph's replay made shape {value.shape} where its capture "
                           f"made {t.shape} (a graph holds fixed shapes)")
    if value.__array_interface__["data"][0] != t.__array_interface__["data"][0]:
        _np.copyto(t, value, casting="unsafe")


def record(run, result=None) -> None:
    """At a replay, ``run()`` again and its value into ``result`` (None: ``run`` writes in
    place)."""
    if result is None:
        RECORDER.ops.append(run)
    else:
        RECORDER.ops.append(lambda: _refill(result, run()))


@contextlib.contextmanager
def inside():
    """An operation's own implementation: the operations it calls are part of it."""
    RECORDER.depth += 1
    try:
        yield
    finally:
        RECORDER.depth -= 1


def begin() -> None:
    if RECORDER.ops is not None:
        raise RuntimeError("a stream is capturing already (the GPU stand-in captures one "
                           "graph at a time)")
    RECORDER.ops = []


def end() -> "Graph":
    ops, RECORDER.ops = RECORDER.ops or [], None
    return Graph(ops)


class Graph:
    """``cupy.cuda.graph.Graph``: ``launch`` replays the recorded operations in order."""

    def __init__(self, ops: list):
        self.ops = ops
        self._ran_at_capture = True

    def launch(self, stream=None) -> None:
        """Replay the recorded operations: one launch from the host (counted so)."""
        if self._ran_at_capture:          # the capture computed what this launch would
            self._ran_at_capture = False
            return
        LAUNCHES.add()
        for op in self.ops:
            op()
