"""Module and Parameter: the containers that layers and models are built from."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..device import backend
from ..autograd.tensor import Tensor


class Shard(NamedTuple):
    """How a parameter is held against the one logical model's tensor: cut along ``axis`` as
    ``pieces`` blocks side by side each split over the tensor-parallel group — a count of
    equal blocks (q, k, v of multi-head attention: 3), or their widths where they differ
    (grouped-query attention's q | k | v) —; ``shape``: the logical tensor's. ``multiple``:
    the cut axis rounded up to a multiple of pieces x tp x ``multiple`` (a vocabulary padded
    so that each rank's part is GEMM-aligned: rows past the logical ones are zeros, never
    read); ``whole``: held whole on every rank, only padded (no tensor-parallel cut)."""
    axis: int
    pieces: int | tuple
    shape: tuple
    multiple: int = 1
    whole: bool = False


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pad_axis(array, axis: int, length: int):
    """``array`` with zeros appended along ``axis`` up to ``length`` (itself if already)."""
    if array.shape[axis] == length:
        return array
    xp = backend.array_module(array)
    shape = list(array.shape)
    shape[axis] = length
    out = xp.zeros(shape, dtype=array.dtype)
    idx = [slice(None)] * array.ndim
    idx[axis] = slice(0, array.shape[axis])
    out[tuple(idx)] = array
    return out


def logical_view(array, spec: "Shard"):
    """The logical rows of a whole, padded parameter (a view)."""
    idx = [slice(None)] * array.ndim
    idx[spec.axis] = slice(0, spec.shape[spec.axis])
    return array[tuple(idx)]


class Parameter(Tensor):
    """A leaf Tensor that a Module owns and an optimizer updates."""

    __slots__ = ()
    is_weight = True

    def __init__(self, data, name: str | None = None):
        super().__init__(data, requires_grad=True, name=name)


_init_rng = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Seed parameter init (host NumPy, so CPU and GPU runs start from identical weights)
    and the device generator behind dropout."""
    global _init_rng
    _init_rng = np.random.default_rng(seed)
    backend.seed(seed)


def init_normal(shape, std: float) -> np.ndarray:
    return _init_rng.normal(0.0, std, size=shape).astype(backend.default_float())


def init_uniform(shape, bound: float) -> np.ndarray:
    return _init_rng.uniform(-bound, bound, size=shape).astype(backend.default_float())


class Module:
    """Base class: attributes that are Parameters or Modules are found by ``named_parameters``."""

    training = True
    shard_spec: dict = {}       # parameter name -> how a parallel version cut it (parallel/tp)
    placements: dict = {}       # parameter name -> what it is applied to (nn/placement.py)

    def __call__(self, *args, **kwargs):
        around = self.__dict__.get("_around")
        if around is not None:
            return around(self.forward, *args, **kwargs)
        return self.forward(*args, **kwargs)

    def wrap_call(self, around) -> None:
        """Call ``around(forward, *args, **kwargs)`` in place of ``forward`` (a module hook:
        ZeRO-3 gathers a block's parameters there, and frees them after)."""
        self._around = around

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def _children(self):
        for name, value in vars(self).items():
            if isinstance(value, (Parameter, Module)):
                yield name, value

    def named_parameters(self, prefix: str = ""):
        """(name, Parameter) pairs in definition order; a shared (tied) Parameter appears once."""
        out, seen = [], set()

        def visit(mod, pre):
            for name, value in mod._children():
                if isinstance(value, Parameter):
                    if id(value) not in seen:
                        seen.add(id(value))
                        out.append((pre + name, value))
                else:
                    visit(value, pre + name + ".")
        visit(self, prefix)
        return out


    def named_specs(self):
        """(name, Parameter, spec) in parameter order: ``spec`` says how the module holding
        the parameter cut it (its ``shard_spec``; None: whole)."""
        spec = {}
        for m in self.modules():
            for name, s in m.shard_spec.items():
                if vars(m).get(name) is not None:
                    spec[id(vars(m)[name])] = s
        return [(n, p, spec.get(id(p))) for n, p in self.named_parameters()]

    def declared_kinds(self) -> dict:
        """id(parameter) -> the placement kind its module declares (nn/placement.py), over
        every module; a parameter no module declares is absent."""
        out = {}
        for m in self.modules():
            for name, kind in m.placements.items():
                if vars(m).get(name) is not None:
                    out.setdefault(id(vars(m)[name]), kind)
        return out

    def copies(self) -> set:
        """ids of the parameters held here as copies of another rank's (a pipeline's tied
        head on its last stage): not this rank's to count or to save. None here."""
        return set()

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def modules(self):
        """This module and every submodule, depth first."""
        yield self
        for _, value in self._children():
            if isinstance(value, Module):
                yield from value.modules()

    def named_modules(self, prefix: str = ""):
        """(path with a trailing dot, module) of this module and every submodule, depth
        first (this one: ``prefix``)."""
        yield prefix, self
        for name, value in self._children():
            if isinstance(value, Module):
                yield from value.named_modules(prefix + name + ".")

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def logical_parameters(self) -> int:
        """Parameters of the one logical model these stand for: a tensor-parallel shard as
        its whole tensor, a padded table without its padding."""
        return sum(math.prod(spec.shape) if spec else p.size for _, p, spec in self.named_specs())

    def train(self, mode: bool = True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self) -> dict:
        """name -> host NumPy copy of each parameter; a padded one (a vocabulary rounded up
        to an aligned size) at its logical shape."""
        return {name: backend.to_numpy(logical_view(p.data, spec) if _whole(spec) else
                                       p.data).copy()
                for name, p, spec in self.named_specs()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy values into the existing parameter arrays (views into flat buffers stay views);
        a padded parameter takes its logical shape (the padding is left zero) or its own."""
        padded = {name: spec for name, _, spec in self.named_specs() if _whole(spec)}
        params = dict(self.named_parameters())
        if strict:
            missing = sorted(set(params) - set(state))
            unexpected = sorted(set(state) - set(params))
            if missing or unexpected:
                raise KeyError(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, value in state.items():
            if name not in params:
                continue
            p = params[name]
            spec = padded.get(name)
            if spec is not None and tuple(value.shape) == tuple(spec.shape):
                logical_view(p.data, spec)[...] = backend.to_device(value, dtype=p.data.dtype)
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(value.shape)}, "
                                 f"the parameter has {tuple(p.shape)}")
            p.data[...] = backend.to_device(value, dtype=p.data.dtype)


class ModuleList(Module):
    """A list of modules whose parameters are registered as ``0.``, ``1.``, ..."""

    def __init__(self, modules):
        for i, m in enumerate(modules):
            setattr(self, str(i), m)
        self._n = len(modules)

    def __iter__(self):
        return (getattr(self, str(i)) for i in range(self._n))

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        return getattr(self, str(range(self._n)[i]))

    def __setitem__(self, i, module):
        setattr(self, str(range(self._n)[i]), module)


def _whole(spec) -> bool:
    return spec is not None and spec.whole and spec.multiple > 1
