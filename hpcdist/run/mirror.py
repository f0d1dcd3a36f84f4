"""Committed state in a peer's memory (``--mirror-every K`` under ``--on-failure shrink``): a
layout whose state is sharded (ZeRO, TP, PP, CP, EP) recovers a lost rank from its buddy's
memory, not from the last checkpoint, and loses no committed step (K = 1) or at most K - 1.

Every K committed steps each rank copies what a checkpoint would take from it
(``state.pieces_to_save``) to the host, keeps it, and sends it to its buddy (the nearest rank
on another node, else the next rank), receiving its own ward's. Two generations are kept: a
failure in the middle of an exchange restores the one before. After a failure the survivors
agree on the newest generation every one of them holds whole; each brings its own pieces and
those of a lost ward, and every survivor assembles the logical tensors (reshard.assemble)
that the any-layout restore reads like a checkpoint (``recovery.Snapshot``). A rank lost
with its buddy: the last checkpoint (docs/failures.md, "In-job recovery").
"""
from __future__ import annotations

import json

import numpy as np

from ..checkpoint import reshard
from ..device import backend
from ..parallel import state


class Generation:
    """One exchange: the step, the run's scalars then, this rank's pieces and its ward's
    (None until they arrived: the generation is whole only then)."""

    def __init__(self, step: int, scalars: dict, own: list):
        self.step, self.scalars, self.own, self.ward = step, scalars, own, None


def buddy_offset(node_of: list) -> int:
    """The smallest d such that rank r + d (mod n) is on another node for every r (a node
    lost takes no rank together with its buddy); 1 where no such d exists (one node) among
    the first 256 (a placement that regular would have shown it by then)."""
    n = len(node_of)
    for d in range(1, min(n, 257)):
        if all(node_of[(r + d) % n] != node_of[r] for r in range(n)):
            return d
    return 1


def _pack(pieces: list) -> tuple[np.ndarray, np.ndarray]:
    """(a JSON header, the bytes) of [(name, cut, shape, (a, b), host array)]."""
    head = [[name, cut, list(shape), list(ab), str(arr.dtype), int(arr.nbytes)]
            for name, cut, shape, ab, arr in pieces]
    data = np.concatenate([np.ascontiguousarray(p[4]).reshape(-1).view(np.uint8)
                           for p in pieces]) if pieces else np.zeros(0, np.uint8)
    return np.frombuffer(json.dumps(head).encode(), dtype=np.uint8), data


def _unpack(head: np.ndarray, data: np.ndarray) -> list:
    out, at = [], 0
    for name, cut, shape, ab, dtype, nbytes in json.loads(bytes(head).decode()):
        arr = data[at:at + nbytes].view(np.dtype(dtype)).copy()
        out.append((name, reshard.normal(cut), tuple(shape), tuple(ab), arr))
        at += nbytes
    return out


class Mirror:
    """This rank's mirror: its own committed pieces and its ward's, two generations."""

    def __init__(self, every: int, comm):
        self.every, self.rank, self.size = every, comm.rank, comm.size
        self.offset = buddy_offset(list(comm.node_of))
        self.generations: list[Generation] = []

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, step: int, cfg, comm, strategy, sampler) -> int:
        """Keep this committed step's pieces, send them to the buddy, take the ward's
        (collective over ``comm``); the bytes sent."""
        scalars = state.scalars_of(cfg, comm.size, strategy, (sampler.epoch, sampler.position),
                                   sampler.batch_size * sampler.world)
        gen = Generation(step, scalars, state.pieces_to_save(strategy))
        self.generations = (self.generations + [gen])[-2:]   # whole or not, the newest
        sent = 0
        if comm.size > 1:
            head, data = _pack(gen.own)
            buddy, ward = (comm.rank + self.offset) % comm.size, \
                (comm.rank - self.offset) % comm.size
            got_head = comm.sendrecv(head, buddy, ward, sendtag=71)
            got_data = comm.sendrecv(data, buddy, ward, sendtag=72)
            gen.ward = _unpack(backend.to_numpy(got_head), backend.to_numpy(got_data))
            sent = head.nbytes + data.nbytes
        else:
            gen.ward = []
        return sent


NONE = 2 ** 62                      # a rank holding no mirror (one that joined): no veto


def restore(comm, mirror, lost: list):
    """The newest generation every survivor holds whole, assembled on every survivor
    (collective over ``comm``): (step, scalars, {name: logical tensor}), what
    ``recovery.Snapshot`` holds; None where a lost rank's buddy is lost too, no generation is
    whole everywhere (then the checkpoint), or nobody mirrors. ``mirror`` None: a rank that
    holds none (a process that joins, or a layout without one) takes part without a say."""
    newest, gen = NONE, None
    if mirror is not None:
        covered = all((d + mirror.offset) % mirror.size not in lost for d in lost)
        whole = [g.step for g in mirror.generations if g.ward is not None]
        newest = max(whole) if whole and covered else -1
    step = int(backend.to_numpy(comm.allreduce(np.array([newest], dtype=np.int64),
                                               op="min"))[0])
    if mirror is not None:
        gen = next((g for g in mirror.generations if g.step == step and g.ward is not None),
                   None)
    held = mirror is None or gen is not None
    held = int(backend.to_numpy(comm.allreduce(np.array([held], dtype=np.int64), op="min"))[0])
    if step < 0 or step == NONE or not held:
        return None
    mine = []
    if gen is not None:
        ward = (mirror.rank - mirror.offset) % mirror.size
        mine = gen.own + (gen.ward if ward in lost else [])
    pieces = _gather(comm, mine)
    if gen is None:
        return None                                    # (the survivors' rank 0 sends it)
    arrays = {}
    for name, parts in pieces.items():
        shape, dtype = parts[0][0], parts[0][3].dtype
        arrays[name] = reshard.assemble(shape, dtype, [(c, ab, a) for _, c, ab, a in parts])
    scalars = json.loads(json.dumps(gen.scalars))
    scalars["layout"]["after_failure"] = True           # restored as another layout: reseeded
    return step, scalars, arrays


def _gather(comm, pieces: list) -> dict:
    """Every survivor's pieces on every survivor: {name: [(shape, cut, (a, b), array)]}."""
    head, data = _pack(pieces)
    sizes = backend.to_numpy(comm.allgather(np.array([head.size, data.size],
                                                     dtype=np.int64))).reshape(-1, 2)
    heads = backend.to_numpy(comm.allgatherv(head))
    datas = backend.to_numpy(comm.allgatherv(data))
    out: dict = {}
    h = d = 0
    for hn, dn in sizes:
        for name, cut, shape, ab, arr in _unpack(heads[h:h + hn], datas[d:d + dn]):
            out.setdefault(name, []).append((shape, cut, ab, arr))
        h, d = h + hn, d + dn
    return out
