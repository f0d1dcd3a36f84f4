"""Tensor and the reverse-mode engine: an iterative topological sort plus a reverse walk.

A Tensor holds ``data`` (an xp array) and, once backward has run, ``grad`` (an xp array of the
same shape). Ops (autograd/ops/) build a result Tensor that remembers its parents and a closure
``backward(g) -> tuple of parent gradients``. ``Tensor.backward`` sorts the graph without
recursion (deep graphs are fine), walks it in reverse, sums gradients of reused nodes (a
closure marked ``adds_first`` is called ``backward(g, prior)`` with its first parent's sum so
far and adds it into its own: a norm's backward, the residual stream's), and frees the graph
as it goes. Leaves may carry hooks that fire once their gradient for this
backward pass is final; DDP starts its bucket allreduce from them.
"""
from __future__ import annotations

import contextlib

from ..device import backend, kernels
from . import memtrace
from .lazy_zero import overwrite, settle_grads

_grad_enabled = True
_pass = None            # the zero-bubble split's pass: None (whole backward), "I" or "W"


@contextlib.contextmanager
def no_grad():
    """Inside this block ops record no graph (inference, optimizer updates, evaluation)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = prev


def needs_grad(t) -> bool:
    """Whether an op's backward computes ``t``'s gradient now: ``t`` requires one, and the
    engine's pass is for its kind — the zero-bubble I pass computes every gradient but the
    weights' (leaf parameters), the W pass only theirs (``split_backward``)."""
    if _pass is None:
        return t.requires_grad
    weight = t.is_weight and t._backward is None
    return t.requires_grad and weight == (_pass == "W")


@contextlib.contextmanager
def _engine_pass(name):
    global _pass
    prev, _pass = _pass, name
    try:
        yield
    finally:
        _pass = prev


_split: list | None = None      # where split_backward collects the W pass's work


@contextlib.contextmanager
def split_backward(deferred: list):
    """``backward()`` inside computes only the gradients of non-leaf inputs (the zero-bubble
    I pass) and appends to ``deferred`` what the weights' gradients need; pass that list to
    ``weight_gradients`` later (the W pass)."""
    global _split
    prev, _split = _split, deferred
    try:
        yield
    finally:
        _split = prev


def is_grad_enabled() -> bool:
    return _grad_enabled


def _freed_graph(_g):
    raise RuntimeError("backward through a graph that was already freed: call "
                       "backward(retain_graph=True) the first time to backpropagate twice")


