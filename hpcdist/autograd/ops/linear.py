"""The linear layers as single nodes: ``x @ w + b (+ residual)`` and ``gelu(x @ w + b)``, their
operands as the GEMMs take them (bf16, fp8's values or codes: kernels.linear_operands), and the
parameters' gradients written straight into their buffers where they have them (a weight's by
cuBLAS with beta = 1, a bias's by a row sum fused where it can be) — no addition by the
engine, one pass less a parameter."""
from __future__ import annotations

from ...device import fp8, kernels
from ..lazy_zero import fresh, stale, written
from ..tensor import ACCUMULATED, Tensor, needs_grad, sole_gradient
from .core import add, matmul


def linear(x: Tensor, w: Tensor, b: Tensor | None = None,
           residual: Tensor | None = None, *, split: fp8.Split | None = None,
           later: bool = False) -> Tensor:
    """``x @ w + b (+ residual)`` as one node: the bias (and a residual stream) added into
    the product in place, one fused pass on a GPU (kernels.BIAS_RESIDUAL); the bias's
    gradient one row sum, added straight into its buffer where it has one (COLSUM_ADD).
    x and the gradient are converted once (kernels.linear_operands: bf16, fp8's values or codes)
    for the products they enter; w where it is used (kept, it would hold ZeRO-3's gathered
    weights alive). ``split``: which operands are tensor-parallel shards (fp8's scales).
    ``later``: the bias and residual are left for the next op to add (``linear_norm``)."""
    if x.ndim < 2:
        y = matmul(x, w)
        y = y if b is None else add(y, b)
        return y if residual is None else add(y, residual)
    operand = kernels.linear_operands(split, x.data, w.data)
    xo = operand(x.data, "input")
    k, m = w.shape
    if later:
        out = kernels.product(xo, operand(w.data, "weight"))
    else:
        out = _product_and_epilogue(xo, operand(w.data, "weight"), b, residual)
    gelu = getattr(x._backward, "gelu", None)      # (x = gelu(h): its backward may be ours)

    def backward(g):
        gx = gw = gb = None
        go = operand(g, "gradient")
        if needs_grad(x):                   # (w read now: ZeRO-3 gathers it again)
            wt = operand(w.data, "weight", transposed=True)
            gx = _through_gelu(go, wt, gelu) if gelu is not None and sole_gradient(x) \
                else None
            gx = kernels.product(go, wt) if gx is None else gx
        if needs_grad(w) or (b is not None and needs_grad(b)):
            g2 = g.reshape(-1, m)
            if needs_grad(w) and b is not None and go is g and \
                    _weight_bias_grads(xo.reshape(-1, k).T, go.reshape(-1, m), w, b):
                gw = gb = ACCUMULATED
            elif needs_grad(w):
                gw = _weight_grad(xo.reshape(-1, k).T, go.reshape(-1, m), w)
            if b is not None and needs_grad(b) and gb is None:
                gb = _bias_grad(g2, b)
        grads = (gx, gw) if b is None else (gx, gw, gb)
        return grads if residual is None else grads + (g,)
    parents = (x, w) if b is None else (x, w, b)
    return Tensor._make(out, parents if residual is None else parents + (residual,), backward)


def _product_and_epilogue(xo, wo, b: Tensor | None, residual: Tensor | None):
    """``xo @ wo + b (+ residual)``: the bias and residual in the GEMM's epilogue where
    cuBLASLt takes them (kernels.bias_product), else added in one pass after it."""
    m = wo.shape[1]
    if b is not None and xo.flags.c_contiguous:
        out = kernels.bias_product(xo.reshape(-1, xo.shape[-1]), wo, b.data,
                                   None if residual is None else residual.data.reshape(-1, m))
        if out is not None:
            return out.reshape(xo.shape[:-1] + (m,))
    out = kernels.product(xo, wo)
    if b is not None or residual is not None:
        kernels.BIAS_RESIDUAL(out, None if b is None else b.data,
                              None if residual is None else residual.data)
    return out


def _through_gelu(go, wt, gelu: dict):
    """The gradient of ``h`` for x = gelu(h) (a ``linear_gelu``'s output whose gradient this
    op's is all of): ``(go @ wt) * gelu'(h)`` by one GEMM that also writes the GELU's bias's
    gradient (kernels.gelu_grad_product), or None where it cannot (the bias's buffer holds
    some of this step's, another dtype, no cuBLASLt). The GELU's backward then takes its
    ``g`` as h's gradient (``gelu["taken"]``)."""
    h, b = gelu["h"], gelu["b"]
    into, _ = grad_target(b)
    if into is None or not fresh(b) or go.dtype != h.dtype or not go.flags.c_contiguous:
        return None
    gh = kernels.gelu_grad_product(go.reshape(-1, go.shape[-1]), wt,
                                   h.reshape(-1, h.shape[-1]), into)
    if gh is None:
        return None
    written(b)
    gelu["taken"] = True
    return gh.reshape(h.shape)


