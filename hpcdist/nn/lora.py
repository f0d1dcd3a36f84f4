"""LoRA (Hu et al. 2021): low-rank adapters on a frozen base, as Hugging Face PEFT makes them.

A targeted linear computes ``x W + b + s (drop(x) A) B``: A (in, r) Kaiming-uniform as PEFT
draws it, B (r, out) zero, s = alpha / r (rsLoRA: alpha / sqrt(r)). The rest of the model is
frozen (``freeze``): ``Frozen`` tensors, not Parameters, so no gradient is computed for them
and nothing that trains (optimizer, DDP buckets, ZeRO shards, gradient norm, masters,
checkpoints) sees them. Targets are roles (q, k, v, o, gate, up, down, experts) read off the
family's Hugging Face names: a fused q | k | v layer carries one A and one B per targeted
piece, side by side, each exactly PEFT's adapter on that module. Placements: ``Adapter``."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..autograd import ops
from ..autograd.tensor import Tensor
from ..device import backend
from .frozen import Frozen
from .module import Module, Parameter, Shard, init_uniform
from .placement import SHARDED, SPLIT

ROLES = ("q", "k", "v", "o", "gate", "up", "down", "experts")


@dataclass(frozen=True)
class LoraSpec:
    """``rank`` r, ``alpha``, ``dropout`` on the adapters' input, the ``targets`` (roles),
    ``rslora``: the scale alpha / sqrt(r) (Kalajdzievski 2023) in place of alpha / r."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = ("q", "k", "v", "o")
    rslora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in ROLES]
        if bad or not self.targets:
            raise ValueError(f"--lora-targets {','.join(self.targets)}: the roles are "
                             f"{', '.join(ROLES)} or all-linear")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def targets_of(text: str) -> tuple:
    """``--lora-targets``'s roles: "q,v", "all-linear" (every block's linears)."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    return ROLES if names == ("all-linear",) else names


def roles_of(module: str) -> frozenset:
    """The roles of a Hugging Face module path ("model.layers.0.self_attn.q_proj"): none for
    a router or a head."""
    last = module.rsplit(".", 1)[-1]
    if ".experts." in module:
        return frozenset({"experts"})
    named = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
             "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "c_fc": "up"}
    if last in named:
        return frozenset({named[last]})
    if last == "c_attn":                          # GPT-2: q | k | v one module
        return frozenset({"q", "k", "v"})
    if last == "c_proj":
        return frozenset({"o" if ".attn." in module else "down"})
    return frozenset()


@dataclass(frozen=True)
class Site:
    """A linear of the model LoRA can adapt: our module ``path``, the Hugging Face module of
    each piece of its output side by side (``modules``) and their widths."""
    path: str
    modules: tuple
    widths: tuple


def sites(family, cfg, model) -> list:
    """Every block linear of ``model`` (family ``family``, config ``cfg``), from the
    family's Hugging Face table."""
    from .family import resolve
    out = []
    for r in family.hf.table(cfg):
        if not (r.ours.startswith("blocks.") and r.ours.endswith(".weight")):
            continue
        path = r.ours[:-len(".weight")]
        modules = tuple(t[:-len(".weight")] for t in r.theirs)
        if not any(roles_of(m) for m in modules):
            continue
        layer = resolve(model, path)[2]
        cut = layer.shard_spec.get("weight")
        width = int(cut.shape[1]) if cut is not None else int(layer.weight.shape[1])
        widths = tuple(int(w) for w in r.pieces) if r.pieces else (width,)
        out.append(Site(path, modules, widths))
    return out


def chosen(site: Site, targets) -> list:
    """The indices of ``site``'s pieces the ``targets`` adapt; a piece whose module has
    several roles (GPT-2's c_attn) is adapted when all are targets, and a part of them is
    refused in one line."""
    out = []
    for i, m in enumerate(site.modules):
        roles = roles_of(m)
        hit = roles & set(targets)
        if hit and hit != roles:
            raise ValueError(f"--lora-targets {','.join(targets)}: {m} computes "
                             f"{', '.join(sorted(roles))} in one module; target them together")
        if hit:
            out.append(i)
    return out


