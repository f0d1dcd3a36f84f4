"""The array ops: elementwise arithmetic and functions, matmul, reductions, shapes (the
package docstring says what an op is; the linear layers: linear.py)."""
from __future__ import annotations

import builtins

from ...device import backend, kernels
from ..tensor import Tensor, needs_grad


def _lift(x, like: Tensor | None = None) -> Tensor:
    """Constants (scalars, arrays) become grad-free Tensors of ``like``'s dtype."""
    if isinstance(x, Tensor):
        return x
    dtype = like.data.dtype if like is not None and like.data.dtype.kind == "f" else None
    return Tensor(backend.xp().asarray(x, dtype=dtype))


def _unbroadcast(g, shape):
    """Sum ``g`` down to ``shape`` (undo numpy broadcasting)."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1)
    g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _xp(t: Tensor):
    return backend.array_module(t.data)


# ---- elementwise arithmetic ------------------------------------------------------------------

def add(a, b) -> Tensor:
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)

    def backward(g):
        return _unbroadcast(g, a.shape), _unbroadcast(g, b.shape)
    return Tensor._make(a.data + b.data, (a, b), backward)


def sub(a, b) -> Tensor:
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)

    def backward(g):
        return _unbroadcast(g, a.shape), _unbroadcast(-g, b.shape)
    return Tensor._make(a.data - b.data, (a, b), backward)


def mul(a, b) -> Tensor:
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)

    def backward(g):
        return (_unbroadcast(g * b.data, a.shape) if needs_grad(a) else None,
                _unbroadcast(g * a.data, b.shape) if needs_grad(b) else None)
    return Tensor._make(a.data * b.data, (a, b), backward)


def div(a, b) -> Tensor:
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)

    def backward(g):
        ga = _unbroadcast(g / b.data, a.shape) if needs_grad(a) else None
        gb = _unbroadcast(-g * a.data / (b.data * b.data), b.shape) if needs_grad(b) else None
        return ga, gb
    return Tensor._make(a.data / b.data, (a, b), backward)


def neg(a: Tensor) -> Tensor:
    return Tensor._make(-a.data, (a,), lambda g: (-g,))


def pow(a, b) -> Tensor:
    """``a ** b``; b is usually a Python number, but a Tensor exponent is differentiable too."""
    a = _lift(a, b if isinstance(b, Tensor) else None)
    if not isinstance(b, Tensor):
        p = b
        out = a.data ** p

        def backward_const(g):
            return (g * p * a.data ** (p - 1),)
        return Tensor._make(out, (a,), backward_const)
    xp = _xp(a)
    out = a.data ** b.data

    def backward(g):
        ga = _unbroadcast(g * b.data * a.data ** (b.data - 1), a.shape) if needs_grad(a) else None
        gb = _unbroadcast(g * out * xp.log(a.data), b.shape) if needs_grad(b) else None
        return ga, gb
    return Tensor._make(out, (a, b), backward)


# ---- elementwise functions -------------------------------------------------------------------

def exp(a: Tensor) -> Tensor:
    out = _xp(a).exp(a.data)
    return Tensor._make(out, (a,), lambda g: (g * out,))


def log(a: Tensor) -> Tensor:
    return Tensor._make(_xp(a).log(a.data), (a,), lambda g: (g / a.data,))


def sqrt(a: Tensor) -> Tensor:
    out = _xp(a).sqrt(a.data)
    return Tensor._make(out, (a,), lambda g: (g * 0.5 / out,))


def tanh(a: Tensor) -> Tensor:
    out = _xp(a).tanh(a.data)
    return Tensor._make(out, (a,), lambda g: (g * (1 - out * out),))


def relu(a: Tensor) -> Tensor:
    mask = a.data > 0
    return Tensor._make(a.data * mask, (a,), lambda g: (g * mask,))


def sigmoid(a: Tensor) -> Tensor:
    xp = _xp(a)
    # 0.5*(1+tanh(x/2)) is sigmoid without overflow in exp for large |x|.
    out = 0.5 * (1 + xp.tanh(0.5 * a.data))
    return Tensor._make(out, (a,), lambda g: (g * out * (1 - out),))


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh approximation (GPT-2's; torch's ``gelu(approximate='tanh')``): one fused
    kernel each way on a GPU, its twin elsewhere (kernels.GELU_FWD / GELU_BWD, written in
    place: ~10 temporaries of the MLP's widest activation -> 3)."""
    out, t = kernels.GELU_FWD(a.data)
    return Tensor._make(out, (a,), lambda g: (kernels.GELU_BWD(a.data, g, t),))


# ---- matmul ----------------------------------------------------------------------------------

