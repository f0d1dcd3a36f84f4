"""Named training state: what a strategy puts into a layout-free checkpoint, and how any
strategy takes it back (checkpoint.py stores it, reshard.py cuts it).

Every strategy keeps its parameters and optimizer state in flat arrays over this rank's
parameters (``DataParallelStrategy``: all of them; ``Zero``: the shard [lo, hi)). Each parameter
of the rank is a tensor-parallel cut of one tensor of the logical model (or the whole of it),
so the flat arrays split into pieces named ``param/<name>`` and ``opt.<kind>/<name>``. A
piece is written by one rank only: data-parallel replicas (without ZeRO), tensor-parallel
copies of replicated parameters and the last pipeline stage's copy of a tied embedding write
nothing.
"""
from __future__ import annotations

import numpy as np

from ..device import backend
from .. import checkpoint
from ..checkpoint import reshard
from ..optim import intersect
from .base import owned
from ..comm.arith import bounds_of
from ..host.layout import Layout
from ..nn.moe import balance_bias, load_balance_bias


def tensor_entries(model, mesh) -> list:
    """[(name, size, cut, logical shape, spec)] of this rank's parameters, in flat order."""
    tp = mesh.tp_comm if mesh is not None else None
    out = []
    for name, p, spec in model.named_specs():
        pad = () if spec is None or spec.multiple == 1 else (spec.multiple,)
        if spec is not None and spec.whole:               # whole on every rank, padded
            out.append((name, p.size, (spec.axis, 1, 1, 0, *pad) if pad else None,
                        spec.shape if pad else tuple(p.shape), spec))
        elif spec is None or tp is None or tp.size == 1:
            out.append((name, p.size, None, tuple(p.shape), spec))
        else:
            out.append((name, p.size, (spec.axis, spec.pieces, tp.size, tp.rank, *pad),
                        spec.shape, spec))
    return out


def pieces_to_save(strategy, copy: bool = True) -> list:
    """[(name, cut, logical shape, (a, b), host array)] this rank writes: copies, or with
    ``copy`` False (an --async-save, which copies them itself) views of the state on the
    CPU (a device's state is copied to the host either way)."""
    mesh = strategy.mesh
    if not strategy.holds_state():
        return []                                        # a replica: rank dp 0 writes
    entries = tensor_entries(strategy.model, mesh)
    lo, hi, arrays, _ = strategy.flat_state()
    out = []
    for (name, size, cut, shape, spec), (o, _), mine in zip(
            entries, bounds_of(l[1] for l in entries), owned(strategy.model, mesh)):
        if not mine:                 # replicated (tensor-parallel rank 0 writes), a tied copy
            continue
        s, e = intersect(o, o + size, lo, hi)
        if s >= e:
            continue
        for kind, arr in arrays.items():
            host = backend.to_numpy(arr[s - lo:e - lo])
            out.append((f"{kind}/{name}", cut, shape, (s - o, e - o),
                        host.copy() if copy else host))
    return out


def load_pieces(strategy, reader) -> None:
    """Fill this strategy's flat arrays from a checkpoint written by any layout."""
    lo, hi, arrays, _ = strategy.flat_state()
    kinds = sorted({n.split("/", 1)[0] for n in reader.tensors})
    for kind in kinds:                                   # optimizer state the run has not made yet
        if kind.startswith("opt.") and kind not in arrays:
            arrays[kind] = backend.xp().zeros(hi - lo, dtype=arrays["param"].dtype)
            strategy.add_optimizer_state(kind[len("opt."):], arrays[kind])
    # state this run keeps that the checkpoint has none of (DiLoCo's outer momentum in a
    # checkpoint of DDP) starts as the run made it
    arrays = {k: v for k, v in arrays.items() if k in kinds or not k.startswith("opt.outer_")}
    entries = tensor_entries(strategy.model, strategy.mesh)
    for (name, size, cut, shape, spec), (off, _) in zip(entries, bounds_of(l[1] for l in entries)):
        s, e = intersect(off, off + size, lo, hi)
        if s < e:
            for kind, arr in arrays.items():
                full = reader.tensor(f"{kind}/{name}")
                if tuple(full.shape) != tuple(shape):
                    raise ValueError(f"checkpoint tensor {kind}/{name} has shape "
                                     f"{tuple(full.shape)}, this model's is {tuple(shape)}")
                local = reshard.cut_local(full, cut).reshape(-1)
                arr[s - lo:e - lo] = backend.to_device(local[s - off:e - off]).astype(arr.dtype)
    strategy.loaded(int(reader.scalars["opt_step_count"]))


