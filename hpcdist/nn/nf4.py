"""4-bit NormalFloat (QLoRA, Dettmers et al. 2023, section 3): a frozen base weight in 4 bits.

The 16 code values are the paper's: quantiles of N(0, 1), 8 positive and 7 negative, an exact
0, normalised to [-1, 1] (``CODE``; offset 0.9677 as bitsandbytes, the paper's reference). A
weight is cut into blocks of 64 (C order); each keeps its absolute maximum and, per element,
the index of the nearest code value to element / maximum, two a byte. Double quantisation:
the maxima less their mean, int8 over each 256 blocks' absolute maximum (the paper: 8-bit
floats). 4 + 8/64 + 32/(64 x 256) = 4.127 bits a parameter. ``NF4``'s ``data`` is the weight
dequantised when read (by each GEMM, forward and backward, on its device), never stored."""
from __future__ import annotations

from statistics import NormalDist

import numpy as np

from ..device import backend
from .frozen import Frozen

BLOCK, SCALE_BLOCK = 64, 256
OFFSET = 0.9677083                      # the quantile the outermost code values sit at


def _code() -> np.ndarray:
    q = NormalDist().inv_cdf
    pos = [q(p) for p in np.linspace(OFFSET, 0.5, 9)[:-1]]      # 8 positive
    neg = [-q(p) for p in np.linspace(OFFSET, 0.5, 8)[:-1]]     # 7 negative
    values = np.sort(np.array(pos + [0.0] + neg))
    return (values / np.abs(values).max()).astype(np.float32)


CODE = _code()                          # (16,) ascending, CODE[7] == 0
_MIDS = (CODE[1:] + CODE[:-1]) / 2      # the boundaries between neighbours


def quantize(w) -> dict:
    """The NF4 form of array ``w`` (any shape; the last block padded with zeros): "codes" (uint8,
    two indices a byte, the first in the low half), the double-quantised block maxima
    ("scales" int8, "scale_of" fp32 per 256 blocks, "mean" fp32) and the shape."""
    xp = backend.array_module(w)
    flat = xp.asarray(w, dtype=np.float32).reshape(-1)
    if flat.size % BLOCK:
        flat = xp.concatenate([flat, xp.zeros(-flat.size % BLOCK, np.float32)])
    blocks = flat.reshape(-1, BLOCK)
    absmax = xp.abs(blocks).max(axis=1)
    safe = xp.where(absmax > 0, absmax, 1)
    idx = _nearest(xp, (blocks / safe[:, None]).reshape(-1))
    codes = (idx[0::2] | (idx[1::2] << 4)).astype(np.uint8)
    mean = absmax.mean()
    centred = absmax - mean
    n = centred.size
    pad = -n % SCALE_BLOCK
    groups = xp.concatenate([centred, xp.zeros(pad, np.float32)]).reshape(-1, SCALE_BLOCK)
    scale_of = xp.abs(groups).max(axis=1) / 127
    scale_of = xp.where(scale_of > 0, scale_of, 1).astype(np.float32)
    scales = xp.rint(groups / scale_of[:, None]).astype(np.int8).reshape(-1)[:n]
    return {"codes": codes, "scales": scales, "scale_of": scale_of,
            "mean": xp.asarray(mean, np.float32), "shape": tuple(w.shape)}


def _nearest(xp, v, chunk: int = 1 << 20):
    """The index of the code value nearest each of ``v`` (the count of boundaries below it;
    a tie goes to the lower), ``chunk`` values at a time (a 16-wide comparison each)."""
    mids = xp.asarray(_MIDS)
    out = xp.empty(v.size, dtype=np.uint8)
    for lo in range(0, v.size, chunk):
        out[lo:lo + chunk] = (v[lo:lo + chunk, None] > mids).sum(axis=1)
    return out


def block_maxima(q: dict):
    """The blocks' absolute maxima the double-quantised scales give back (fp32)."""
    xp = backend.array_module(q["codes"])
    n = q["scales"].size
    per = xp.repeat(q["scale_of"], SCALE_BLOCK)[:n]
    return q["scales"].astype(np.float32) * per + q["mean"]


def dequantize(q: dict, dtype=np.float32):
    """The weight of NF4 form ``q`` in ``dtype``: each index's code value x its block's
    maximum."""
    xp = backend.array_module(q["codes"])
    idx = xp.empty(q["codes"].size * 2, dtype=np.uint8)
    idx[0::2] = q["codes"] & 15
    idx[1::2] = q["codes"] >> 4
    values = xp.asarray(CODE)[idx].reshape(-1, BLOCK) * block_maxima(q)[:, None]
    size = int(np.prod(q["shape"]))
    return values.reshape(-1)[:size].reshape(q["shape"]).astype(dtype, copy=False)


def nbytes(q: dict) -> int:
    return int(q["codes"].nbytes + q["scales"].nbytes + q["scale_of"].nbytes + 4)


class NF4(Frozen):
    """A frozen weight held in NF4; ``data`` dequantises it (in ``dtype``) on each read."""

    __slots__ = ("q", "out_dtype")

    def __init__(self, w, dtype):        # (no Tensor.__init__: there is no array to keep)
        self.q, self.out_dtype = quantize(w), np.dtype(dtype)
        self.grad, self.requires_grad, self._parents = None, False, ()
        self._backward, self._hooks, self.name = None, None, None

    @property
    def data(self):
        return dequantize(self.q, self.out_dtype)

    @property
    def shape(self):
        return self.q["shape"]

    @property
    def dtype(self):
        return self.out_dtype

    @property
    def ndim(self):
        return len(self.q["shape"])

    @property
    def size(self):
        return int(np.prod(self.q["shape"]))

    @property
    def nbytes(self) -> int:
        return nbytes(self.q)
