"""Checkpoints off the step's path (``--async-save``). A save begins in the step (``begin``:
the stage folder agreed; this rank's own small state copied); a background thread then copies
the parameters and optimizer state into host buffers kept from save to save while the next
step's forward and backward read them (the step waits for that copy before its gradient sync
and optimizer change them: ``wait_copied``), and serializes, hashes and writes this rank's
file while training goes on. The main thread publishes the save (the manifest, the rename,
``latest``) once every rank's file is written (``ready``, a one-integer allreduce a step while
one is in flight), at the next save, or at the end. At most one save is in flight. A crash
mid-write leaves a ``partial.step_…`` folder and the previous ``latest``, as a synchronous
save cut off does (run/savedir.py removes it at the next start).

The thread does no communication: every collective of the save runs on the main thread."""
from __future__ import annotations

import os
import threading
import time

import numpy as np

from . import Started, begin, publish, write_file


class Background:
    """This rank's save in flight (one at most)."""

    def __init__(self):
        self.started: Started | None = None
        self.thread: threading.Thread | None = None
        self.meta = self.scalars = None
        self.t0 = 0.0
        self.copied = threading.Event()
        self.buffers: dict = {}         # key -> the host copy kept from save to save

    def _copy(self, key: str, array) -> np.ndarray:
        """``array`` copied into this key's host buffer, made at the first save and reused
        (the one write in flight is done by then): no fresh pages to fault in a step."""
        array = np.asarray(array)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != array.shape or buf.dtype != array.dtype:
            buf = self.buffers[key] = np.empty_like(array)
        np.copyto(buf, array)
        return buf

    @property
    def step(self) -> int | None:
        return None if self.started is None else self.started.step

    def start(self, save_dir: str, step: int, comm, pieces: list, own: dict, *, meta: dict,
              scalars: dict) -> None:
        """Begin the save of ``step`` (collective: the stage folder, then the copy to host
        memory); its file is written by a thread from here."""
        assert self.started is None, "one save in flight at most: finish() it first"
        self.t0 = time.perf_counter()
        own_now = lambda key, a: self._copy(key, a) if key.startswith("own/") else a  # noqa
        self.started = begin(save_dir, step, comm, pieces, own, copy=own_now)
        self.meta, self.scalars = meta, scalars
        self.copied = threading.Event()
        if self.started.error is None:
            self.thread = threading.Thread(target=self._write, args=(self.started,),
                                           name="hpcdist-async-save", daemon=True)
            self.thread.start()
        else:
            self.copied.set()

    def _write(self, started: Started) -> None:
        try:                                     # the state's views into the host buffers,
            started.arrays = {k: self._copy(k, a) if k.startswith("p") else a   # while the
                              for k, a in started.arrays.items()}    # next step computes
            self.copied.set()
            delay = float(os.environ.get("HPCDIST_SAVE_DELAY_S", "0") or 0)   # (crash tests)
            if delay:
                time.sleep(delay)
            started.digest, started.error = write_file(started.path, started.arrays)
        except Exception as e:                   # (agreed by publish: every rank raises)
            started.digest, started.error = None, f"{type(e).__name__}: {e}"
        finally:
            self.copied.set()
            started.arrays = {}                  # (the buffers stay for the next save)

    def wait_copied(self) -> None:
        """Before the step changes the state (the gradient sync, the optimizer): the save's
        copy of it is complete. The copy runs while the step's forward and backward read
        the state, so a save stalls the step only where they are shorter than a copy."""
        if self.started is not None:
            self.copied.wait()

    def written(self) -> bool:
        """This rank's file is written (or failed), without waiting."""
        return self.thread is None or not self.thread.is_alive()

    def ready(self, comm) -> bool:
        """Every rank's file is written (collective: each rank's flag, their minimum)."""
        if self.started is None:
            return False
        flag = comm.allreduce(np.array([1 if self.written() else 0], dtype=np.int64), op="min")
        return bool(flag[0])

    def finish(self, comm) -> tuple[str, float] | None:
        """Wait for this rank's file, then publish the save (collective); (its folder, the
        seconds since it began), or None with no save in flight. Raises CheckpointError on
        every rank where any rank's write failed (the previous ``latest`` kept)."""
        if self.started is None:
            return None
        if self.thread is not None:
            self.thread.join()
        started, self.started, self.thread = self.started, None, None
        folder = publish(started, comm, self.meta, self.scalars)
        return folder, time.perf_counter() - self.t0
