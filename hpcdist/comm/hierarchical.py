"""Two-level collectives for ranks spread evenly over N nodes of L ranks each.

Inside a node ranks share memory; between nodes they share one slow link per node. A flat
ring crosses that link 2(P-1) times per allreduce (P = N x L); these algorithms cross it
2(N-1) times, in L concurrent flows of 1/L of the data each (Horovod's hierarchical
allreduce, NCCL's trees and rings per node, ChainerMN's two-dimensional allreduce) — the
list goes on in docs/communication.md, "hpcdist/comm/hierarchical.py"."""
from __future__ import annotations

from ..device import backend
from . import ring
from .arith import bounds_of, shard_bounds
from .algorithm import Algorithm


def allreduce_inplace(wire, buf, op: str) -> None:
    levels = wire.levels()
    if levels is None:
        return ring.allreduce_inplace(wire, buf, op)
    node, cross, _ = levels
    L = node.Get_size()
    lo, hi = ring.reduce_scatter_inplace(node, buf, op)          # 1. inside the node
    if cross.Get_size() > 1 and hi > lo:
        ring.allreduce_inplace(cross, buf[lo:hi], op)             # 2. across the nodes
    ring.allgather_inplace(node, buf, [shard_bounds(buf.size, L, c) for c in range(L)])  # 3.


def _blocks(levels, length: int):
    """The l-major order of the P shards of a length-``length`` array: (order of ranks,
    [lo, hi) of each local index's block in that order, [lo, hi) of each node's shard
    inside its block)."""
    node, cross, table = levels
    N, L = cross.Get_size(), node.Get_size()
    P = N * L
    order = [table[n * L + l] for l in range(L) for n in range(N)]
    sizes = [shard_bounds(length, P, r)[1] - shard_bounds(length, P, r)[0] for r in order]
    blocks = bounds_of(sum(sizes[l * N:(l + 1) * N]) for l in range(L))
    inner = [bounds_of(sizes[l * N:(l + 1) * N]) for l in range(L)]
    return order, blocks, inner


def _permuted(buf, order, P):
    xp = backend.array_module(buf)
    parts = [buf[slice(*shard_bounds(buf.size, P, r))] for r in order]
    return xp.concatenate(parts) if parts else buf.copy()


def _other_pieces(bounds, length: int, P: int) -> bool:
    """Pieces other than the shard rule (the two levels serve that one only)."""
    return bounds is not None and list(bounds) != [shard_bounds(length, P, c) for c in range(P)]


def reduce_scatter_inplace(wire, buf, op: str, bounds=None) -> tuple[int, int]:
    """As ``ring.reduce_scatter_inplace`` with the shard rule: afterwards ``buf[lo:hi]``
    (returned) is this rank's reduced shard, the rest scratch (other ``bounds``: the ring)."""
    levels = wire.levels()
    if levels is None or _other_pieces(bounds, buf.size, wire.Get_size()):
        return ring.reduce_scatter_inplace(wire, buf, op, bounds)
    node, cross, _ = levels
    P, rank = wire.Get_size(), wire.Get_rank()
    order, blocks, inner = _blocks(levels, buf.size)
    work = _permuted(buf, order, P)
    b_lo, b_hi = ring.reduce_scatter_inplace(node, work, op, bounds=blocks)
    block = work[b_lo:b_hi]
    i_lo, i_hi = ring.reduce_scatter_inplace(cross, block, op, bounds=inner[node.Get_rank()])
    lo, hi = shard_bounds(buf.size, P, rank)
    buf[lo:hi] = block[i_lo:i_hi]
    return lo, hi


def allgather_inplace(wire, buf, bounds=None) -> None:
    """Fill every shard of ``buf`` (the shard rule; other ``bounds``: the ring) from its
    owner."""
    levels = wire.levels()
    P = wire.Get_size()
    if levels is None or _other_pieces(bounds, buf.size, P):
        return ring.allgather_inplace(wire, buf, bounds or [shard_bounds(buf.size, P, c)
                                                            for c in range(P)])
    node, cross, _ = levels
    order, blocks, inner = _blocks(levels, buf.size)
    l = node.Get_rank()
    work = backend.array_module(buf).empty_like(buf)
    b_lo, b_hi = blocks[l]
    i_lo, i_hi = inner[l][cross.Get_rank()]
    lo, hi = shard_bounds(buf.size, P, wire.Get_rank())
    work[b_lo + i_lo:b_lo + i_hi] = buf[lo:hi]
    ring.allgather_inplace(cross, work[b_lo:b_hi], inner[l])       # across the nodes
    ring.allgather_inplace(node, work, blocks)                       # inside the node
    off = 0
    for r in order:                                                  # back in rank order
        s_lo, s_hi = shard_bounds(buf.size, P, r)
        buf[s_lo:s_hi] = work[off:off + s_hi - s_lo]
        off += s_hi - s_lo


def two_level_times(kind: str, nbytes: int, topo) -> tuple[float, float]:
    """(flat ring, hierarchical) seconds the per-level alpha-beta model gives. A flat ring
    over block-placed ranks crosses a node link at every one of its steps, so the slow link
    sets each step's time; the hierarchical one crosses it only in its inter-node phase,
    where the node's L ranks share the link (S/N bytes per step on it)."""
    N, L = topo.nodes, topo.per_node
    P = N * L
    (ai, bi), (ae, be) = topo.links["intra"], topo.links["inter"]
    phases = 2 if kind == "allreduce" else 1
    flat = phases * (P - 1) * (ae + nbytes / P * be)
    hier = phases * ((L - 1) * (ai + nbytes / L * bi) + (N - 1) * (ae + nbytes / N * be))
    return flat, hier


def _prefer(kind, nbytes, world, topo, short_limit) -> bool:
    """Whether the two levels beat the flat algorithms: the flat ring, or the short call's
    log2(P) whole-buffer rounds across nodes where the call is short (``short_limit``: the
    size up to which it is)."""
    flat, hier = two_level_times(kind, nbytes, topo)
    if nbytes <= short_limit:
        ae, be = topo.links["inter"]
        flat = min(flat, (world - 1).bit_length() * (ae + nbytes * be))
    return hier < flat


HIERARCHICAL = Algorithm(
    "hierarchical", kinds=("allreduce", "reduce_scatter", "allgather"),
    runs={"allreduce": allreduce_inplace, "reduce_scatter": reduce_scatter_inplace,
          "allgather": allgather_inplace},
    prefer=_prefer, cost=ring.ring_cost)        # priced on one link level: as the flat ring
