"""In-job recovery (``--on-failure shrink``): what train's loop does when a peer dies, and
how the survivors go on in the same job (comm/ulfm.py has the MPI side; docs/failures.md).

A data-parallel run resumes from the state every replica holds (``Snapshot``: the committed
step's parameters, optimizer state and scalars, read like a checkpoint), so nothing touches
the filesystem; a layout whose state is sharded (ZeRO, TP, PP, CP, compression) resumes from
its last checkpoint on disk at the survivors' size. Either way the survivors run the same
any-layout restore as ``--resume``, so a recovered run equals a run of N-1 ranks started
from that state.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from .. import checkpoint
from ..checkpoint import reshard
from ..comm import Communicator, ulfm, watchdog
from ..comm.arith import bounds_of
from ..host.layout import Layout
from ..device import backend
from ..host import signals, threads
from ..parallel import state
from .config import ConfigError, TrainConfig, validate, validate_world
from . import mirror, report, sinks


class Mark:
    """Where the run stood as the step in flight began: (step, sampler (epoch, position),
    steps agreed so far); ``mirror``: the committed state in peers' memory (run/mirror.py)
    where the layout shards it, else None."""

    step, sampler, commits = 0, (0, 0), 0

    def __init__(self, cfg=None, comm=None):
        self.mirror = mirror.Mirror(cfg.mirror_every, comm) if cfg is not None and \
            ulfm.enabled() and mirrored(cfg) else None
        self.recovers = cfg is not None and ulfm.enabled()
        self.unread = None                      # the loop's report.Unread

    def at(self, step: int, sampler) -> None:
        self.step, self.sampler, self.commits = step, (sampler.epoch, sampler.position), \
            ulfm.commits()

    def committed(self, step: int, cfg, comm, strategy, sampler) -> int:
        """After committed step ``step``: the mirror's exchange where due; bytes sent."""
        if self.mirror is None or not self.mirror.due(step):
            return 0
        return self.mirror.take(step, cfg, comm, strategy, sampler)


class Snapshot:
    """A committed state in memory, with checkpoint.Reader's interface (``step``,
    ``scalars``, ``tensors``, ``tensor``): what ``state.restore_checkpoint`` reads."""

    folder = "memory"

    def __init__(self, step: int, scalars: dict, arrays: dict):
        self.step, self.scalars, self._arrays = step, scalars, arrays
        self.tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                        for k, v in arrays.items()}

    def tensor(self, name: str):
        return self._arrays[name]

    def own(self, rank: int) -> dict:      # "after_failure" in its layout: never asked
        raise checkpoint.CheckpointError("a recovery holds no rank's own state")


def snapshot(cfg, step: int, strategy, sampler: tuple, global_batch: int, world: int):
    """A data-parallel run's committed state (every replica holds it whole)."""
    scalars = state.scalars_of(cfg, world, strategy, sampler, global_batch)
    scalars["layout"]["after_failure"] = True      # restored as another layout: reseeded
    lo, hi, arrays, _ = strategy.flat_state()
    entries = state.tensor_entries(strategy.model, None)
    out = {}
    for (name, size, cut, shape, _), (o, _) in zip(entries, bounds_of(e[1] for e in entries)):
        for kind, arr in arrays.items():               # (a padded table: its logical rows)
            piece = backend.to_numpy(arr[o - lo:o - lo + size])
            out[f"{kind}/{name}"] = reshard.assemble(shape, piece.dtype,
                                                     [(cut, (0, size), piece)])
    return Snapshot(step, scalars, out)


def replicated(cfg) -> bool:
    """Whether every replica holds the whole state (plain data parallelism)."""
    return cfg.zero == 0 and cfg.tp * cfg.pp * cfg.cp * cfg.ep == 1 and \
        cfg.compress == "none" and cfg.shard_group == "all"


def mirrored(cfg) -> bool:
    """Whether the committed state goes to buddies' memory (sharded, not compressed)."""
    return not replicated(cfg) and cfg.mirror_every > 0 and cfg.compress == "none" and \
        cfg.strategy == "collective"


def caught(exc: BaseException, cfg, strategy, sampler, mark: Mark) -> BaseException:
    """What train's loop raises for ``exc``: ``exc`` itself, unless it says a peer died
    (under --on-failure shrink); then, after every survivor has agreed so, a RankLost that
    carries the committed state."""
    if not ulfm.enabled():
        return exc
    if isinstance(exc, ulfm.RankLost):
        lost = exc
    elif ulfm.is_failure(exc):
        ulfm.revoke_all()                      # the others' waits end too, wherever they are
        try:
            ulfm.commit(False)
        except ulfm.RankLost as e:
            lost = e
    else:
        return exc
    lost.detected = time.time()
    done = ulfm.commits() > mark.commits       # the step in flight was agreed and applied
    step = mark.step + 1 if done else mark.step
    where = (sampler.epoch, sampler.position) if done else mark.sampler
    replicas = strategy.batch_comm.size
    snap = snapshot(cfg, step, strategy, where, sampler.batch_size * replicas, replicas) \
        if replicated(cfg) else None
    lost.committed, lost.failed_step, lost.replicas = snap, mark.step + 1, replicas
    lost.committed_step = step                  # (0: nothing committed, the seed's state)
    lost.mirror = mark.mirror
    lost.records = [r for r in (mark.unread.settled if mark.unread is not None else [])
                    if r["step"] <= step]       # committed steps' records not yet written
    return lost


