"""Differentiable ops. Each builds its result and, right beside it, the backward closure.

A backward closure takes the gradient of the result and returns one gradient per parent
(None where a parent needs none). Broadcasting is undone by ``_unbroadcast``. Only xp array
math is used here, so every op runs on NumPy and CuPy alike.
"""
from __future__ import annotations

import builtins

from . import backend, kernels
from .tensor import ACCUMULATED, Tensor, grad_buffer, needs_grad


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
           residual: Tensor | None = None) -> Tensor:
    """``x @ w + b (+ residual)`` as one node: the bias (and a residual stream) added into
    the product in place, one fused pass on a GPU (kernels.BIAS_RESIDUAL); the bias's
    gradient one row sum, added straight into its buffer where it has one (COLSUM_ADD)."""
    if x.ndim < 2:
        y = matmul(x, w)
        y = y if b is None else add(y, b)
        return y if residual is None else add(y, residual)
    mm = backend.matmul
    out = mm(x.data, w.data)
    if b is not None or residual is not None:
        kernels.BIAS_RESIDUAL(out, None if b is None else b.data,
                              None if residual is None else residual.data)
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
                gb = _bias_grad(g2, b)
        grads = (gx, gw) if b is None else (gx, gw, gb)
        return grads if residual is None else grads + (g,)
    parents = (x, w) if b is None else (x, w, b)
    return Tensor._make(out, parents if residual is None else parents + (residual,), backward)


def linear_gelu(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``gelu(x @ w + b)`` as one node: the bias and the GELU in one pass after the GEMM
    (kernels.BIAS_GELU), the GELU's backward in one more (GELU_BWD)."""
    mm, (k, m) = backend.matmul, w.shape
    h = mm(x.data, w.data)
    out, t = kernels.BIAS_GELU(h, b.data)                 # h now holds x @ w + b

    def backward(g):
        gh = kernels.GELU_BWD(h, g, t)
        gx = mm(gh, w.data.T) if needs_grad(x) else None
        g2 = gh.reshape(-1, m)
        gw = mm(x.data.reshape(-1, k).T, g2) if needs_grad(w) else None
        return gx, gw, _bias_grad(g2, b) if needs_grad(b) else None
    return Tensor._make(out, (x, w, b), backward)


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
        into = grad_buffer(weight)                # added straight into its buffer, if any
        gw = xp.zeros_like(weight.data) if into is None else into
        backend.scatter_add(gw, idx.reshape(-1), g.reshape(-1, weight.shape[1]))
        return (gw if into is None else ACCUMULATED,)
    return Tensor._make(out, (weight,), backward)


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    xp = _xp(a)
    e = xp.exp(a.data - a.data.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)

    def backward(g):
        return (out * (g - (g * out).sum(axis=axis, keepdims=True)),)
    return Tensor._make(out, (a,), backward)


def causal_softmax(a: Tensor, scale: float, past: int = 0) -> Tensor:
    """Attention's ``softmax(scale * a)`` over the last axis, query i (axis -2, after ``past``
    cached ones) seeing keys 0..past+i: scale, mask and softmax as one fused kernel each way
    (kernels.SOFTMAX_CAUSAL_FWD / _BWD)."""
    out = kernels.SOFTMAX_CAUSAL_FWD(a.data, scale, past)
    return Tensor._make(out, (a,), lambda g: (kernels.SOFTMAX_CAUSAL_BWD(g, out, scale),))


def fused_attention(qkv: Tensor, n_head: int) -> Tensor:
    """Causal self-attention straight from the fused projection qkv (B, T, 3C) -> (B, T, C):
    scores, mask, softmax and the weighted sum as one kernel on a GPU, the gradient dqkv as
    one more (kernels.ATTENTION_FWD / _BWD); no dropout on the probabilities, no KV cache
    (nn.gpt.attention takes the op-by-op path for those)."""
    scale = 1.0 / (qkv.shape[-1] // 3 // n_head) ** 0.5
    y, lse, att = kernels.ATTENTION_FWD(qkv.data, n_head, scale)
    return Tensor._make(y, (qkv,), lambda g: (
        kernels.ATTENTION_BWD(qkv.data, y, g, lse, n_head, scale, att),))


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    xp = _xp(a)
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))

    def backward(g):
        return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)
    return Tensor._make(out, (a,), backward)


def cross_entropy(logits: Tensor, targets, ignore_index: int = -100) -> Tensor:
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (..., V).

    Fused and numerically stable (log-sum-exp per row, kernels.CROSS_ENTROPY_FWD); positions
    whose target is ``ignore_index`` contribute nothing and are left out of the mean; the
    gradient softmax - onehot in one pass (CROSS_ENTROPY_BWD).
    """
    if isinstance(targets, Tensor):
        targets = targets.data
    xp = _xp(logits)
    V = logits.shape[-1]
    z = logits.data.reshape(-1, V)
    t = xp.asarray(targets).reshape(-1)          # host targets go to the logits' device
    count = builtins.max(int((t != ignore_index).sum()), 1)
    nll, lse = kernels.CROSS_ENTROPY_FWD(z, t, ignore_index)
    out = nll.sum() / count

    def backward(g):
        weight = (g / count).astype(z.dtype)
        return (kernels.CROSS_ENTROPY_BWD(z, t, lse, ignore_index, weight)
                .reshape(logits.shape),)
    return Tensor._make(out.astype(z.dtype), (logits,), backward)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``: one fused
    kernel each way (kernels.LAYERNORM_FWD / _BWD; the twin in place, means as sums times
    1/C: NumPy's ``mean`` costs a Python layer per call). 2-byte floats are normalized in
    float32 and rounded back."""
    xp = _xp(x)
    dt = x.data.dtype
    low = dt.itemsize < 4 and dt.kind in "fV"
    f32 = (lambda a: a.astype(xp.float32)) if low else (lambda a: a)
    C = x.shape[-1]
    ones = lambda: xp.ones(C, dtype=xp.float32 if low else dt)      # noqa: E731
    zeros = lambda: xp.zeros(C, dtype=xp.float32 if low else dt)    # noqa: E731
    w = f32(weight.data) if weight is not None else ones()
    b = f32(bias.data) if bias is not None else zeros()
    xd = f32(x.data)
    out, mean, rstd, xhat = kernels.LAYERNORM_FWD(xd, w, b, eps)
    if low:
        out = out.astype(dt)
    affine = tuple(t for t in (weight, bias) if t is not None)

    def backward(g):
        # the weight read again, not kept: under ZeRO-3 it is a view of its block's gathered
        # parameters, which the forward has released (and the backward gathers anew)
        w = f32(weight.data) if weight is not None else ones()
        # the weight's and bias's gradients go straight into their buffers where they can
        gw_into = grad_buffer(weight) if weight is not None and not low else None
        gb_into = grad_buffer(bias) if bias is not None and not low else None
        gx, gw, gb = kernels.LAYERNORM_BWD(f32(g), xd, w, mean, rstd, xhat, gw_into, gb_into)
        grads = [gx.astype(dt) if low else gx]
        for t, grad, into in ((weight, gw, gw_into), (bias, gb, gb_into)):
            if t is not None:
                grads.append(None if not needs_grad(t) else ACCUMULATED if into is not None
                             else grad.astype(t.data.dtype, copy=False))
        return tuple(grads)
    return Tensor._make(out, (x,) + affine, backward)


def dropout(a: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (train only)."""
    if not training or p == 0.0:
        return a
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = backend.rng().keep_mask(a.shape, p, _xp(a))
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
