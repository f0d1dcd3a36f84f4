"""The neural-net ops: embedding, softmax and its causal and fused-attention forms,
log-softmax and cross-entropy, LayerNorm, dropout, where and masked_fill, a dtype cast, the
mixture of experts' permutation and combination."""
from __future__ import annotations

import numpy as np

from ...device import backend, kernels
from ..tensor import ACCUMULATED, Tensor, needs_grad, summed
from .core import _lift, _unbroadcast, _xp
from .linear import _weight_grad, grad_buffer


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


def attend(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T``: scores of x (..., C) against every row of a table w (V, C) — a head tied
    to the embedding — as one node: w's gradient ``g^T x`` goes into its buffer inside the
    GEMM where it can (``_weight_grad``), not through a transposed (V, C) array added with
    strides (3.5 ms of a GPT 6x384 step on 2 threads)."""
    V, C = w.shape
    xo = kernels.operand(x.data)
    out = kernels.product(xo, kernels.operand(w.data).T)

    def backward(g):
        go = kernels.operand(g)
        gx = kernels.product(go, kernels.operand(w.data)) if needs_grad(x) else None
        gw = _weight_grad(go.reshape(-1, V).T, xo.reshape(-1, C), w) \
            if needs_grad(w) else None
        return gx, gw
    return Tensor._make(out, (x, w), backward)


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


def fused_attention(qkv: Tensor, n_head: int, n_kv_head: int | None = None, scores=None,
                    sinks: Tensor | None = None) -> Tensor:
    """Causal self-attention straight from the fused projection qkv (B, T, (nh + 2 nkv) hs)
    -> (B, T, nh hs), ``n_kv_head`` key/value heads (default ``n_head``; fewer: grouped-query
    attention, each shared by n_head / n_kv_head query heads): tiled (flash) attention, one
    kernel forward and three backward on a GPU (kernels.attention_fwd / _bwd); no dropout on
    the probabilities, no KV cache (nn.gpt.attention takes the op-by-op path for those).
    ``scores`` (kernels.attention_kinds.Scores): a layer's scale, soft-cap and window;
    ``sinks`` (n_head,): its learned sink logits, with their own gradient."""
    n_kv_head = n_kv_head or n_head
    if (scores is None or scores == kernels.attention_kinds.PLAIN) and sinks is None:
        scale = 1.0 / kernels.flash.head_size(qkv.shape[-1], n_head, n_kv_head) ** 0.5
        y, lse, saved = kernels.attention_fwd(qkv.data, n_head, n_kv_head, scale)
        return Tensor._make(y, (qkv,), lambda g: (
            kernels.attention_bwd(qkv.data, y, g, lse, n_head, n_kv_head, scale, saved),))
    scores = scores or kernels.attention_kinds.PLAIN
    s = None if sinks is None else sinks.data
    y, lse, _ = kernels.attention.kinded_attention_fwd(qkv.data, n_head, n_kv_head, scores, s)
    if sinks is None:
        return Tensor._make(y, (qkv,), lambda g: kernels.attention.kinded_attention_bwd(
            qkv.data, y, g, lse, n_head, n_kv_head, scores)[:1])
    return Tensor._make(y, (qkv, sinks), lambda g: kernels.attention.kinded_attention_bwd(
        qkv.data, y, g, lse, n_head, n_kv_head, scores, s))


def softcap(a: Tensor, cap: float) -> Tensor:
    """cap tanh(a / cap): logits soft-capped (Gemma 2's final logits), bounded by +-cap and
    the identity near 0; the gradient 1 - tanh^2."""
    xp = _xp(a)
    t = xp.tanh(a.data / a.data.dtype.type(cap))
    return Tensor._make(t * t.dtype.type(cap), (a,), lambda g: (g * (1 - t * t),))


def log_softmax(a: Tensor, axis: int = -1) -> Tensor:
    xp = _xp(a)
    shifted = a.data - a.data.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))

    def backward(g):
        return (g - xp.exp(out) * g.sum(axis=axis, keepdims=True),)
    return Tensor._make(out, (a,), backward)


def cross_entropy(logits: Tensor, targets, ignore_index: int = -100,
                  vocab: int | None = None) -> Tensor:
    """Mean negative log-likelihood of integer ``targets`` under ``logits`` (..., V).

    Fused and numerically stable (log-sum-exp per row, kernels.CROSS_ENTROPY_FWD); positions
    whose target is ``ignore_index`` contribute nothing and are left out of the mean; the
    gradient softmax - onehot in one pass (CROSS_ENTROPY_BWD). ``vocab``: only the first
    ``vocab`` columns are the vocabulary (a head padded to an aligned width): the rest is
    left out of the softmax and gets a zero gradient, with no copy of the logits. bf16
    and fp16 logits give a float32 loss, summed and counted in float32 (PyTorch's autocast
    runs the loss in float32 too): a bf16 count is exact only to 256, an fp16 one to 2,048,
    and an fp16 sum overflows past 65,504 (6,000 tokens at GPT-2's first loss, 10.8).
    """
    if isinstance(targets, Tensor):
        targets = targets.data
    xp = _xp(logits)
    V = logits.shape[-1]
    vocab = None if vocab is None or vocab >= V else int(vocab)
    z = logits.data.reshape(-1, V)
    acc = np.float32 if z.dtype.itemsize < 4 else z.dtype          # (bf16, fp16)
    # host targets go to the logits' device; counted there with the loss (no device read)
    t = targets.reshape(-1) if backend.is_gpu_array(targets) else \
        xp.asarray(targets).reshape(-1)
    nll, lse = kernels.CROSS_ENTROPY_FWD(z, t, ignore_index, vocab)
    out, per = kernels.CROSS_ENTROPY_MEAN(nll.astype(acc, copy=False), t, ignore_index)

    def backward(g):                  # (the weight of each scored position: g / their count)
        return (kernels.CROSS_ENTROPY_BWD(z, t, lse, ignore_index, g * per, vocab)
                .reshape(logits.shape),)
    return Tensor._make(out, (logits,), backward)


def norm_prior(prior, x):
    """``prior`` — the gradient a norm's input has from its other consumers so far (the
    engine's ``adds_first``) — where the norm's backward kernel can add it into its own
    (x's shape and dtype), else None (the backward adds it after: ``with_prior``)."""
    if prior is not None and prior.shape == x.shape and prior.dtype == x.dtype:
        return prior
    return None


def fused_epilogue(fuse, x, low: bool) -> bool:
    """Whether a norm's kernel adds the projection's bias and residual (``fuse``) into x
    itself: the arrays all of x's dtype and the norm computing in it; else they are added
    here, in their own pass, and False."""
    if fuse is None:
        return False
    given = [a for a in fuse if a is not None]
    if not low and x.flags.c_contiguous and all(a.dtype == x.dtype for a in given):
        return True
    kernels.BIAS_RESIDUAL(x, *fuse)
    return False


def with_prior(gx, prior, added):
    """gx plus ``prior`` unless the kernel ``added`` it."""
    return gx if prior is None or added is not None else summed(prior, gx)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5, *,
               fuse=None) -> Tensor:
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``: one fused
    kernel each way (kernels.LAYERNORM_FWD / _BWD; the twin in place, means as sums times
    1/C: NumPy's ``mean`` costs a Python layer per call). 2-byte floats are normalized in
    float32 and rounded back: inside the kernel where it takes them (bf16 on a GPU), else
    by converting around it. ``fuse``: (bias, residual) arrays (either None) the projection
    that made x left for this op to add into x.data first (``linear_norm``): in the norm's
    kernel (RESIDUAL_LAYERNORM), or in a pass of their own ahead of it."""
    xp = _xp(x)
    dt = x.data.dtype
    low = dt.itemsize < 4 and dt.kind in "fV" and not kernels.LAYERNORM_FWD.native(dt)
    f32 = (lambda a: a.astype(xp.float32)) if low else (lambda a: a)
    C = x.shape[-1]
    ones = lambda: xp.ones(C, dtype=xp.float32 if low else dt)      # noqa: E731
    zeros = lambda: xp.zeros(C, dtype=xp.float32 if low else dt)    # noqa: E731
    w = f32(weight.data) if weight is not None else ones()
    b = f32(bias.data) if bias is not None else zeros()
    if fused_epilogue(fuse, x.data, low):
        _, out, mean, rstd, xhat = kernels.RESIDUAL_LAYERNORM(x.data, *fuse, w, b, eps)
        xd = x.data
    else:
        xd = f32(x.data)
        out, mean, rstd, xhat = kernels.LAYERNORM_FWD(xd, w, b, eps)
    if low:
        out = out.astype(dt)
    affine = tuple(t for t in (weight, bias) if t is not None)

    def backward(g, prior=None):
        # the weight read again, not kept: under ZeRO-3 it is a view of its block's gathered
        # parameters, which the forward has released (and the backward gathers anew)
        w = f32(weight.data) if weight is not None else ones()
        # the weight's and bias's gradients go straight into their buffers where they can
        gw_into = grad_buffer(weight) if weight is not None and not low else None
        gb_into = grad_buffer(bias) if bias is not None and not low else None
        add = norm_prior(prior, xd)                        # x's other gradient, in the pass
        gx, gw, gb = kernels.LAYERNORM_BWD(f32(g), xd, w, mean, rstd, xhat, gw_into, gb_into,
                                           add)
        grads = [with_prior(gx.astype(dt) if low else gx, prior, add)]
        for t, grad, into in ((weight, gw, gw_into), (bias, gb, gb_into)):
            if t is not None:
                grads.append(None if not needs_grad(t) else ACCUMULATED if into is not None
                             else grad.astype(t.data.dtype, copy=False))
        return tuple(grads)
    backward.adds_first = True
    return Tensor._make(out, (x,) + affine, backward)


def dropout(a: Tensor, p: float, training: bool = True, keep=None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (train only).
    ``keep``: the kept elements, drawn by the caller (a rank's slice of a larger draw);
    else the next ``a.size`` numbers of the stream decide."""
    if not training or p == 0.0:
        return a
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if keep is None:
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


def cast(a: Tensor, dtype) -> Tensor:
    """``a`` in ``dtype`` (the gradient back in ``a``'s): a 2-byte float's router or loss in
    float32, as PyTorch's autocast and Megatron's fp32 router keep them. No copy when equal."""
    if a.data.dtype == dtype:
        return a
    return Tensor._make(a.data.astype(dtype), (a,), lambda g: (g.astype(a.data.dtype),))


def moe_permute(x: Tensor, order, inv, k: int) -> Tensor:
    """Each token's k assignment rows sorted by expert: row p is token order[p] // k's
    (``inv`` is order's inverse). One gather kernel on a GPU (kernels.MOE_PERMUTE); the
    backward adds each token's k row gradients back in slot order (MOE_COMBINE, no gates)."""
    out = kernels.MOE_PERMUTE(x.data, order, k)
    return Tensor._make(out, (x,), lambda g: (kernels.MOE_COMBINE(g, None, inv, k),))


def moe_combine(ys: Tensor, w: Tensor, order, inv, k: int) -> Tensor:
    """The inverse: (N, C), token t the sum over its k rows of ys (sorted by expert) times
    their gates ``w``, in slot order. One kernel each way on a GPU (kernels.MOE_COMBINE,
    MOE_COMBINE_BWD: the rows' and the gates' gradients)."""
    out = kernels.MOE_COMBINE(ys.data, w.data, inv, k)
    return Tensor._make(out, (ys, w),
                        lambda g: kernels.MOE_COMBINE_BWD(g, ys.data, w.data, order, k))
