"""Differentiable ops. Each builds its result and, right beside it, the backward closure.

A backward closure takes the gradient of the result and returns one gradient per parent
(None where a parent needs none). Broadcasting is undone by ``_unbroadcast``. Only xp array
math is used here, so every op runs on NumPy and CuPy alike.
"""
from __future__ import annotations

import builtins
import math

from . import backend
from .tensor import Tensor, needs_grad


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


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh approximation (GPT-2's; torch's ``gelu(approximate='tanh')``).

    Written with in-place ops: the textbook expression makes ~10 temporaries of the MLP's
    widest activation, forward and backward; this makes 3 (1.9 -> ~0.9 ms a step on the
    default GPT)."""
    xp = _xp(a)
    x = a.data
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= _GELU_C
    xp.tanh(t, out=t)                          # t = tanh(c (x + 0.044715 x^3))
    out = t + 1.0
    out *= x
    out *= 0.5

    def backward(g):
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2)
        d = x * x
        d *= 3 * 0.044715 * _GELU_C
        d += _GELU_C
        d *= x
        s = t * t
        xp.subtract(1.0, s, out=s)
        s *= d
        s += t
        s += 1.0
        s *= 0.5
        s *= g
        return (s,)
    return Tensor._make(out, (a,), backward)


# ---- matmul ----------------------------------------------------------------------------------

def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x @ w + b`` as one node: the bias is added into the product in place and its
    gradient is one row sum (as ``matmul`` then ``add`` it costs a temporary, a graph node
    and a sum over two axes)."""
    if x.ndim < 2:
        y = matmul(x, w)
        return y if b is None else add(y, b)
    mm = backend.matmul
    out = mm(x.data, w.data)
    if b is not None:
        out += b.data
    k, m = w.shape

    def backward(g):
        gx = gw = gb = None
        if needs_grad(x):
            gx = mm(g, w.data.T)
        if needs_grad(w) or (b is not None and needs_grad(b)):
            g2 = g.reshape(-1, m)
            if needs_grad(w):
                gw = mm(x.data.reshape(-1, k).T, g2)
            if b is not None and needs_grad(b):
                gb = g2.sum(axis=0)
        return (gx, gw) if b is None else (gx, gw, gb)
    return Tensor._make(out, (x, w) if b is None else (x, w, b), backward)


def matmul(a, b) -> Tensor:
    """Batched matmul with numpy's broadcasting rules; 1-D operands are promoted as numpy does."""
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)
    if a.ndim == 1:
        return reshape(matmul(reshape(a, 1, a.shape[0]), b), *(b.shape[:-2] + b.shape[-1:]))
    if b.ndim == 1:
        return reshape(matmul(a, reshape(b, b.shape[0], 1)), *a.shape[:-1])
    xp, mm = _xp(a), backend.matmul
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


# ---- neural-net ops --------------------------------------------------------------------------

def embedding(weight: Tensor, idx) -> Tensor:
    """Rows of ``weight`` (V, C) picked by integer ``idx`` (any shape) -> idx.shape + (C,)."""
    if isinstance(idx, Tensor):
        idx = idx.data
    xp = _xp(weight)
    out = weight.data[idx]

    def backward(g):
        gw = xp.zeros_like(weight.data)
        backend.scatter_add(gw, idx.reshape(-1), g.reshape(-1, weight.shape[1]))
        return (gw,)
    return Tensor._make(out, (weight,), backward)


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    xp = _xp(a)
    e = xp.exp(a.data - a.data.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)

    def backward(g):
        return (out * (g - (g * out).sum(axis=axis, keepdims=True)),)
    return Tensor._make(out, (a,), backward)


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    xp = _xp(a)
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))

    def backward(g):
        return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)
    return Tensor._make(out, (a,), backward)