def linear_norm(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, norm, *,
                split: fp8.Split | None = None) -> tuple:
    """(``linear(x, w, b, residual)``, ``norm`` of it) — the residual stream after a
    projection and the next block part's normed input — with the bias, the residual and the
    norm in one pass after the GEMM: ``norm(y, fuse=(bias, residual))`` (a LayerNorm's or
    RMSNorm's module) adds them into y in its kernel. Two nodes, as the ops apart make."""
    if x.ndim < 2:
        out = linear(x, w, b, residual, split=split)
        return out, norm(out)
    y = linear(x, w, b, residual, split=split, later=True)
    return y, norm(y, fuse=(None if b is None else b.data,
                            None if residual is None else residual.data))


def linear_gelu(x: Tensor, w: Tensor, b: Tensor, *, split: fp8.Split | None = None) -> Tensor:
    """``gelu(x @ w + b)`` as one node: the bias and the GELU in the GEMM's epilogue
    (kernels.gelu_product) or in one pass after it (BIAS_GELU); the GELU's backward with the
    bias's gradient in one more (GELU_BWD_COLSUM, where the bias has its buffer), or done by
    the next layer's input-gradient GEMM (``_through_gelu``); ``split`` as linear's."""
    k, m = w.shape
    operand = kernels.linear_operands(split, x.data, w.data)
    xo = operand(x.data, "input")
    done = kernels.gelu_product(xo.reshape(-1, k), operand(w.data, "weight"), b.data) \
        if xo.flags.c_contiguous else None                # (the bias and GELU in the GEMM)
    if done is not None:
        (out, h), t = (d.reshape(x.shape[:-1] + (m,)) for d in done), None
    else:
        h = kernels.product(xo, operand(w.data, "weight"))
        out, t = kernels.BIAS_GELU(h, b.data)             # h now holds x @ w + b
    state = {"h": h, "b": b, "taken": False}

    def backward(g):
        if state["taken"]:       # g is h's gradient already, and b's gradient is written
            state["taken"] = False
            gh, gb = g, ACCUMULATED
        else:
            gh, gb = _gelu_backward(h, g, t, b)
        go = operand(gh, "gradient")
        gx = kernels.product(go, operand(w.data, "weight", transposed=True)) \
            if needs_grad(x) else None
        gw = _weight_grad(xo.reshape(-1, k).T, go.reshape(-1, m), w) if needs_grad(w) else None
        return gx, gw, gb
    backward.gelu = state                # (what the next linear's backward may take over)
    return Tensor._make(out, (x, w, b), backward)


def _gelu_backward(h, g, t, b: Tensor):
    """(h's gradient, b's: ACCUMULATED where it went into its buffer) of gelu(h), h = ... + b."""
    into = grad_buffer(b) if needs_grad(b) else None
    if into is not None and into.dtype == h.dtype:        # the bias's gradient in the pass
        return kernels.GELU_BWD_COLSUM(h, g, t, into), ACCUMULATED
    gh = kernels.GELU_BWD(h, g, t)
    return gh, _bias_grad(gh.reshape(-1, h.shape[-1]), b) if needs_grad(b) else None


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
    if into is not None:
        written(t)                       # (added into from here: no epilogue overwrites it)
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


def _weight_bias_grads(xt, g2, w: Tensor, b: Tensor) -> bool:
    """w's and b's gradients by one GEMM into their buffers (kernels.weight_bias_grads: b's
    row sum as the GEMM's epilogue), where both have a buffer and b's holds the last step's
    or was zeroed since any write (the epilogue writes it, it cannot add); False: not done."""
    into, stale_w = grad_target(w)
    vector, _ = grad_target(b)
    if into is None or vector is None or not (fresh(b) and needs_grad(b)) or \
            not kernels.weight_bias_grads(xt, g2, into, vector, overwrite=stale_w):
        return False
    written(w)
    written(b)
    return True


def _bias_grad(g2, b: Tensor):
    """The row sum of g2 (N, m): added straight into ``b``'s gradient buffer where it has one
    (one pass, and no addition by the engine), else returned."""
    into = grad_buffer(b)
    if into is None:
        return g2.sum(axis=0)
    kernels.COLSUM_ADD(g2, into)
    return ACCUMULATED
