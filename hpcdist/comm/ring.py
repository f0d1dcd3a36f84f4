"""Ring reduce-scatter, ring allgather and ring allreduce (reduce-scatter, then allgather).

Bandwidth-optimal: each rank sends 2(P-1)/P of the buffer in 2(P-1) steps of one chunk.
Chunks follow the shard rule (arith.py), so after the reduce-scatter phase rank r holds the
reduced shard r — exactly ``reduce_scatter``'s result — and ZeRO can stop there.
"""
from __future__ import annotations

from ..device import backend
from .arith import as_bytes, finish, reduce_into, ring_peers, shard_bounds
from .algorithm import ALWAYS, Algorithm

TAG = 101


def reduce_scatter_inplace(wire, buf, op: str, bounds=None, wire_dtype=None) -> tuple[int, int]:
    """Reduce ``buf`` across ranks; afterwards ``buf[lo:hi]`` (returned) is this rank's reduced
    piece and the rest of ``buf`` is scratch. ``avg`` is finished on the piece.

    ``bounds[c]`` is rank c's piece (default: the shard rule); pieces may differ in size
    (ZeRO reduce-scatters a bucket onto the global shards). ``wire_dtype`` (e.g. float16) is
    what travels; the reduction stays in ``buf``'s dtype.
    """
    P, r = wire.Get_size(), wire.Get_rank()
    L = buf.size
    if bounds is None:
        bounds = [shard_bounds(L, P, c) for c in range(P)]
    left, right = ring_peers(r, P)
    xp = backend.array_module(buf)
    widest = max(hi - lo for lo, hi in bounds)
    incoming = xp.empty(widest, dtype=buf.dtype if wire_dtype is None else wire_dtype)
    for step in range(P - 1):
        send_c, recv_c = (r - step - 1) % P, (r - step - 2) % P   # last step receives chunk r
        (slo, shi), (rlo, rhi) = bounds[send_c], bounds[recv_c]
        part = incoming[:rhi - rlo]
        out = buf[slo:shi] if wire_dtype is None else buf[slo:shi].astype(wire_dtype)
        wire.Sendrecv(as_bytes(out), right, TAG, as_bytes(part), left, TAG)
        reduce_into(buf[rlo:rhi], part if wire_dtype is None else part.astype(buf.dtype), op)
    lo, hi = bounds[r]
    finish(buf[lo:hi], op, P)
    return lo, hi


def allgather_inplace(wire, buf, bounds, pos=None, left=None, right=None,
                      *, wire_dtype=None) -> None:
    """Fill every piece of ``buf`` from the rank that owns it.

    ``bounds[i]`` is piece i's [lo, hi); the rank at ring position ``pos`` owns piece ``pos``
    on entry. Pieces may differ in size (allgatherv). ``pos``/``left``/``right`` default to the
    rank and its ring neighbours; the scatter-allgather broadcast passes root-relative ones.
    With ``wire_dtype`` pieces travel in that dtype, and the owner rounds its own piece the
    same way, so that every rank ends with identical values.
    """
    P = wire.Get_size()
    if pos is None:
        pos = wire.Get_rank()
        left, right = ring_peers(pos, P)
    if wire_dtype is not None:
        lo, hi = bounds[pos]
        rounded = buf[lo:hi].astype(wire_dtype)
        buf[lo:hi] = rounded
        staged = backend.array_module(buf).empty(buf.size, dtype=wire_dtype)
        staged[lo:hi] = rounded
        allgather_inplace(wire, staged, bounds, pos, left, right)
        buf[...] = staged.astype(buf.dtype)
        return
    for step in range(P - 1):
        send_c, recv_c = (pos - step) % P, (pos - step - 1) % P
        (slo, shi), (rlo, rhi) = bounds[send_c], bounds[recv_c]
        wire.Sendrecv(as_bytes(buf[slo:shi]), right, TAG + 1, as_bytes(buf[rlo:rhi]), left, TAG + 1)


def allreduce_inplace(wire, buf, op: str, wire_dtype=None) -> None:
    """Phase 1: ring reduce-scatter. Phase 2: ring allgather of the reduced shards."""
    P = wire.Get_size()
    reduce_scatter_inplace(wire, buf, op, wire_dtype=wire_dtype)
    allgather_inplace(wire, buf, [shard_bounds(buf.size, P, c) for c in range(P)],
                      wire_dtype=wire_dtype)


# "auto" runs the ring allreduce from this size up (Rabenseifner's below: recursive_doubling.py
# has the measurements); reduce-scatter and allgather always run it (hierarchical.py aside).
ALLREDUCE_RING_BYTES = 2 << 20


def ring_cost(kind, nbytes, P, a, b):
    """The ring's alpha-beta time: 2(P-1) steps for an allreduce, P-1 for the rest."""
    if kind == "allreduce":
        return 2 * (P - 1) * a + 2 * (P - 1) / P * nbytes * b
    return (P - 1) * a + (P - 1) / P * nbytes * b


RING = Algorithm(
    "ring", kinds=("allreduce", "reduce_scatter", "allgather", "allgatherv"),
    runs={"allreduce": allreduce_inplace, "reduce_scatter": reduce_scatter_inplace,
          "allgather": allgather_inplace, "allgatherv": allgather_inplace},
    auto=lambda kind, nbytes, world: kind != "allreduce" or nbytes >= ALLREDUCE_RING_BYTES,
    rides_short={"reduce_scatter": ALWAYS, "allgather": ALWAYS},
    wire_bytes=lambda kind, n, P, itemsize: 2 * (P - 1) * -(-n // P) * itemsize,
    cost=ring_cost)