def recover(cfg, lost: ulfm.RankLost, datasets):
    """(the survivors' communicator, their settings — a copy of ``cfg`` with the layout the
    survivors can hold —, what ``train`` resumes from) (collective over them)."""
    before = ulfm.rank_count()
    survivors, gone = ulfm.shrink()
    joiners = len(gone) if cfg.respawn and gone else 0
    comm = _rebuild(ulfm.respawn(survivors, joiners, sys.argv[1:]) if joiners else survivors)
    notes = [f"{joiners} new rank(s) joined (--respawn)"] if joiners else []
    cfg = dataclasses.replace(cfg)                # the survivors' settings: the run's stay
    if comm.size % Layout.of(cfg, comm.size).model:   # the survivors cannot hold the cuts
        notes.append(f"--tp {cfg.tp} x --pp {cfg.pp} x --cp {cfg.cp} does not divide the "
                     f"{comm.size} ranks left: going on as data parallelism over them")
        cfg.tp = cfg.pp = cfg.cp = cfg.virtual_stages = 1
        cfg.pp_split, cfg.micro_batches = "", 0
        validate(cfg)
    replicas = Layout.of(cfg, comm.size).replicas
    if cfg.ep > 1 and replicas % cfg.ep:         # the experts go over fewer ranks
        ep = max(d for d in range(1, cfg.ep) if cfg.experts % d == 0 and replicas % d == 0)
        notes.append(f"--ep {cfg.ep} does not divide the {replicas} replicas left: the "
                     f"{cfg.experts} experts go over {ep} rank(s) of each group")
        cfg.ep = ep
    if cfg.shrink_batch == "keep" and replicas != lost.replicas:
        total = cfg.batch_size * lost.replicas
        if total % replicas == 0:
            cfg.batch_size = total // replicas
        else:
            notes.append(f"the global batch {total} does not divide over {replicas} "
                         f"replicas: each keeps --batch-size {cfg.batch_size}")
    validate_world(cfg, comm.size, len(datasets[0]), datasets[0].block_size)
    reader, mirrored_state = lost.committed, getattr(lost, "mirror", None)
    if joiners or (reader is None and mirrored_state is not None):   # (joiners: always)
        held = mirror.restore(comm, mirrored_state, gone)
        if reader is None and held is not None:
            reader = Snapshot(*held)
        elif reader is None and mirrored_state is not None:
            notes.append("a lost rank's state was in no survivor's memory (its buddy lost "
                         "too, or lost mid-exchange)")
    if reader is None:
        folder, _ = checkpoint.find_resume(cfg.save_dir) if cfg.save_dir else (None, "")
        if folder is None and getattr(lost, "committed_step", None) == 0 and not joiners:
            return comm, cfg, _from_the_seed(comm, cfg, lost, gone, before, notes,
                                             datasets=datasets)
        if folder is None:
            raise checkpoint.CheckpointError(
                f"no checkpoint {'in ' + cfg.save_dir if cfg.save_dir else '(no --save-dir)'}"
                " to restore this layout's sharded state from")
        reader = checkpoint.Reader(folder)
    if joiners:
        _share(comm, cfg, reader)
    source = reader.folder if reader.folder != "memory" else \
        "the state every replica held" if lost.committed is not None else \
        "the committed state in the buddies' memory"
    took = time.time() - lost.detected
    names = ", ".join(map(str, gone)) or "?"
    note = (f"[hpcdist] rank {names} of {before} lost in step {lost.failed_step}; "
            f"{comm.size} ranks go on in this job, rebuilt in {took:.2f} s"
            + "".join(f"; {n}" for n in notes) + f"; resuming from {source}")
    _record(comm, cfg, lost, gone, reader.step, source)
    return comm, cfg, (datasets, (reader.folder, note, reader))


SEED = "the seed"          # where a recovery before the first committed step resumes from