# ---- a run's checkpoint: the tensors above, plus scalars and each rank's own state ----------

def run_layout(cfg, world: int) -> dict:
    """How the run is laid out over ``world`` ranks: a checkpoint restores each rank's own
    state (its RNG, compression residuals) only into the same layout."""
    from .strategy import vocab_multiple
    pad = vocab_multiple(cfg)        # (the flat buffers' sizes: absent at 1, as before)
    if cfg.strategy == "ps":
        return {"world": world, "strategy": "ps", "servers": cfg.servers,
                **({"vocab_multiple": pad} if pad > 1 else {})}
    layout = {"world": world, "tp": cfg.tp, "pp": cfg.pp,
              "dp": Layout.of(cfg, world).replicas, "zero": cfg.zero,
              "virtual_stages": cfg.virtual_stages}
    if cfg.cp > 1:                   # (absent at 1: the layouts written before CP compare equal)
        layout["cp"] = cfg.cp
    if cfg.ep > 1:                   # (likewise)
        layout["ep"] = cfg.ep
    if cfg.strategy == "diloco":     # (absent otherwise, likewise)
        layout["diloco_group"] = cfg.group_size
    if cfg.shard_group == "node":
        layout["shard_size"] = cfg.shard_size
    if pad > 1:
        layout["vocab_multiple"] = pad
    return layout


def save_checkpoint(cfg, step, comm, strategy, sampler, vocabulary=None, *,
                    background=None) -> str:
    """The layout-free checkpoint of this run at ``step`` (collective); ``vocabulary``: the
    data's (kept whole, for sampling and export, and named in the meta). ``background``
    (checkpoint/background.py, --async-save): the save begun there, its file written off the
    step's path; the folder it will have is returned."""
    own = {"rng": checkpoint.json_array(backend.rng_state())}
    own.update(strategy.own_state())
    scalars = scalars_of(cfg, comm.size, strategy, (sampler.epoch, sampler.position),
                         sampler.batch_size * sampler.world)
    if vocabulary is not None:
        scalars["vocabulary"] = vocabulary
    model = getattr(strategy, "model", None)
    config = getattr(getattr(model, "full", model), "config", None)
    if config is not None:           # the positions the model takes (--init-from: its folder's)
        scalars["positions"] = int(config.block_size)
    meta = checkpoint.checkpoint_meta(cfg, vocabulary)
    if background is not None:
        background.start(cfg.save_dir, step, comm, pieces_to_save(strategy, copy=False), own,
                         meta=meta, scalars=scalars)
        return checkpoint.step_dir(cfg.save_dir, step)
    return checkpoint.save(cfg.save_dir, step, comm, pieces_to_save(strategy), own,
                           meta=meta, scalars=scalars)


def scalars_of(cfg, world: int, strategy, sampler: tuple, global_batch: int) -> dict:
    """A checkpoint's scalars: ``sampler`` (epoch, batches taken), the loss scaler, the
    optimizer's step count, the layout and schedule, MoE's balancing bias."""
    scalars = {"sampler": {"epoch": sampler[0], "position": sampler[1],
                           "global_batch": global_batch},
               "scaler": {k: float(v) for k, v in strategy.scaler.state_dict().items()},
               "opt_step_count": int(strategy.flat_state()[3]),
               "layout": run_layout(cfg, world),
               "schedule": schedule_of(cfg)}
    if balance_bias(strategy.model):                  # (the same on every rank)
        scalars["moe_bias"] = balance_bias(strategy.model)
    return scalars


