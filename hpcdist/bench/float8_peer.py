"""PyTorch's float8 training as torchao's tensorwise recipe runs it, the peer of hpcdist's
``--precision fp8`` in ``bench gpu``: each linear layer's three GEMMs through
``torch._scaled_mm`` on e4m3 activations and weights and e5m2 gradients, every tensor scaled by
its current amax (dynamic, one scale a tensor). The scales are rounded down to a power of two,
as hpcdist's are (device/fp8.py; torchao offers the rounding as an option), so both quantize a
tensor to the same codes: tests/test_fp8.py checks hpcdist's emulation against this on the CPU,
where PyTorch runs ``_scaled_mm`` too. The LM head stays in bf16 on both sides."""
from __future__ import annotations

import functools

from hpcdist.device.fp8 import E4M3, E5M2


def to_fp8(t, dtype, top: float):
    """(t's fp8 codes, the inverse of their scale as a 0-d float32 tensor): the scale is the
    largest power of two that keeps t's amax within ``top`` (an all-zero t: amax 1)."""
    import torch
    amax = t.detach().abs().amax().float()
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    _, e = torch.frexp(torch.tensor(top, dtype=torch.float32, device=t.device) / amax)
    scale = torch.ldexp(torch.ones_like(amax), e - 1)
    codes = (t.detach().float() * scale).clamp(-top, top).to(dtype)
    return codes, scale.reciprocal()


def _mm(a, a_inv, b, b_inv, out_dtype):
    """a (M, K) @ b (K, N) on fp8 codes: ``_scaled_mm`` takes a row-major and b column-major."""
    import torch
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv,
                            scale_b=b_inv, out_dtype=out_dtype)


@functools.cache
def _function():
    import torch

    class Float8Matmul(torch.autograd.Function):
        """x (..., K) @ w (K, N): forward e4m3 x e4m3; dx = g (e5m2) @ w^T (e4m3); dw = x^T
        (e4m3) @ g (e5m2); products in x's dtype (bf16 under autocast)."""

        @staticmethod
        def forward(ctx, x, w):
            out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
            x2 = x.reshape(-1, x.shape[-1])
            xq, x_inv = to_fp8(x2, torch.float8_e4m3fn, E4M3.max)
            wq, w_inv = to_fp8(w, torch.float8_e4m3fn, E4M3.max)
            ctx.save_for_backward(xq, x_inv, wq, w_inv)
            ctx.shape, ctx.w_dtype = x.shape, w.dtype
            return _mm(xq, x_inv, wq, w_inv, out_dtype).reshape(*x.shape[:-1], w.shape[1])

        @staticmethod
        def backward(ctx, g):
            xq, x_inv, wq, w_inv = ctx.saved_tensors
            g2 = g.reshape(-1, g.shape[-1])
            gq, g_inv = to_fp8(g2, torch.float8_e5m2, E5M2.max)
            dx = _mm(gq, g_inv, wq.t(), w_inv, g.dtype)
            dw = _mm(xq.t(), x_inv, gq, g_inv, g.dtype)
            return dx.reshape(ctx.shape), dw.to(ctx.w_dtype)

    return Float8Matmul


def float8_matmul(x, w):
    """``x @ w`` with the GEMMs of torchao's tensorwise float8 recipe (the linear layers' ``mm``
    of bench.autograd's PyTorch twins)."""
    return _function().apply(x, w)
