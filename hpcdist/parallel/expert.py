"""Expert parallelism (``--ep N``): each MoE layer's E experts split over the N ranks of an
expert-parallel group, the tokens moved to them and back with the all-to-all.

    rank r keeps experts [r E/N, (r+1) E/N) (names unchanged: ``experts.<global index>``)
    dispatch: rows per (destination, expert) first, then the rows and their global token
              order (all-to-all-v), regrouped by local expert: one GEMM pair per expert
    combine:  the reverse all-to-all-v; each exchange's backward is the reverse exchange

EP folds over data parallelism as Megatron's does: dense gradients averaged over dp x ep, an
expert's summed over the ranks holding it and divided by dp x ep too (ddp.py's expert
buckets). The rest: docs/moe.md.
"""
from __future__ import annotations

import time

import numpy as np

from ..device import backend
from ..autograd.tensor import Tensor
from ..nn.module import Module
from ..nn.moe import MoE, moe_layers


class _Experts(Module):
    """This rank's experts under their global indices; ``[i]`` is the i-th of them."""

    def __init__(self, experts: dict):
        for i, e in experts.items():
            setattr(self, str(i), e)
        self.order = sorted(experts)

    def __getitem__(self, i: int):
        return getattr(self, str(self.order[i]))

    def __iter__(self):
        return (getattr(self, str(i)) for i in self.order)

    def __len__(self):
        return len(self.order)


def _all_to_all(comm, x: Tensor, send_rows, recv_rows, meanwhile=None):
    # ``comm``: the exchange (its ``alltoall``/``ialltoall`` may time the calls)
    """Rows of ``x`` to each rank (``send_rows`` each, in rank order) -> the rows from each
    (``recv_rows``); its backward sends the gradient rows back the same way reversed. With
    ``meanwhile``, the exchange is started, ``meanwhile()`` runs while it is in flight (the
    Communicator's progress thread moves it), and (rows, what meanwhile returned) come back."""
    C = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    xp = backend.array_module(x.data)
    shape = (-1,) + tuple(x.shape[1:])

    def args(a, out_rows, in_rows):
        return (xp.ascontiguousarray(a).reshape(-1), [int(n) * C for n in out_rows],
                [int(n) * C for n in in_rows])

    def move(a, out_rows, in_rows):
        return xp.concatenate(comm.alltoall(*args(a, out_rows, in_rows))).reshape(shape)
    if meanwhile is None:
        return Tensor._make(move(x.data, send_rows, recv_rows), (x,),
                            lambda g: (move(g, recv_rows, send_rows),))
    handle = comm.ialltoall(*args(x.data, send_rows, recv_rows))
    side = meanwhile()
    rows = xp.concatenate(handle.wait()).reshape(shape)
    return Tensor._make(rows, (x,), lambda g: (move(g, recv_rows, send_rows),)), side