def cross_entropy(logits: Tensor, targets, ignore_index: int = -100) -> Tensor:
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (..., V).

    Fused and numerically stable (log-sum-exp); positions whose target is ``ignore_index``
    contribute nothing and are left out of the mean.
    """
    if isinstance(targets, Tensor):
        targets = targets.data
    xp = _xp(logits)
    V = logits.shape[-1]
    z = logits.data.reshape(-1, V)
    t = xp.asarray(targets).reshape(-1)          # host targets go to the logits' device
    valid = t != ignore_index
    count = builtins.max(int(valid.sum()), 1)
    safe_t = xp.where(valid, t, 0)
    shifted = z - z.max(axis=1, keepdims=True)
    lse = xp.log(xp.exp(shifted).sum(axis=1))
    rows = xp.arange(z.shape[0])
    nll = (lse - shifted[rows, safe_t]) * valid
    out = nll.sum() / count

    def backward(g):
        p = xp.exp(shifted - lse[:, None])
        p[rows, safe_t] -= 1
        p *= (valid * (g / count))[:, None].astype(p.dtype)
        return (p.reshape(logits.shape),)
    return Tensor._make(out.astype(z.dtype), (logits,), backward)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``.
    (Means as sums times 1/C, and in-place ops: NumPy's ``mean`` costs a Python layer per
    call, and each temporary is a pass over the activations. 2-byte floats are normalized
    in float32 and rounded back.)"""
    xp = _xp(x)
    dt = x.data.dtype
    low = dt.itemsize < 4 and dt.kind in "fV"
    f32 = (lambda a: a.astype(xp.float32)) if low else (lambda a: a)
    w = f32(weight.data) if weight is not None else None
    inv_c = 1.0 / x.shape[-1]
    xd = f32(x.data)
    xc = xd - xd.sum(axis=-1, keepdims=True) * inv_c
    var = xp.einsum("...c,...c->...", xc, xc)[..., None] if xc.ndim <= 3 else \
        (xc * xc).sum(axis=-1, keepdims=True)
    var *= inv_c
    var += eps
    rstd = xp.sqrt(var, out=var)
    xp.reciprocal(rstd, out=rstd)
    xhat = xc
    xhat *= rstd                                # xc is not needed again: normalize in place
    out = xhat * w if w is not None else xhat.copy()
    if bias is not None:
        out += f32(bias.data)
    if low:
        out = out.astype(dt)

    affine = tuple(t for t in (weight, bias) if t is not None)

    def backward(g):
        g = f32(g)
        # the weight read again, not kept: under ZeRO-3 it is a view of its block's gathered
        # parameters, which the forward has released (and the backward gathers anew)
        w = f32(weight.data) if weight is not None else None
        gxhat = g * w if w is not None else g.copy()
        # d xhat / d x, folded: rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat))
        m1 = gxhat.sum(axis=-1, keepdims=True)
        m1 *= inv_c
        m2 = xp.einsum("...c,...c->...", gxhat, xhat)[..., None] if xhat.ndim <= 3 else \
            (gxhat * xhat).sum(axis=-1, keepdims=True)
        m2 *= inv_c
        gx = gxhat
        gx -= m1
        gx -= xhat * m2
        gx *= rstd
        grads = [gx.astype(dt) if low else gx]
        flat_g = g.reshape(-1, g.shape[-1])
        if weight is not None:
            grads.append(xp.einsum("nc,nc->c", flat_g, xhat.reshape(-1, g.shape[-1]))
                         .astype(weight.data.dtype, copy=False)
                         if needs_grad(weight) else None)
        if bias is not None:
            grads.append(flat_g.sum(axis=0).astype(bias.data.dtype, copy=False)
                         if needs_grad(bias) else None)
        return tuple(grads)
    return Tensor._make(out, (x,) + affine, backward)


def dropout(a: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (train only)."""
    if not training or p == 0.0:
        return a
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = backend.rng().keep_mask(a.shape, p)
    scale = (keep / (1.0 - p)).astype(a.data.dtype)
    return Tensor._make(a.data * scale, (a,), lambda g: (g * scale,))


def where(cond, a, b) -> Tensor:
    """Elementwise ``a`` where ``cond`` else ``b`` (cond is a boolean array, not differentiated)."""
    if isinstance(cond, Tensor):
        cond = cond.data
    a = _lift(a, b if isinstance(b, Tensor) else None)
    b = _lift(b, a)
    xp = _xp(a)
    cond = xp.asarray(cond)                  # a host condition goes to the data's device
    out = xp.where(cond, a.data, b.data)

    def backward(g):
        zero = xp.zeros((), dtype=g.dtype)
        return (_unbroadcast(xp.where(cond, g, zero), a.shape) if needs_grad(a) else None,
                _unbroadcast(xp.where(cond, zero, g), b.shape) if needs_grad(b) else None)
    return Tensor._make(out, (a, b), backward)


def masked_fill(a: Tensor, mask, value: float) -> Tensor:
    """``value`` where ``mask`` is True (e.g. -inf above the diagonal for causal attention)."""
    if isinstance(mask, Tensor):
        mask = mask.data
    xp = _xp(a)
    mask = xp.asarray(mask)                  # a host mask goes to the data's device
    out = xp.where(mask, xp.asarray(value, dtype=a.data.dtype), a.data)
    zero = xp.zeros((), dtype=a.data.dtype)
    return Tensor._make(out, (a,), lambda g: (_unbroadcast(xp.where(mask, zero, g), a.shape),))
