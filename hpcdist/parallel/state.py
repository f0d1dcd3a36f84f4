"""Named training state: what a strategy puts into a layout-free checkpoint, and how any
strategy takes it back (checkpoint.py stores it, reshard.py cuts it).

Every strategy keeps its parameters and optimizer state in flat arrays over this rank's
parameters (``DataParallelStep``: all of them; ``Zero``: the shard [lo, hi)). Each parameter
of the rank is a tensor-parallel cut of one tensor of the logical model (or the whole of it),
so the flat arrays split into pieces named ``param/<name>`` and ``opt.<kind>/<name>``. A
piece is written by one rank only: data-parallel replicas (without ZeRO), tensor-parallel
copies of replicated parameters and the last pipeline stage's copy of a tied embedding write
nothing.
"""
from __future__ import annotations

from .. import backend, reshard


def tensor_layout(model, mesh) -> list:
    """[(name, size, cut, logical shape, spec)] of this rank's parameters, in flat order."""
    tp = mesh.tp_comm if mesh is not None else None
    full = getattr(model, "full", model)
    logical = getattr(full, "logical_shapes", {})
    specs = model.named_specs() if hasattr(model, "named_specs") else \
        [(n, p, None) for n, p in model.named_parameters()]
    out = []
    for name, p, spec in specs:
        if spec is None or tp is None or tp.size == 1:
            out.append((name, p.size, None, tuple(p.shape), spec))
        else:
            out.append((name, p.size, (spec[0], spec[1], tp.size, tp.rank), logical[name], spec))
    return out


def flat_state(step):
    """(lo, hi, {kind: flat array over [lo, hi)}, optimizer step count) of a strategy."""
    inner = getattr(step, "inner", step)                 # a pipeline wraps DDP or ZeRO
    opt = inner.opt
    if hasattr(inner, "mp"):                             # DataParallelStep: everything
        arrays = {"param": inner.mp.master.data}
        lo, hi = 0, inner.mp.master.data.size
    else:                                                # Zero: the shard
        arrays = {"param": inner.master}
        lo, hi = inner.lo, inner.hi
    arrays.update({f"opt.{k}": v for k, v in opt.state.items()})
    return lo, hi, arrays, opt.step_count


def pieces_to_save(step, cfg) -> list:
    """[(name, cut, logical shape, (a, b), host array)] this rank writes."""
    mesh = getattr(step, "mesh", None)
    coord = mesh.coord if mesh is not None else None
    if coord is not None and not cfg.zero and coord.dp > 0:
        return []                                        # a replica: rank dp 0 writes
    if coord is None and not cfg.zero and step.data_comm.rank > 0:
        return []
    layout = tensor_layout(step.model, mesh)
    lo, hi, arrays, _ = flat_state(step)
    entries, off = [], 0
    for name, size, cut, shape, spec in layout:
        entries.append((name, off, size, cut, shape, spec))
        off += size
    out = []
    for name, o, size, cut, shape, spec in entries:
        if spec is None and coord is not None and coord.tp > 0:
            continue                                     # replicated: tensor-parallel rank 0
        if cfg.pp > 1 and cfg.tie_weights and name == "wte.weight" and coord.pp == cfg.pp - 1:
            continue                                     # the head's copy of the tied table
        s, e = max(lo, o), min(hi, o + size)
        if s >= e:
            continue
        for kind, arr in arrays.items():
            out.append((f"{kind}/{name}", cut, shape, (s - o, e - o),
                        backend.to_numpy(arr[s - lo:e - lo]).copy()))
    return out


def load_pieces(step, reader) -> None:
    """Fill this strategy's flat arrays from a checkpoint written by any layout."""
    mesh = getattr(step, "mesh", None)
    lo, hi, arrays, _ = flat_state(step)
    inner = getattr(step, "inner", step)
    kinds = sorted({n.split("/", 1)[0] for n in reader.tensors})
    for kind in kinds:                                   # optimizer state the run has not made yet
        if kind.startswith("opt.") and kind not in arrays:
            arrays[kind] = backend.xp().zeros(hi - lo, dtype=arrays["param"].dtype)
            inner.opt.state[kind[len("opt."):]] = arrays[kind]
    off = 0
    for name, size, cut, shape, spec in tensor_layout(step.model, mesh):
        s, e = max(lo, off), min(hi, off + size)
        if s < e:
            for kind, arr in arrays.items():
                full = reader.tensor(f"{kind}/{name}")
                if tuple(full.shape) != tuple(shape):
                    raise ValueError(f"checkpoint tensor {kind}/{name} has shape "
                                     f"{tuple(full.shape)}, this model's is {tuple(shape)}")
                local = reshard.cut_local(full, cut).reshape(-1)
                arr[s - lo:e - lo] = backend.to_device(local[s - off:e - off]).astype(arr.dtype)
        off += size
    inner.opt.step_count = int(reader.scalars["opt_step_count"])
    if hasattr(inner, "mp"):
        inner.mp.copy_master_to_compute()
    else:
        inner._rebuild_parameters()
