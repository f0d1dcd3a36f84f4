"""CUDA graphs: a step's launches recorded once and replayed by one call, so the host's share
of a step (about 40 us a launch through Python and CuPy, 400 launches a GPT 12x768 step) leaves
the critical path. ``step = graphs.capture(fn)``; ``step()`` runs ``fn``'s work, ``step.out``
is what its capture returned (device arrays the replays overwrite). The rules a CUDA graph sets:
``fn`` reads what changes between steps from arrays it already holds (copy new values in
before each call), reads nothing back to the host, and takes no decision from device values;
Python runs once, at the capture. Its arrays come from a pool of their own that the graph
keeps (other arrays never reuse its blocks). The GPU stand-in captures as a GPU does: once,
refusing device reads, synchronizations and host arrays copied in, and its replays run the
launches it recorded, with the arguments of the capture (standin_graph.py), so a host value
the graph froze stays frozen there too; the CPU runs ``fn``."""
from __future__ import annotations

from . import backend
from .errors import DeviceError


BEFORE_CAPTURE: list = []     # called before each capture (``before_capture``)
_capturing: list = []         # a token of each capture running now (``capture_token``)
_captures = [0]


def capture_token():
    """A token of the capture running now (None: none). A host fact that holds at capture but
    may not at a replay — a buffer zeroed before the graph began, which the graph will not
    zero again — is worth acting on only inside the capture that saw it."""
    return _capturing[-1] if _capturing else None


def before_capture(prepare) -> None:
    """Call ``prepare()`` before each capture (kernels/__init__.py hands over cuBLAS's
    workspace: gemm.py)."""
    if prepare not in BEFORE_CAPTURE:
        BEFORE_CAPTURE.append(prepare)


class CapturedStep:
    """``fn`` warmed up ``warmup`` times eagerly (kernels compiled and self-checked, lazy
    buffers made, attention's choice measured), then captured at the first call that
    follows and replayed at every call."""

    def __init__(self, fn, warmup: int = 2):
        if warmup < 1:
            raise ValueError("a capture needs at least one eager warm-up call of the step "
                             "(first calls compile, check and measure, which a graph cannot)")
        self.fn, self.warmup = fn, warmup
        self.out = None
        self.captures = 0             # how often fn was recorded
        self.replayed = False         # the last call replayed the graph (fn's Python not run)
        self._graph = self._stream = self._pool = None

    def __call__(self):
        label = backend.device_label()
        self.replayed = False
        if label == "cpu":
            self.out = self.fn()
            return self.out
        if self.warmup:
            self.warmup -= 1
            self.out = self.fn()
            return self.out
        if self._graph is None:
            self._capture()
        else:
            self.replayed = True
        self._graph.launch(stream=backend.xp().cuda.get_current_stream())
        return self.out

    def _capture(self) -> None:
        cuda = backend.xp().cuda
        backend.synchronize()                  # the warm-up's work is done and its memory free
        if self._stream is None:
            self._stream = cuda.Stream(non_blocking=True)     # (the legacy stream cannot capture)
            self._pool = cuda.MemoryPool()
        self.out = None
        for prepare in BEFORE_CAPTURE:
            prepare()
        with cuda.using_allocator(self._pool.malloc), self._stream:
            self._stream.begin_capture()
            _captures[0] += 1
            _capturing.append(_captures[0])
            try:
                out = self.fn()
            except Exception as e:
                self._end_failed()
                raise DeviceError(f"the step cannot be captured as a CUDA graph: {e} (a graph "
                                  "holds kernels only: no host reads, synchronizations or "
                                  "decisions on device values inside the step)") from e
            finally:
                _capturing.pop()
            self._graph = self._stream.end_capture()
        self.out = out
        self.captures += 1

    def _end_failed(self) -> None:
        """End a capture that raised (the stream must leave capture mode to be used again)."""
        try:
            self._stream.end_capture()
        except Exception:            # an invalidated capture ends with its own error
            pass
        self._graph = None

    def pool_bytes(self) -> int:
        """Device bytes the graph's own pool holds (its activations and temporaries)."""
        return int(getattr(self._pool, "total_bytes", lambda: 0)()) if self._pool else 0


def capture(fn, warmup: int = 2) -> CapturedStep:
    """``fn`` as a CUDA graph (see the module's rules): eager for ``warmup`` calls, then
    recorded once and replayed."""
    return CapturedStep(fn, warmup)