def _from_the_seed(comm, cfg, lost, gone, before, notes, *, datasets):
    """A rank lost before any step was committed: the state to go on from is the initial
    one, which the seed makes on every rank again: what ``train`` starts from (no reader)."""
    source = "the initial state (no step was committed yet: the seed makes it again)"
    note = (f"[hpcdist] rank {', '.join(map(str, gone)) or '?'} of {before} lost in step "
            f"{lost.failed_step}; {comm.size} ranks go on in this job"
            + "".join(f"; {n}" for n in notes) + f"; starting again from {source}")
    _record(comm, cfg, lost, gone, 0, source)
    return datasets, (SEED, note, None)


def _record(comm, cfg, lost, gone, resumed_from: int, source: str) -> None:
    """The recovery's record in metrics.jsonl (rank 0), after the records of the committed
    steps the survivors go on from that the lost run had settled but not yet written (every
    survivor holds them alike)."""
    if comm.rank == 0 and cfg.out_dir:
        records = [r for r in getattr(lost, "records", []) if r["step"] <= resumed_from] + [
            {"event": "recovered", "lost": gone, "step": lost.failed_step,
             "resumed_from": resumed_from, "world": comm.size, "source": source,
             "detected": lost.detected, "recovered": time.time(),
             "batch_size": cfg.batch_size}]
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        also = sinks.sinks(cfg)                   # --tensorboard, --wandb: the same records
        for r in records if also is not None else ():
            also.add(r)


def _rebuild(world):
    """hpcdist's machinery over ``world`` (collective, in this order on every rank of it, the
    ranks that joined too): a watchdog, the agreement's communicator, a Communicator."""
    watchdog.restart(world)
    ulfm.enable(world)
    comm = Communicator(world)
    threads.configure(comm.local_size)         # the node's cores, over the ranks on it now
    return comm


def _json(comm, value=None):
    """Rank 0's JSON value on every rank (a length, then the bytes)."""
    raw = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8) if comm.rank == 0 \
        else None
    n = comm.bcast(np.array([raw.size if raw is not None else 0], dtype=np.int64))
    buf = raw.copy() if raw is not None else np.empty(int(n[0]), dtype=np.uint8)
    return json.loads(bytes(comm.bcast(buf)).decode())


def _share(comm, cfg, reader):
    """Rank 0 to the ranks that joined: the settings as they are now and the committed
    state (its arrays over MPI, or the checkpoint folder it is in); what they received."""
    head = _json(comm, {"cfg": dataclasses.asdict(cfg), "step": reader.step,
                        "folder": reader.folder, "scalars": reader.scalars,
                        "tensors": reader.tensors} if comm.rank == 0 else None)
    if head["folder"] != "memory":
        return head, checkpoint.Reader(head["folder"])
    arrays = {}
    for name in sorted(head["tensors"]):
        t = head["tensors"][name]
        buf = reader.tensor(name) if isinstance(reader, Snapshot) else \
            np.empty(t["shape"], dtype=t["dtype"])
        arrays[name] = comm.bcast(np.ascontiguousarray(buf))
    return head, Snapshot(head["step"], head["scalars"], arrays)


def join(train, prepare) -> int:
    """A process the survivors spawned (--respawn): join them, take the settings and the
    committed state from rank 0 over MPI, train on with them; the exit code."""
    comm = _rebuild(ulfm.join())
    mirror.restore(comm, None, [])                 # the survivors' mirror phase, without a say
    head, reader = _share(comm, None, None)
    cfg = TrainConfig(**head["cfg"])
    signals.checkpoint_on_signal(checkpoint=bool(cfg.save_dir))    # as main() decides it
    datasets, _ = prepare(dataclasses.replace(cfg, resume=False), comm)
    note = f"joined as rank {comm.rank} of {comm.size} at step {reader.step}"
    final = train_through_failures(train, cfg, comm, (datasets, (reader.folder, note, reader)))
    return 0 if final is not None else 1


def train_through_failures(train, cfg, comm, prepared):
    """``train(cfg, comm, prepared=...)``'s final metrics, going on in the job when a rank
    dies under --on-failure shrink; None after an error every rank printed alike."""
    while True:
        try:
            return train(cfg, comm, prepared=prepared)
        except ulfm.RankLost as lost:             # the survivors go on
            try:
                comm, cfg, prepared = recover(cfg, lost, prepared[0])
            except (ConfigError, checkpoint.CheckpointError) as e:
                if ulfm.rank() == 0:              # of the survivors
                    print(f"hpcdist.train: error: cannot go on after losing a rank: {e}",
                          file=sys.stderr)
                return None
        except checkpoint.CheckpointError as e:   # raised alike on every rank (agreed)
            if comm.rank == 0:
                print(f"hpcdist.train: error: {e}", file=sys.stderr)
            return None
        except report.Diverged as e:              # alike on every rank: the mean's
            if comm.rank == 0:
                kept = f"; {cfg.save_dir} holds no state of the diverged steps" \
                    if cfg.save_dir else ""
                print(f"hpcdist.train: error: {e}{kept}", file=sys.stderr)
            return None
