"""Dropout's random numbers, owned by hpcdist (backend.seed / rng / rng_state use it)."""
from __future__ import annotations

import math

import numpy as np


class DropoutRNG:
    """Dropout's random numbers, owned by hpcdist: a counter-based generator whose whole state
    is two integers (a key from the seed, and how many numbers were drawn), the same on NumPy
    and CuPy, JSON-able for checkpoints and exact to restore for recomputation.

    Number i of the stream is splitmix64's finalizer of ``key + i * golden``: every draw is a
    pure function of (key, counter), computed with elementwise xp integer math, so the CPU and
    the GPU draw bitwise the same masks. Why not the array module's generator: CuPy's
    ``Generator.bit_generator.state`` is a method returning the cuRAND state's device pointer,
    not NumPy's dict property, so neither a checkpoint nor a recomputed block could save or
    restore it (recomputed dropout masks silently differed from the forward's)."""

    GOLDEN = 0x9E3779B97F4A7C15
    MASK = (1 << 64) - 1

    def __init__(self, seed: int = 0):
        self.key = _splitmix64(int(seed) & self.MASK)
        self.counter = 0

    def state(self) -> dict:
        return {"kind": "splitmix64-counter", "key": self.key, "counter": self.counter}

    def set_state(self, state: dict) -> None:
        if state.get("kind") != "splitmix64-counter":
            raise ValueError(f"not a dropout generator state: {sorted(state)}")
        self.key, self.counter = int(state["key"]), int(state["counter"])

    def bits(self, shape, mod=np):
        """uint64 random bits of ``shape`` in array module ``mod`` (numpy or cupy); advances
        the counter."""
        n = math.prod(int(d) for d in shape)
        z = self._mix(mod.arange(n, dtype=np.uint64), self.counter)
        self.counter += n
        return z.reshape(shape)

    def bits_at(self, shape, picks: dict, mod=np, counter: int | None = None):
        """The bits that a draw of ``shape`` at ``counter`` (default: the current one) gives
        the elements at ``picks`` ({axis: indices along it}; every index along the other
        axes): a rank's slice of one logical draw (its positions of a sequence, its heads).
        Advances nothing: the caller ``advance``s past the whole draw once."""
        index = mod.zeros((1,) * len(shape), dtype=np.uint64)
        stride = 1
        for axis in reversed(range(len(shape))):
            along = picks.get(axis)
            along = mod.arange(int(shape[axis]), dtype=np.uint64) if along is None else \
                mod.asarray(along).astype(np.uint64)
            view = [1] * len(shape)
            view[axis] = -1
            index = index + (along * np.uint64(stride)).reshape(view)
            stride *= int(shape[axis])
        return self._mix(index, self.counter if counter is None else counter)

    def advance(self, n: int) -> int:
        """Skip ``n`` numbers (a draw taken with ``bits_at``); returns the counter before."""
        before = self.counter
        self.counter += int(n)
        return before

    def _mix(self, i, counter: int):
        """Number i of the stream after ``counter`` numbers: splitmix64's finalizer."""
        z = i * np.uint64(self.GOLDEN)
        z += np.uint64((self.key + counter * self.GOLDEN) & self.MASK)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return z

    def random(self, shape, mod=np):
        """Uniform floats in [0, 1) of ``shape`` (53 random bits each, float64)."""
        return (self.bits(shape, mod) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def keep_mask(self, shape, p: float, mod=np):
        """Bool array, True with probability 1 - p: dropout's kept elements."""
        return self.bits(shape, mod) >= self.threshold(p)

    def keep_mask_at(self, shape, picks: dict, p: float, mod=np, counter: int | None = None):
        """``keep_mask`` of the elements at ``picks`` of a draw of ``shape`` (``bits_at``)."""
        return self.bits_at(shape, picks, mod, counter) >= self.threshold(p)

    def threshold(self, p: float):
        """Bits at or above this are kept (probability 1 - p)."""
        return np.uint64(min(int(p * 2.0 ** 64), self.MASK))


def _splitmix64(x: int) -> int:
    """splitmix64's finalizer on one Python integer (the key of a seed)."""
    m = DropoutRNG.MASK
    z = (x + DropoutRNG.GOLDEN) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


_rng = DropoutRNG(0)   # the generator behind dropout


def seed(value: int) -> None:
    """Seed the generator behind dropout (the same stream on every device)."""
    global _rng
    _rng = DropoutRNG(value)


def rng_state() -> dict:
    """The dropout generator's state (JSON-able), for checkpoints and recomputation."""
    return _rng.state()


def set_rng_state(state: dict) -> None:
    _rng.set_state(state)


def rng() -> DropoutRNG:
    """The dropout generator (seed 0 unless ``seed`` was called)."""
    return _rng