class ExpertExchange:
    """The dispatch and combine of one MoE layer's tokens over the EP group ``comm``.
    ``calls``: None, or a list that gets (bytes of this rank's buffer, seconds) of every
    all-to-all it makes, backward ones included (``python -m hpcdist.bench moe`` sets it)."""

    overlap = True                # the shared experts run while the dispatch is in flight

    def __init__(self, comm):
        self.comm, self.calls = comm, None
        self.rows = None          # the last forward's (rows sent to, rows received from) each rank

    def alltoall(self, buf, counts=None, recv_counts=None) -> list:
        """``comm.alltoall``, timed where ``calls`` asks for it."""
        if self.calls is None:
            return self.comm.alltoall(buf, counts=counts, recv_counts=recv_counts)
        return self.ialltoall(buf, counts, recv_counts).wait()

    def ialltoall(self, buf, counts=None, recv_counts=None):
        """``comm.ialltoall``; where ``calls`` asks, its wait records (bytes, seconds spent
        starting it and waiting for it — not the work done between —, counts, itemsize)."""
        t0 = time.perf_counter()
        handle = self.comm.ialltoall(buf, counts=counts, recv_counts=recv_counts)
        if self.calls is None:
            return handle
        calls, wait, started = self.calls, handle.wait, time.perf_counter() - t0

        def timed():
            t1 = time.perf_counter()
            out = wait()
            calls.append((int(buf.nbytes), started + time.perf_counter() - t1, counts,
                          buf.itemsize))
            return out
        handle.wait = timed
        return handle

    def __call__(self, moe: MoE, xs: Tensor, per, keys, tokens: int, meanwhile=list):
        """``xs``: this rank's assignment rows sorted by expert (``per[e]`` rows for global
        expert e, ``keys`` their global token order) -> (their outputs, kept 0/1, what
        ``meanwhile()`` returned: run while the rows travel where ``overlap`` is on), rows
        in the same order; ``tokens``: this rank's tokens."""
        comm, xp = self, backend.array_module(xs.data)
        P, E = self.comm.size, moe.E
        per = np.asarray(per, dtype=np.int64)
        send_rows = per.reshape(P, E // P).sum(axis=1)
        recv_per = np.stack(comm.alltoall(per))                    # (sources, my experts)
        recv_rows = recv_per.sum(axis=1)
        self.rows = (send_rows, recv_rows)
        kr = xp.concatenate(comm.alltoall(xp.ascontiguousarray(keys), counts=send_rows,
                                          recv_counts=recv_rows))
        if self.overlap:                                            # (source, expert) order
            xr, side = _all_to_all(comm, xs, send_rows, recv_rows, meanwhile)
        else:
            side = meanwhile()
            xr = _all_to_all(comm, xs, send_rows, recv_rows)
        start = np.cumsum(np.concatenate([[0], recv_per.reshape(-1)]))[:-1].reshape(recv_per.shape)
        order = np.concatenate([np.arange(start[s, e], start[s, e] + recv_per[s, e])
                                for e in range(recv_per.shape[1]) for s in range(P)]
                               ).astype(np.int64)                   # -> (expert, source)
        order_d = xp.asarray(order)
        ys, kept = moe.run_experts(xr[order_d], recv_per.sum(axis=0), kr[order_d], tokens * P)
        back = xp.asarray(np.argsort(order))
        yr = _all_to_all(comm, ys[back], recv_rows, send_rows)
        kept = xp.concatenate(comm.alltoall(xp.ascontiguousarray(kept[back]).astype(np.uint8),
                                            counts=recv_rows, recv_counts=send_rows))
        return yr, kept.astype(bool), side


def bytes_per_layer(send_rows, recv_rows, rank: int, E: int, C: int, itemsize: int) -> int:
    """Bytes rank ``rank`` sends over the EP group for one MoE layer's forward and backward,
    having sent ``send_rows[d]`` assignment rows (width C) to rank d and received
    ``recv_rows[s]`` from rank s: the counts (E int64, by the algorithm "auto" picks), the rows
    out and their int64 token order, the outputs back and a kept byte each, and in backward
    the gradients of both exchanges (the self piece stays local)."""
    from ..comm import registry, select
    P = len(send_rows)
    out = sum(int(n) for d, n in enumerate(send_rows) if d != rank)
    back = sum(int(n) for s, n in enumerate(recv_rows) if s != rank)
    name = select.choose("alltoall", E * 8, P, short=False)
    counts = registry.get(name).wire_bytes("alltoall", E, P, 8)
    return counts + out * (2 * C * itemsize + 8) + back * (2 * C * itemsize + 1)


def apply_expert_parallel(model, comm):
    """Keep this rank's share of every MoE layer's experts (``comm``: the EP group), in
    place; returns the model and the parameters now held by this rank alone (their
    gradients are averaged over the expert-data-parallel group)."""
    experts = []
    for m in moe_layers(model):
        if m.E % comm.size:
            raise ValueError(f"--ep {comm.size} must divide the {m.E} experts")
        n = m.E // comm.size
        m.first = comm.rank * n
        m.experts = _Experts({m.first + i: m.experts[m.first + i] for i in range(n)})
        m.exchange = ExpertExchange(comm)
        experts += m.experts.parameters()
    return model, experts
