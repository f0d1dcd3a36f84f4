"""The array ops: elementwise arithmetic and functions, matmul and the fused linear
layers, reductions, shapes (the package docstring says what an op is)."""
from __future__ import annotations

import builtins

from ...device import backend, fp8, kernels
from ..lazy_zero import stale, written
from ..tensor import ACCUMULATED, Tensor, needs_grad


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

def linear(x: Tensor, w: Tensor, b: Tensor | None = None,
           residual: Tensor | None = None, *, split: fp8.Split | None = None) -> Tensor:
    """``x @ w + b (+ residual)`` as one node: the bias (and a residual stream) added into
    the product in place, one fused pass on a GPU (kernels.BIAS_RESIDUAL); the bias's
    gradient one row sum, added straight into its buffer where it has one (COLSUM_ADD).
    x and the gradient are converted once (kernels.linear_operands: bf16 runs, fp8's values)
    for the products they enter; w where it is used (kept, it would hold ZeRO-3's gathered
    weights alive). ``split``: which operands are tensor-parallel shards (fp8's scales)."""
    if x.ndim < 2:
        y = matmul(x, w)
        y = y if b is None else add(y, b)
        return y if residual is None else add(y, residual)
    operand = kernels.linear_operands(split)
    xo = operand(x.data, "input")
    out = kernels.product(xo, operand(w.data, "weight"))
    if b is not None or residual is not None:
        kernels.BIAS_RESIDUAL(out, None if b is None else b.data,
                              None if residual is None else residual.data)
    k, m = w.shape

    def backward(g):
        gx = gw = gb = None
        go = operand(g, "gradient")
        if needs_grad(x):                   # (w read now: ZeRO-3 gathers it again)
            gx = kernels.product(go, operand(w.data, "weight").T)
        if needs_grad(w) or (b is not None and needs_grad(b)):
            g2 = g.reshape(-1, m)
            if needs_grad(w):
                gw = _weight_grad(xo.reshape(-1, k).T, go.reshape(-1, m), w)
            if b is not None and needs_grad(b):
                gb = _bias_grad(g2, b)
        grads = (gx, gw) if b is None else (gx, gw, gb)
        return grads if residual is None else grads + (g,)
    parents = (x, w) if b is None else (x, w, b)
    return Tensor._make(out, parents if residual is None else parents + (residual,), backward)


def linear_gelu(x: Tensor, w: Tensor, b: Tensor, *, split: fp8.Split | None = None) -> Tensor:
    """``gelu(x @ w + b)`` as one node: the bias and the GELU in one pass after the GEMM
    (kernels.BIAS_GELU), the GELU's backward in one more (GELU_BWD); ``split`` as linear's."""
    k, m = w.shape
    operand = kernels.linear_operands(split)
    xo = operand(x.data, "input")
    h = kernels.product(xo, operand(w.data, "weight"))
    out, t = kernels.BIAS_GELU(h, b.data)                 # h now holds x @ w + b

    def backward(g):
        gh = kernels.GELU_BWD(h, g, t)
        go = operand(gh, "gradient")
        gx = kernels.product(go, operand(w.data, "weight").T) if needs_grad(x) else None
        gw = _weight_grad(xo.reshape(-1, k).T, go.reshape(-1, m), w) if needs_grad(w) else None
        return gx, gw, _bias_grad(gh.reshape(-1, m), b) if needs_grad(b) else None
    return Tensor._make(out, (x, w, b), backward)


def grad_target(t: Tensor):
    """(the array an op's backward may write ``t``'s gradient into, True when it must
    overwrite: it holds the last step's), or (None, False): ``t`` is no leaf needing its
    gradient now, or has no buffer. The op then returns ``ACCUMULATED`` (after ``written``):
    no addition by the engine, one pass less a parameter."""
    if t._backward is None and t.grad is not None and needs_grad(t) and \
            t.grad.dtype == t.data.dtype:
        return t.grad, stale(t)
    return None, False


def grad_buffer(t: Tensor):
    """grad_target's array for an op that can only add into it (zeroed first if stale)."""
    into, stale = grad_target(t)
    if stale:
        into[...] = 0
        written(t)
    return into


def _weight_grad(xt, g2, w: Tensor):
    """``xt @ g2`` (two ``kernels.operand``s), w's gradient: added by the GEMM itself into w's
    gradient buffer where it has one and the device can (kernels.matmul_add: no product
    array, no addition by the engine), else returned."""
    into, stale = grad_target(w)
    if into is not None and kernels.matmul_add(xt, g2, into, overwrite=stale):
        written(w)
        return ACCUMULATED
    return kernels.product(xt, g2)


def _bias_grad(g2, b: Tensor):
    """The row sum of g2 (N, m): added straight into ``b``'s gradient buffer where it has one
    (one pass, and no addition by the engine), else returned."""
    into = grad_buffer(b)
    if into is None:
        return g2.sum(axis=0)
    kernels.COLSUM_ADD(g2, into)
    return ACCUMULATED


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