class Tensor:
    """An xp array plus what autograd needs. ``hd.tensor(array, requires_grad=True)``."""

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_hooks", "name",
                 "__weakref__")
    __array_priority__ = 100  # numpy_array * tensor -> Tensor.__rmul__, not an object array
    is_weight = False         # nn.Parameter: True (the zero-bubble W pass computes its gradient)

    def __init__(self, data, requires_grad: bool = False, dtype=None, name: str | None = None):
        xp = backend.xp()
        if isinstance(data, Tensor):
            data = data.data
        if dtype is None and not hasattr(data, "dtype"):
            # Python scalars and lists: floats become the default float dtype.
            arr = xp.asarray(data)
            if arr.dtype.kind == "f":
                arr = arr.astype(backend.default_float())
        else:
            arr = xp.asarray(data, dtype=dtype)
        if requires_grad and arr.dtype.kind not in "fc" and arr.dtype.name != "bfloat16":
            raise TypeError(f"only floating tensors can require gradients (got {arr.dtype})")
        self.data = arr
        self.grad = None
        self.requires_grad = requires_grad
        self._parents = ()
        self._backward = None
        self._hooks = None
        self.name = name

    @classmethod
    def _make(cls, data, parents, backward):
        """An op's result: records the graph only when some parent needs a gradient."""
        t = cls.__new__(cls)
        t.data = data
        t.grad = None
        t._hooks = None
        t.name = None
        if _grad_enabled and any(p.requires_grad for p in parents):
            t.requires_grad = True
            t._parents = parents
            t._backward = backward
        else:
            t.requires_grad = False
            t._parents = ()
            t._backward = None
        return t

    # ---- properties ------------------------------------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def is_leaf(self):
        return self._backward is None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        g = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{g})"

    def numpy(self):
        """A host NumPy copy of the data."""
        return backend.to_numpy(self.data)

    def item(self):
        return self.data.item()

    def detach(self) -> "Tensor":
        """The same data, cut from the graph."""
        return Tensor._make(self.data, (), None)

    # ---- hooks -----------------------------------------------------------------------------
    def register_grad_hook(self, fn):
        """Call ``fn(tensor)`` once this leaf's ``.grad`` is final in a backward pass.

        Returns a handle whose ``remove()`` unregisters the hook.
        """
        if not self.is_leaf:
            raise ValueError("gradient hooks fire on leaves (parameters) only")
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)
        hooks = self._hooks

        class _Handle:
            @staticmethod
            def remove():
                if fn in hooks:
                    hooks.remove(fn)
        return _Handle()

    # ---- the engine ------------------------------------------------------------------------
    def backward(self, grad=None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` that requires it (inside
        ``split_backward``: the zero-bubble I pass only)."""
        global _split, _depth
        defer_weights, _split = _split, None       # a backward nested in an op's runs whole
        memtrace.sample()                          # the graph is whole: what it holds
        _depth += 1
        try:
            with _engine_pass(None):
                self._run_backward(grad, retain_graph, defer_weights)
        finally:
            _split, _depth = defer_weights, _depth - 1
            if not _depth:
                settle_grads()

    def _run_backward(self, grad, retain_graph: bool, defer_weights) -> None:
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        xp = backend.array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError("backward() without a gradient needs a scalar output; "
                                   f"got shape {self.shape}")
            grad = xp.ones_like(self.data)
        elif isinstance(grad, Tensor):
            grad = grad.data

        # Count, for each node, how many consumers will send it a gradient; a node runs once
        # all of them have. A leaf is finalized (and its hooks fire) the moment its count
        # reaches zero, so the last layer's parameters are done first (DDP overlap needs that).
        if self._backward is None:       # backward() on a leaf itself
            _finalize_leaf(self, grad)
            return
        pending = _consumer_counts(self)
        grads = {id(self): grad}
        _running.append((pending, grads))
        try:
            self._drain(pending, grads, defer_weights, retain_graph)
        finally:
            _running.pop()

    def _drain(self, pending: dict, grads: dict, defer_weights, retain_graph: bool) -> None:
        """Run each node's backward once all its consumers have sent theirs, from this one."""
        accumulated = set()                  # leaves an op's backward added into directly
        ready = [self]
        while ready:
            node = ready.pop()
            g = grads.pop(id(node), None)
            if defer_weights is not None and g is not None:
                parent_grads = _input_gradients(node, g, defer_weights)
            elif g is not None and getattr(node._backward, "adds_first", False):
                # it adds its first parent's gradient so far into its own (one pass less)
                first = node._parents[0]
                prior = grads.pop(id(first), None) if first.requires_grad else None
                parent_grads = node._backward(g, prior)
            else:
                # No gradient arrived (every path carried None): still release the parents.
                parent_grads = node._backward(g) if g is not None else \
                    (None,) * len(node._parents)
            if not retain_graph:
                parents, node._backward, node._parents = node._parents, _freed_graph, ()
            else:
                parents = node._parents
            for p, pg in zip(parents, parent_grads):
                if not p.requires_grad:
                    continue
                key = id(p)
                if pg is ACCUMULATED:                 # the op added it into p.grad itself
                    accumulated.add(key)
                elif pg is not None:
                    prev = grads.get(key)
                    grads[key] = pg if prev is None else summed(prev, pg)
                pending[key] -= 1
                if pending[key]:
                    continue
                if p._backward is None:
                    _finalize_leaf(p, grads.pop(key, None), key in accumulated)
                else:
                    ready.append(p)


_running: list = []      # (pending, grads) of each backward() running, the innermost last


def sole_gradient(t) -> bool:
    """Whether the gradient the running op's backward returns for ``t`` is all that ``t``
    gets: no other consumer has sent one, and none is still to run (an op may then hand
    ``t``'s producer a gradient already taken through its next step: ops.linear's GELU)."""
    if not _running or _pass is not None:
        return False
    pending, grads = _running[-1]
    return pending.get(id(t)) == 1 and id(t) not in grads


def summed(a, b):
    """Two gradients of one tensor summed into a new array: on a device, one kernel that reads
    16 bytes a thread where both are of one shape and dtype (kernels.ADD), else xp's ``+``."""
    if backend.is_gpu_array(a) and a.shape == b.shape and a.dtype == b.dtype:
        return kernels.ADD(a, b)
    return a + b


def _input_gradients(node: Tensor, g, deferred: list):
    """The I pass: ``node``'s backward in the engine's I pass, so ops skip their weight
    gradients (``needs_grad``); what the W pass needs is appended to ``deferred``."""
    leaves = [p for p in node._parents if p.requires_grad and p._backward is None
              and p.is_weight]
    if not leaves:
        return node._backward(g)
    deferred.append((node._backward, node._parents, g))
    if len(leaves) == len(node._parents):        # nothing but weights: all of it is W
        return (None,) * len(node._parents)
    with _engine_pass("I"):
        grads = node._backward(g)
    # ops may return a weight's gradient anyway (it is cheap for some): the W pass owns it
    return tuple(None if any(p is q for q in leaves) else pg
                 for p, pg in zip(node._parents, grads))


def weight_gradients(deferred: list) -> None:
    """The W pass: the leaf (weight) gradients the I pass left in ``deferred``."""
    for fn, parents, g in deferred:
        with _engine_pass("W"):
            grads = fn(g)
        for p, pg in zip(parents, grads):
            if pg is ACCUMULATED and p.requires_grad and p.is_weight:
                _finalize_leaf(p, None, True)
            elif pg is not None and p.requires_grad and p.is_weight:
                _finalize_leaf(p, pg)
    deferred.clear()


def _consumer_counts(root: Tensor) -> dict:
    """id(node) -> number of edges from nodes that need gradients into it. No recursion."""
    counts = {id(root): 0}
    stack = [root]
    while stack:
        node = stack.pop()
        for p in node._parents:
            if not p.requires_grad:
                continue
            key = id(p)
            if key not in counts:
                counts[key] = 0
                stack.append(p)
            counts[key] += 1
    return counts


ACCUMULATED = object()   # an op's backward returns this for a leaf whose .grad it added into
_depth = 0               # backward() calls running (one nests in recompute's)


def _finalize_leaf(leaf: Tensor, g, accumulated: bool = False) -> None:
    """Add this pass's gradient into ``leaf.grad`` (in place: it may be a bucket view);
    ``accumulated``: ops of this pass already added theirs."""
    if g is None:
        if accumulated and leaf._hooks:
            for hook in leaf._hooks:
                hook(leaf)
        return
    if leaf.grad is None:
        leaf.grad = g.astype(leaf.data.dtype, copy=True)
    elif overwrite(leaf):
        leaf.grad[...] = g
    else:
        leaf.grad += g
    if leaf._hooks:
        for hook in leaf._hooks:
            hook(leaf)


def tensor(data, requires_grad: bool = False, dtype=None) -> Tensor:
    """Make a Tensor from an array, list or scalar (copied to the active device)."""
    return Tensor(data, requires_grad=requires_grad, dtype=dtype)


# Operator methods live in autograd/ops/ next to their backward; attached here so `a + b` works.
from . import ops as _ops

Tensor.__add__ = lambda a, b: _ops.add(a, b)
Tensor.__radd__ = lambda a, b: _ops.add(b, a)
Tensor.__sub__ = lambda a, b: _ops.sub(a, b)
Tensor.__rsub__ = lambda a, b: _ops.sub(b, a)
Tensor.__mul__ = lambda a, b: _ops.mul(a, b)
Tensor.__rmul__ = lambda a, b: _ops.mul(b, a)
Tensor.__truediv__ = lambda a, b: _ops.div(a, b)
Tensor.__rtruediv__ = lambda a, b: _ops.div(b, a)
Tensor.__neg__ = lambda a: _ops.neg(a)
Tensor.__pow__ = lambda a, b: _ops.pow(a, b)
Tensor.__rpow__ = lambda a, b: _ops.pow(b, a)
Tensor.__matmul__ = lambda a, b: _ops.matmul(a, b)
Tensor.__rmatmul__ = lambda a, b: _ops.matmul(b, a)
Tensor.__getitem__ = lambda a, idx: _ops.getitem(a, idx)
Tensor.exp = lambda a: _ops.exp(a)
Tensor.log = lambda a: _ops.log(a)
Tensor.sqrt = lambda a: _ops.sqrt(a)
Tensor.tanh = lambda a: _ops.tanh(a)
Tensor.relu = lambda a: _ops.relu(a)
Tensor.gelu = lambda a: _ops.gelu(a)
Tensor.sigmoid = lambda a: _ops.sigmoid(a)
Tensor.sum = lambda a, axis=None, keepdims=False: _ops.sum(a, axis, keepdims)
Tensor.mean = lambda a, axis=None, keepdims=False: _ops.mean(a, axis, keepdims)
Tensor.max = lambda a, axis=None, keepdims=False: _ops.max(a, axis, keepdims)
Tensor.reshape = lambda a, *shape: _ops.reshape(a, *shape)
Tensor.transpose = lambda a, *axes: _ops.transpose(a, *axes)
Tensor.permute = lambda a, *axes: _ops.transpose(a, *axes)
Tensor.T = property(lambda a: _ops.transpose(a))
Tensor.softmax = lambda a, axis=-1: _ops.softmax(a, axis)
Tensor.log_softmax = lambda a, axis=-1: _ops.log_softmax(a, axis)
Tensor.masked_fill = lambda a, mask, value: _ops.masked_fill(a, mask, value)
Tensor.split = lambda a, sizes, axis=0: _ops.split(a, sizes, axis)
