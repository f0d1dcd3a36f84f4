"""How DiLoCo's pseudo-gradients cross between replica groups: averaged over ``cross`` in the
master dtype, in fp16/bf16 on the wire (reduced in the master dtype), or quantized to 8 or 4
bits with one scale per chunk of ``CHUNK`` values (every group's quantized copy gathered and
averaged where it lands: a sum of 4-bit codes has no 4-bit form). Non-blocking: ``start``
returns a pending exchange whose ``wait`` gives the average.
"""
from __future__ import annotations

import numpy as np

from ..device import backend

WIRES = ("fp32", "fp16", "bf16", "int8", "int4")
CHUNK = 256                         # values per scale (fp32): 1/8 bit of overhead a value
LEVELS = {"int8": 127, "int4": 7}   # symmetric codes in [-L, L]


def wire_bytes(n: int, wire: str, itemsize: int) -> float:
    """Bytes one group's copy of ``n`` values takes on the wire."""
    if wire in LEVELS:
        chunks = -(-n // CHUNK)
        return chunks * 4 + (n if wire == "int8" else -(-n // 2))
    return n * {"fp16": 2, "bf16": 2}.get(wire, itemsize)


def quantize(x, wire: str):
    """``x`` (1-D) as bytes: the chunks' fp32 scales, then the codes (int4: two a byte)."""
    xp = backend.array_module(x)
    n, level = x.size, LEVELS[wire]
    chunks = -(-n // CHUNK)
    padded = xp.zeros(chunks * CHUNK, dtype=np.float32)
    padded[:n] = x
    blocks = padded.reshape(chunks, CHUNK)
    scale = (xp.abs(blocks).max(axis=1) / level).astype(np.float32)
    safe = xp.where(scale > 0, scale, 1).astype(np.float32)
    codes = xp.clip(xp.rint(blocks / safe[:, None]), -level, level).astype(np.int16).reshape(-1)
    if wire == "int8":
        body = codes[:n].astype(np.int8).view(np.uint8)
    else:
        nib = (codes + 8).astype(np.uint8)
        nib = nib[:2 * (-(-n // 2))]
        body = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    return xp.concatenate([scale.view(np.uint8), body])


def dequantize(buf, n: int, wire: str, dtype):
    """The values ``quantize`` packed into ``buf``."""
    xp = backend.array_module(buf)
    chunks = -(-n // CHUNK)
    scale = buf[:4 * chunks].view(np.float32)
    body = buf[4 * chunks:]
    if wire == "int8":
        codes = body.view(np.int8).astype(np.float32)
    else:
        codes = xp.empty(2 * body.size, dtype=np.float32)
        codes[0::2] = (body & 15).astype(np.float32) - 8
        codes[1::2] = (body >> 4).astype(np.float32) - 8
        codes = codes[:n]
    full = xp.zeros(chunks * CHUNK, dtype=np.float32)
    full[:n] = codes
    return (full.reshape(chunks, CHUNK) * scale[:, None]).reshape(-1)[:n].astype(dtype)


class Pending:
    """An exchange in flight: ``wait()`` -> the average over the groups."""

    def __init__(self, handle, finish):
        self.handle, self.finish = handle, finish

    def wait(self):
        return self.finish(self.handle.wait() if self.handle is not None else None)


class OuterWire:
    """Pseudo-gradients averaged over ``comm`` (one rank a group) in ``wire``; ``errors``
    holds each quantized exchange's relative error (this group's copy, as sent)."""

    def __init__(self, comm, wire: str = "fp32"):
        if wire not in WIRES:
            raise ValueError(f"unknown outer wire {wire!r}: choose one of {', '.join(WIRES)}")
        self.comm, self.wire = comm, wire
        self.errors: list = []

    def start(self, delta) -> Pending:
        """Begin averaging ``delta`` (1-D; left alone until ``wait``)."""
        G = self.comm.size
        if delta.size == 0 or (G == 1 and self.wire not in LEVELS):
            return Pending(None, lambda _: delta)
        if self.wire not in LEVELS:
            low = {"fp16": np.float16, "bf16": backend.compute_dtype("bf16")}.get(self.wire)
            h = self.comm.iallreduce(delta, "avg", out=delta, wire_dtype=low)
            return Pending(h, lambda out: out)
        packed = quantize(delta, self.wire)
        mine = dequantize(packed, delta.size, self.wire, delta.dtype)
        xp = backend.array_module(delta)
        norm = float(xp.linalg.norm(delta))
        self.errors.append(float(xp.linalg.norm(mine - delta)) / norm if norm else 0.0)
        if G == 1:
            return Pending(None, lambda _: mine)
        h = self.comm.iallgather(packed)

        def average(gathered):              # in group order: the same bits in every group
            each = gathered.reshape(G, packed.size)
            out = dequantize(each[0], delta.size, self.wire, delta.dtype)
            for g in range(1, G):
                out += dequantize(each[g], delta.size, self.wire, delta.dtype)
            return out / G
        return Pending(h, average)
