"""What every rank of a save must learn from the others: whether any failed (and the lowest
failing rank's message), and every rank's description of its file (for the manifest)."""
from __future__ import annotations

import json

import numpy as np


def agree_failure(comm, error: str | None) -> str | None:
    """Every rank learns whether any rank failed; returns the lowest failing rank's message."""
    flag = comm.allreduce(np.array([comm.size - comm.rank if error else 0], dtype=np.int64),
                          op="max")
    if not flag[0]:
        return None
    reporter = comm.size - int(flag[0])
    text = np.zeros(1024, dtype=np.uint8)
    if comm.rank == reporter:
        raw = f"rank {reporter}: {error}".encode()[:1024]
        text[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    comm.bcast(text, root=reporter)
    return bytes(text).rstrip(b"\0").decode(errors="replace")


def gather_json(comm, obj) -> list:
    """Every rank's JSON value on every rank (our allgatherv of the UTF-8 bytes)."""
    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    sizes = comm.allgather(np.array([raw.size], dtype=np.int64))
    allbytes = comm.allgatherv(raw.copy())
    out, o = [], 0
    for n in sizes:
        out.append(json.loads(bytes(allbytes[o:o + int(n)]).decode()))
        o += int(n)
    return out