def schedule_of(cfg) -> dict:
    """The learning-rate schedule's settings (a checkpoint keeps them: a resume that changes
    them is said)."""
    return {"steps": cfg.steps, "lr": cfg.lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup}


def schedule_change(saved: dict | None, cfg, step: int) -> str | None:
    """One line when this run's schedule differs from the checkpoint's from ``step`` on: each
    changed setting, old -> new, and the first step whose learning rate differs under both."""
    from .. import optim
    if not saved:
        return None
    now = schedule_of(cfg)
    old = {**now, **{k: v for k, v in saved.items() if k in now}}
    changed = [f"--{k.replace('_', '-')} {old[k]} -> {now[k]}" for k in now if old[k] != now[k]]
    if not changed:
        return None
    def lr(s, at):
        return optim.lr_at(at, s["lr"], s["warmup"], s["steps"], s["min_lr"])
    for at in sorted({int(a) for a in np.linspace(step + 1, max(cfg.steps, step + 1), 2000)}):
        a, b = lr(now, at), lr(old, at)
        if abs(a - b) > 1e-3 * max(abs(a), abs(b)):
            return (f"note: the learning-rate schedule changed ({', '.join(changed)}): step "
                    f"{at} runs at lr {a:.3g}, the checkpoint's schedule has {b:.3g} there"
                    + (" (the same before it)" if at > step + 1 else ""))
    return None


def restore_checkpoint(reader, cfg, comm, strategy, sampler) -> str:
    """Load a checkpoint written by any layout; returns what was done beyond the exact load."""
    load_pieces(strategy, reader)
    sc = reader.scalars
    if "moe_bias" in sc:
        load_balance_bias(strategy.model, sc["moe_bias"])
    strategy.scaler.load_state_dict(sc["scaler"])
    g_old, g_new = sc["sampler"]["global_batch"], sampler.batch_size * sampler.world
    samples = sc["sampler"]["position"] * g_old
    sampler.load_state_dict({"epoch": sc["sampler"]["epoch"], "position": samples // g_new})
    said = []
    if samples % g_new:
        said.append(f"the global batch changed ({g_old} -> {g_new}): continuing at sample "
                    f"{samples // g_new * g_new} of the epoch instead of {samples}")
    now = run_layout(cfg, comm.size)
    if sc["layout"] == now:                              # the same layout: exact, rank by rank
        own = reader.own(comm.rank)
        rng = checkpoint.from_json_array(own["rng"])
        if rng.get("kind") == backend.rng_state()["kind"]:
            backend.set_rng_state(rng)
        else:                     # a checkpoint from before hpcdist owned its dropout stream
            backend.seed(cfg.seed + 7919 * reader.step + 1000 * comm.rank)
            said.append("dropout streams reseeded from (seed, step, rank): the checkpoint "
                        "holds an older generator's state")
        strategy.load_own_state(own)
        return "; ".join(said)
    # Another layout. Dropout streams: each rank derives its own from (seed, step, its rank
    # in the new layout). Compression state: what its scheme says (on_new_layout).
    backend.seed(cfg.seed + 7919 * reader.step + 1000 * comm.rank)
    said.append(f"written by {sc['layout']}, resumed as {now}: "
                f"dropout streams reseeded from (seed, step, rank)")
    compression = strategy.compression()
    if compression is not None:                         # each scheme says what becomes of it
        same = all(now.get(k, 1) == sc["layout"].get(k, 1)   # the model cut and padded alike
                   for k in ("tp", "pp", "vocab_multiple"))
        note = compression.on_new_layout(reader, reader.step, same, strategy.dp_comm.size)
        if note:
            said.append(note)
    return "; ".join(said)