def matmul(a, b) -> Tensor:
    """Batched matmul with numpy's broadcasting rules; 1-D operands are promoted as numpy does."""
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)
    if a.ndim == 1:
        return reshape(matmul(reshape(a, 1, a.shape[0]), b), *(b.shape[:-2] + b.shape[-1:]))
    if b.ndim == 1:
        return reshape(matmul(a, reshape(b, b.shape[0], 1)), *a.shape[:-1])
    xp, mm = _xp(a), kernels.matmul
    out = mm(a.data, b.data)

    def backward(g):
        ga = gb = None
        if needs_grad(a):
            ga = _unbroadcast(mm(g, xp.swapaxes(b.data, -1, -2)), a.shape)
        if needs_grad(b):
            if b.ndim == 2 and a.ndim > 2:
                # (..., n, k) @ (k, m): fold the batch into one GEMM instead of summing after.
                k, m = b.shape
                gb = mm(a.data.reshape(-1, k).T, g.reshape(-1, m))
            else:
                gb = _unbroadcast(mm(xp.swapaxes(a.data, -1, -2), g), b.shape)
        return ga, gb
    return Tensor._make(out, (a, b), backward)


# ---- reductions ------------------------------------------------------------------------------

def _norm_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(ax % ndim for ax in axis)


def _expand_to(g, shape, axes, keepdims):
    """Re-insert reduced axes so ``g`` broadcasts against the input shape."""
    if not keepdims:
        g = g.reshape([1 if i in axes else n for i, n in enumerate(shape)])
    return g


def sum(a: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    xp = _xp(a)
    axes = _norm_axes(axis, a.ndim)
    out = a.data.sum(axis=axes, keepdims=keepdims)

    def backward(g):
        return (xp.broadcast_to(_expand_to(g, a.shape, axes, keepdims), a.shape),)
    return Tensor._make(out, (a,), backward)


def mean(a: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    xp = _xp(a)
    axes = _norm_axes(axis, a.ndim)
    count = 1
    for ax in axes:
        count *= a.shape[ax]
    out = a.data.mean(axis=axes, keepdims=keepdims)

    def backward(g):
        return (xp.broadcast_to(_expand_to(g, a.shape, axes, keepdims) / count, a.shape),)
    return Tensor._make(out, (a,), backward)


def max(a: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    """Maximum over axes; the gradient is shared equally among tied maxima."""
    axes = _norm_axes(axis, a.ndim)
    out = a.data.max(axis=axes, keepdims=keepdims)

    def backward(g):
        full = _expand_to(out, a.shape, axes, keepdims)
        mask = a.data == full
        share = mask / mask.sum(axis=axes, keepdims=True)
        return (_expand_to(g, a.shape, axes, keepdims) * share,)
    return Tensor._make(out, (a,), backward)


# ---- shape ops -------------------------------------------------------------------------------

def reshape(a: Tensor, *shape) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    in_shape = a.shape
    return Tensor._make(a.data.reshape(shape), (a,), lambda g: (g.reshape(in_shape),))


def transpose(a: Tensor, *axes) -> Tensor:
    """Permute axes (reverse them when none are given)."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    if not axes:
        axes = tuple(reversed(range(a.ndim)))
    inverse = tuple(sorted(range(len(axes)), key=lambda i: axes[i]))
    return Tensor._make(a.data.transpose(axes), (a,), lambda g: (g.transpose(inverse),))


def _has_array_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return builtins.any(not isinstance(i, (int, slice, type(None), type(Ellipsis)))
                        for i in items)


def getitem(a: Tensor, idx) -> Tensor:
    """Basic slicing and integer-array (advanced) indexing; repeated indices accumulate."""
    if isinstance(idx, Tensor):
        idx = idx.data
    if isinstance(idx, tuple):
        idx = tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    xp = _xp(a)
    out = a.data[idx]
    advanced = _has_array_index(idx)

    def backward(g):
        full = xp.zeros_like(a.data)
        if advanced:
            backend.scatter_add(full, idx, g)
        else:
            full[idx] = g
        return (full,)
    return Tensor._make(out, (a,), backward)


def concat(tensors, axis: int = 0) -> Tensor:
    tensors = [_lift(t) for t in tensors]
    xp = _xp(tensors[0])
    axis = axis % tensors[0].ndim
    out = xp.concatenate([t.data for t in tensors], axis=axis)
    bounds = []
    start = 0
    for t in tensors:
        bounds.append((start, start + t.shape[axis]))
        start += t.shape[axis]

    def backward(g):
        sl = [slice(None)] * g.ndim
        grads = []
        for lo, hi in bounds:
            sl[axis] = slice(lo, hi)
            grads.append(g[tuple(sl)])
        return tuple(grads)
    return Tensor._make(out, tuple(tensors), backward)


def split(a: Tensor, sizes, axis: int = 0) -> tuple:
    """Split into pieces of the given sizes (or ``sizes`` equal pieces when it is an int)."""
    n = a.shape[axis]
    if isinstance(sizes, int):
        if n % sizes:
            raise ValueError(f"cannot split axis of length {n} into {sizes} equal parts")
        sizes = [n // sizes] * sizes
    if builtins.sum(sizes) != n:
        raise ValueError(f"split sizes {list(sizes)} do not add up to the axis length {n}")
    pieces, start = [], 0
    sl = [slice(None)] * a.ndim
    for s in sizes:
        sl[axis % a.ndim] = slice(start, start + s)
        pieces.append(getitem(a, tuple(sl)))
        start += s
    return tuple(pieces)