class Adapter(Module):
    """The low-rank update of one linear layer: for each targeted piece of its output
    (``widths``, at columns ``starts``), ``s (drop(x) A_j) B_j``; A = [A_1 | ...] and
    B = [B_1 | ...]. ``mode``: "plain" (a Linear: both lie as the layer, ``over``), "column"
    or "row" (its tensor-parallel kind; ``tp``, ``rank``: the group's size, this rank).
    Placements (nn/placement.py): on a column-parallel layer A sees the whole input but only
    this rank's columns' gradient (SPLIT) and B is cut as the weight's columns (SHARDED); on
    a row-parallel one A is cut as the weight's rows (SHARDED) and B, fed this rank's partial
    product, gets a partial gradient (SPLIT), its output joining the layer's reduction."""

    def __init__(self, spec: LoraSpec, in_features: int, out_local: int, pieces: list, *,
                 mode: str = "plain", over: str = "hidden", tp: int = 1, rank: int = 0,
                 theirs: tuple = ()):
        """``pieces``: (start, width) of each targeted piece in the logical output;
        ``theirs``: the Hugging Face module of each (PEFT's names)."""
        from .layers import Dropout
        r, t = spec.rank, len(pieces)
        self.scale, self.r = spec.scale, r
        self.drop = Dropout(spec.dropout)
        # PEFT: kaiming_uniform_(a=sqrt(5)) on lora_A (r, in): bound 1/sqrt(in), the logical
        # input's; each piece's A drawn as one (r, in) matrix
        A = np.concatenate([init_uniform((r, in_features), 1.0 / math.sqrt(in_features)).T
                            for _ in pieces], axis=1)
        if mode == "row":
            part = in_features // tp
            A = A[rank * part:(rank + 1) * part]
            self.shard_spec = {"A": Shard(0, 1, (in_features, t * r))}
        widths = [w // tp if mode == "column" else w for _, w in pieces]
        starts = [s // tp if mode == "column" else s for s, _ in pieces]
        self.A = Parameter(np.ascontiguousarray(A))
        self.B = Parameter(np.zeros((r, sum(widths)), dtype=backend.default_float()))
        if mode == "column":
            self.shard_spec = {"B": Shard(1, _pieces([w for _, w in pieces]),
                                          (r, sum(w for _, w in pieces)))}
        self.placements = {"A": {"column": SPLIT, "row": SHARDED}.get(mode, over),
                           "B": {"column": SHARDED, "row": SPLIT}.get(mode, over)}
        self.widths, self.starts, self.out = widths, starts, out_local
        self.mode, self.tp, self.tp_rank = mode, tp, rank
        self.theirs = tuple(theirs)
        self.logical = (in_features, tuple(w for _, w in pieces))   # (in, the pieces' widths)

    def load_logical(self, A, B) -> None:
        """Take the logical (whole) A and B: this rank's rows of A (row-parallel) or its
        columns of each piece of B (column-parallel)."""
        A, B = np.asarray(A), np.asarray(B)
        if self.mode == "row":
            part = A.shape[0] // self.tp
            A = A[self.tp_rank * part:(self.tp_rank + 1) * part]
        if self.mode == "column":
            cols, at = [], 0
            for width in self.logical[1]:
                part = width // self.tp
                cols.append(B[:, at + self.tp_rank * part:at + (self.tp_rank + 1) * part])
                at += width
            B = np.concatenate(cols, axis=1)
        for p, value in ((self.A, A), (self.B, B)):
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"an adapter of shape {tuple(p.shape)} given "
                                 f"{tuple(value.shape)}")
            p.data[...] = backend.to_device(value, dtype=p.data.dtype)

    def forward(self, x: Tensor) -> Tensor:
        u = ops.linear(self.drop(x), self.A) * self.scale            # (.., pieces x r)
        r, at, parts, cols = self.r, 0, [], 0
        for j, (start, width) in enumerate(zip(self.starts, self.widths)):
            uj = u if len(self.widths) == 1 else u[..., j * r:(j + 1) * r]
            bj = self.B if len(self.widths) == 1 else self.B[:, cols:cols + width]
            if start > at:
                parts.append(_zeros(x, u, start - at))
            parts.append(ops.linear(uj, bj))
            at, cols = start + width, cols + width
        if at < self.out:
            parts.append(_zeros(x, u, self.out - at))
        return parts[0] if len(parts) == 1 else ops.concat(parts, axis=-1)


def _pieces(widths):
    return len(widths) if len(set(widths)) == 1 else tuple(widths)


def _zeros(x: Tensor, u: Tensor, width: int) -> Tensor:
    xp = backend.array_module(u.data)
    return Tensor(xp.zeros(x.shape[:-1] + (width,), dtype=u.data.dtype))


def attach(model, family, cfg, spec: LoraSpec) -> list:
    """Put an Adapter on every targeted linear of ``model`` (tensor-parallel layers
    included); returns the adapted paths. No target in the model is a ValueError."""
    from .family import resolve
    done = []
    for site in sites(family, cfg, model):
        picked = chosen(site, spec.targets)
        if not picked:
            continue
        layer = resolve(model, site.path)[2]
        at = np.cumsum((0,) + site.widths)
        pieces = [(int(at[i]), int(site.widths[i])) for i in picked]
        mode = getattr(layer, "tp_kind", "plain")      # (parallel/tp/layers.py: its cut)
        tp, rank = (layer.comm.size, layer.comm.rank) if mode != "plain" else (1, 0)
        n_in = layer.weight.shape[0] * (tp if mode == "row" else 1)
        over = layer.placements.get("weight", "hidden")
        layer.lora = Adapter(spec, n_in, layer.weight.shape[1], pieces, mode=mode, over=over,
                             tp=tp, rank=rank, theirs=tuple(site.modules[i] for i in picked))
        done.append(site.path)
    if not done:
        raise ValueError(f"--lora-targets {','.join(spec.targets)} names no linear layer of "
                         f"this {family.title} model")
    return done


def apply(model, family, cfg, spec: LoraSpec, *, tensors: dict | None = None,
          where: str = "", dtype=None, nf4: bool = False) -> list:
    """LoRA on ``model``: its adapters attached (``attach``), set from PEFT's ``tensors``
    where given (``where``: their folder), and everything else frozen (in ``dtype``); with
    ``nf4``, every block linear's weight held in 4-bit NormalFloat (QLoRA: nn/nf4.py)."""
    from .family import resolve
    paths = attach(model, family, cfg, spec)
    if tensors is not None:
        values = from_peft(model, tensors, where)
        for path, a in adapters(model):
            a.load_logical(values[path + ".lora.A"], values[path + ".lora.B"])
    packed = {id(resolve(model, site.path)[2].weight) for site in sites(family, cfg, model)} \
        if nf4 else set()
    freeze(model, dtype, packed)
    return paths


def freeze(model, dtype=None, packed=frozenset()) -> int:
    """Every parameter of ``model`` outside its Adapters a Frozen tensor (``dtype``: stored
    in it, the compute precision's); those whose ids are in ``packed`` held in NF4 instead
    (nn/nf4.py, dequantised in ``dtype``); a tied one stays one tensor. Returns how many."""
    from .nf4 import NF4
    made = {}
    keep = {id(p) for m in model.modules() if isinstance(m, Adapter) for p in (m.A, m.B)}
    for m in model.modules():
        if isinstance(m, Adapter):
            continue
        for name, value in list(vars(m).items()):
            if isinstance(value, Parameter) and id(value) not in keep:
                if id(value) not in made:
                    made[id(value)] = NF4(value.data, dtype or value.data.dtype) \
                        if id(value) in packed else \
                        Frozen(value.data if dtype is None else value.data.astype(dtype))
                setattr(m, name, made[id(value)])
    return len(made)


def frozen(model) -> list:
    """(path, Frozen) of ``model``'s frozen tensors, each once."""
    out, seen = [], set()
    for path, m in model.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, Frozen) and id(value) not in seen:
                seen.add(id(value))
                out.append((path + name, value))
    return out


