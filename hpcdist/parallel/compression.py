"""Gradient compression for data parallelism: how a bucket of gradients is averaged.

Each scheme has ``start(comm, grad, key)``, which averages ``grad`` in place over the ranks and
returns a handle whose ``wait()`` completes it; the dense ones say how in one collective call,
Top-K also has Horovod's ``compress``/``decompress`` pair for what travels. ``key`` names the bucket
(schemes with per-bucket state, such as Top-K residuals, keep it under that key).

- ``none``: the dense average, non-blocking (overlaps backward).
- ``fp16``: float16 on the wire, the reduction in float32 (ring with a wire dtype).
- ``topk``: Deep Gradient Compression (Lin et al., 2018): momentum correction, error feedback
  (what was not sent stays in the residual and is added next step), local gradient clipping,
  momentum factor masking and density warm-up, over ``comm.sparse_allreduce``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..comm import sparse
from ..comm.handle import Done

SCHEMES = ("none", "fp16", "topk")


class NoCompression:
    name = "none"

    def start(self, comm, grad, key):
        return comm.iallreduce(grad, op="avg", out=grad)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class FP16Compression(NoCompression):
    """Half the bytes: float16 travels, each hop's sum is taken in the gradient's dtype."""
    name = "fp16"

    def start(self, comm, grad, key):
        return comm.iallreduce(grad, op="avg", out=grad, wire_dtype=np.float16)


class TopKCompression(NoCompression):
    """DGC. Per bucket: u (momentum) and v (accumulated velocity: the error-feedback residual).

    Each step, with g the local gradient (clipped to ``clip / sqrt(P)`` of norm when ``clip``):
        u = m * u + g;  v = v + u            (momentum correction; m = 0 gives plain EF)
        send the top-k of |v| (k = density(step) * n), average over ranks -> grad
        v[sent] = 0;  u[sent] = 0             (error feedback keeps the rest; masking)
    The optimizer should then run without its own momentum (it is applied here).
    """
    name = "topk"

    def __init__(self, density: float = 0.01, momentum: float = 0.9, clip: float = 0.0,
                 warmup_steps: int = 0):
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"topk momentum must be in [0, 1), got {momentum}")
        self.density, self.momentum, self.clip = density, momentum, clip
        self.warmup_steps = warmup_steps
        self.step = 0               # advanced by the DDP wrapper once per synchronized step
        self.state: dict = {}       # key -> {"u": array, "v": array}

    def current_density(self) -> float:
        """DGC's warm-up: density falls exponentially from 25% to the target over the
        warm-up steps (25%, 6.25%, 1.56%, ... in the paper's epochs)."""
        if self.warmup_steps <= 0 or self.step >= self.warmup_steps:
            return self.density
        start = max(self.density, 0.25)
        frac = self.step / self.warmup_steps
        return math.exp(math.log(start) + frac * (math.log(self.density) - math.log(start)))

    def compress(self, grad):
        k = sparse.choose_k(grad.size, self.current_density(), None)
        idx, vals = sparse.top_k(grad.reshape(-1), k)
        return (idx, vals), grad.size

    def decompress(self, payload, ctx):
        idx, vals = payload
        dense = backend.array_module(vals).zeros(ctx, dtype=vals.dtype)
        dense[idx] = vals
        return dense

    def start(self, comm, grad, key):
        xp = backend.array_module(grad)
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = {"u": xp.zeros_like(grad), "v": xp.zeros_like(grad)}
        g = grad
        if self.clip > 0:
            norm = float(xp.sqrt((g * g).sum()))
            limit = self.clip / math.sqrt(comm.size)
            if norm > limit:
                g = g * (limit / (norm + 1e-6))
        u, v = st["u"], st["v"]
        if self.momentum:
            u *= self.momentum
            u += g
            v += u
        else:
            v += g
        (idx, vals), n = self.compress(v)
        grad[...] = comm.sparse_exchange(idx, vals, n, op="avg")
        v[idx] = 0                    # sent: the residual keeps only what stayed behind
        u[idx] = 0                    # momentum factor masking
        return Done()

    def state_dict(self) -> dict:
        out = {"step": np.array(self.step)}
        for key, st in self.state.items():
            for name, arr in st.items():
                out[f"{key}.{name}"] = backend.to_numpy(arr).copy()
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd.get("step", 0))
        self.state = {}
        for full, arr in sd.items():
            if full == "step":
                continue
            key, name = full.rsplit(".", 1)
            self.state.setdefault(int(key), {})[name] = backend.to_device(arr)


def make_compression(name: str, density: float = 0.01, momentum: float = 0.9,
                     clip: float = 0.0, warmup_steps: int = 0):
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return FP16Compression()
    if name == "topk":
        return TopKCompression(density, momentum, clip, warmup_steps)
    raise ValueError(f"unknown compression {name!r}: choose one of {', '.join(SCHEMES)}")
