"""The rings of ring attention, shared by its two kinds of block (ring_flash.py's tiled
kernels, ring_attention.py's NumPy blocks with dropout): K|V blocks travelling round the
context-parallel group while the block in hand is scored, and back the other way with their
dK|dV accumulating."""
from __future__ import annotations

from ..device import backend
from ..host import timeline

TAG_KV, TAG_KV_BACK, TAG_DKV = 101, 102, 103


def _kv_block(cp, kv, r: int):
    """(shape, dtype) of rank r's K|V block: its own number of positions."""
    return kv.shape[:-2] + (len(cp.positions(r)),) + kv.shape[-1:], kv.dtype


def rotate_forward(cp, kv, step) -> None:
    """The forward's ring: ``step(k, v, src)`` on the block in hand (rank ``src``'s) while the
    next one is on its way (rank i sends to i + 1); ``kv`` (2, ..., T_r, width) this rank's."""
    comm, n, i = cp.comm, cp.n, cp.rank
    for s in range(n):
        nxt = None
        if s < n - 1:                     # the next block is on its way while this one computes
            nxt = (comm.isend(kv, (i + 1) % n, TAG_KV),
                   comm.irecv((i - 1) % n, TAG_KV, *_kv_block(cp, kv, (i - s - 1) % n)))
        with timeline.span("cp block", cat="cp", step=s):
            step(kv[0], kv[1], (i - s) % n)
        if nxt is not None:               # receives first: a send completes once received
            with timeline.span("cp wait", cat="cp", step=s):
                kv = nxt[1].wait()
                nxt[0].wait()


def rotate_backward(cp, blk, step):
    """The backward's ring: blocks go round the other way (to i - 1), ``step(k, v, src)``
    returning the block's dK|dV part, which travels with it and accumulates; returns this
    rank's own block's, from every query."""
    xp = backend.array_module(blk)
    comm, n, i = cp.comm, cp.n, cp.rank
    acc = xp.zeros_like(blk)              # the dK/dV of the block in hand, accumulating
    incoming = sent = None
    for s in range(n):                    # rank i holds block i + s; sends go to i - 1
        nxt = None
        if s < n - 1:
            nxt = (comm.isend(blk, (i - 1) % n, TAG_KV_BACK),
                   comm.irecv((i + 1) % n, TAG_KV_BACK, *_kv_block(cp, blk, (i + s + 1) % n)))
        with timeline.span("cp block", cat="cp", step=s):
            part = step(blk[0], blk[1], (i + s) % n)
        if incoming is not None:          # receives first: a send completes once received
            with timeline.span("cp wait", cat="cp", step=s):
                acc = incoming.wait()
                sent.wait()
        acc = acc + part
        sent = comm.isend(acc, (i - 1) % n, TAG_DKV)
        incoming = comm.irecv((i + 1) % n, TAG_DKV, *_kv_block(cp, blk, (i + s + 1) % n))
        if nxt is not None:
            with timeline.span("cp wait", cat="cp", step=s):
                blk = nxt[1].wait()
                nxt[0].wait()
    with timeline.span("cp wait", cat="cp", step=n):
        dkv = incoming.wait()
        sent.wait()
    return dkv