def adapters(model) -> list:
    """(path of the adapted layer, its Adapter) in model order."""
    return [(path[:-1], m.lora) for path, m in model.named_modules()
            if isinstance(vars(m).get("lora"), Adapter)]


PREFIX = "base_model.model."          # PEFT's names: the wrapped model's, under this


def to_peft(model, values: dict) -> dict:
    """PEFT's tensors (``...q_proj.lora_A.weight`` (r, in), ``lora_B.weight`` (out, r)) of
    the logical adapter values ``values`` (our name -> array: ``blocks.0.attn.qkv.lora.A``)."""
    out = {}
    for path, a in adapters(model):
        A, B = values[path + ".lora.A"], values[path + ".lora.B"]
        at = 0
        for j, (module, width) in enumerate(zip(a.theirs, a.logical[1])):
            out[PREFIX + module + ".lora_A.weight"] = np.ascontiguousarray(
                A[:, j * a.r:(j + 1) * a.r].T)
            out[PREFIX + module + ".lora_B.weight"] = np.ascontiguousarray(
                B[:, at:at + width].T)
            at += width
    return out


def from_peft(model, tensors: dict, where: str) -> dict:
    """Our logical adapter values from PEFT's tensors (``where``: the folder, for the line
    naming a missing or misshapen one); a tensor no adapter of the model takes is refused."""
    out, used = {}, set()
    for path, a in adapters(model):
        As, Bs = [], []
        n_in, widths = a.logical
        for module, width in zip(a.theirs, widths):
            names = (PREFIX + module + ".lora_A.weight", PREFIX + module + ".lora_B.weight")
            for n in names:
                if n not in tensors:
                    raise ValueError(f"{where} has no {n}")
            lA, lB = (np.asarray(tensors[n]) for n in names)
            if lA.shape != (a.r, n_in) or lB.shape != (width, a.r):
                raise ValueError(f"{where}: {module} has lora_A {lA.shape} and lora_B "
                                 f"{lB.shape}; this model's takes ({a.r}, {n_in}) and "
                                 f"({width}, {a.r})")
            As.append(lA.T)
            Bs.append(lB.T)
            used.update(names)
        out[path + ".lora.A"] = np.ascontiguousarray(np.concatenate(As, axis=1))
        out[path + ".lora.B"] = np.ascontiguousarray(np.concatenate(Bs, axis=1))
    left = sorted(set(tensors) - used)
    if left:
        raise ValueError(f"{where}: {left[0]} (and {len(left) - 1} more) is no adapter this "
                         "model makes (its --lora-targets, or another model)" if len(left) > 1
                         else f"{where}: {left[0]} is no adapter this model makes")
    return out


def peft_roles(tensors: dict) -> tuple:
    """The roles a PEFT adapter file adapts (read off its tensors' module names)."""
    roles = set()
    for name in tensors:
        module = name[len(PREFIX):].rsplit(".lora_", 1)[0] if name.startswith(PREFIX) else name
        roles |= roles_of(module)
    return tuple(r for r in ROLES if r in roles)
