"""The rotary families' ops: RMSNorm, SwiGLU and GeGLU from the fused gate | up projection,
rotary position embeddings on the fused q|k|v. One fused kernel each way
(device/kernels/rmsnorm.py, swiglu.py, rotary.py; numba's on the CPU); the weight's gradient
straight into its buffer where it has one."""
from __future__ import annotations

from ...device import backend, kernels
from ..tensor import ACCUMULATED, Tensor, needs_grad
from .linear import grad_buffer
from .nn import fused_epilogue, norm_prior, with_prior

_TABLES: list = []            # [(pos, hd, rotary, dtype, (cos, sin))]: the last few position sets


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, fuse=None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (kernels.RMSNORM_FWD / _BWD).
    2-byte floats are normalised in float32 and rounded back: inside the kernel where it
    takes them (bf16 on a GPU), else by converting around it. ``fuse``: as layer_norm's
    (RESIDUAL_RMSNORM)."""
    xp = backend.array_module(x.data)
    dt = x.data.dtype
    low = dt.itemsize < 4 and dt.kind in "fV" and not kernels.RMSNORM_FWD.native(dt)
    f32 = (lambda a: a.astype(xp.float32)) if low else (lambda a: a)
    if fused_epilogue(fuse, x.data, low):
        xd = x.data
        _, out, rstd, xhat = kernels.RESIDUAL_RMSNORM(xd, *fuse, weight.data, eps)
    else:
        xd = f32(x.data)
        out, rstd, xhat = kernels.RMSNORM_FWD(xd, f32(weight.data), eps)

    def backward(g, prior=None):
        into = grad_buffer(weight) if not low else None   # (the weight read again: ZeRO-3)
        add = norm_prior(prior, xd)                        # x's other gradient, in the pass
        gx, gw = kernels.RMSNORM_BWD(f32(g), xd, f32(weight.data), rstd, xhat, into, add)
        gw = None if not needs_grad(weight) else ACCUMULATED if into is not None else \
            gw.astype(weight.data.dtype, copy=False)
        return with_prior(gx.astype(dt, copy=False), prior, add), gw
    backward.adds_first = True
    return Tensor._make(out.astype(dt, copy=False), (x, weight), backward)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up of h (..., 2H) = [gate | up] -> (..., H) (kernels.SWIGLU_FWD / _BWD)."""
    out = kernels.SWIGLU_FWD(h.data)
    return Tensor._make(out, (h,), lambda g: (kernels.SWIGLU_BWD(h.data, g),))


def geglu(h: Tensor) -> Tensor:
    """gelu_tanh(gate) * up of h (..., 2H) = [gate | up] -> (..., H) (Gemma's gated MLP;
    kernels.GEGLU_FWD / _BWD)."""
    out = kernels.GEGLU_FWD(h.data)
    return Tensor._make(out, (h,), lambda g: (kernels.GEGLU_BWD(h.data, g),))


def rotary(qkv: Tensor, pos, shape, rotary) -> Tensor:
    """qkv (B, T, shape.width) with its q and k heads rotated by their rows' global positions
    ``pos`` (T,) at ``rotary``'s frequencies (nn.attention.Rotary: a base theta, or a scaled
    kind) (kernels.ROTARY; the backward rotates the gradient back)."""
    cos, sin = tables(pos, shape.head_dim, rotary, qkv.data.dtype)
    nq, nk, hd = shape.n_head, shape.n_kv_head, shape.head_dim
    out = kernels.ROTARY(qkv.data, cos, sin, nq, nk, hd, 1.0)
    return Tensor._make(out, (qkv,), lambda g: (kernels.ROTARY(g, cos, sin, nq, nk, hd, -1.0),))


def tables(pos, hd: int, rotary, dtype):
    """(cos, sin) of ``pos``: made once for the position array every block of a step shares
    (the last few kept, with the array itself, so an id is never reused meanwhile)."""
    for p, h, r, dt, both in _TABLES:
        if p is pos and h == hd and r == rotary and dt == dtype:
            return both
    inv = rotary.frequencies(hd, backend.array_module(pos))
    both = kernels.rotary_tables(pos, hd, rotary.theta, dtype, frequencies=inv)
    if rotary.magnitude() != 1.0:                         # (YaRN's attention factor)
        both = tuple(t * t.dtype.type(rotary.magnitude()) for t in both)
    _TABLES.insert(0, (pos, hd, rotary, dtype, both))
    del _TABLES[8:]
    return both
