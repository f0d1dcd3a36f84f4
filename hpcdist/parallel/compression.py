"""Gradient compression for data parallelism: how a bucket of gradients is averaged.

Each scheme has ``start(comm, grad, key)``, which averages ``grad`` in place over the ranks and
returns a handle whose ``wait()`` completes it; the dense ones say how in one collective call,
Top-K also has Horovod's ``compress``/``decompress`` pair for what travels. ``key`` names the bucket
(schemes with per-bucket state, such as Top-K residuals, keep it under that key).

The rest of this design: docs/compression.md, "hpcdist/parallel/compression.py"."""
from __future__ import annotations

import math

import numpy as np

from ..device import backend
from ..comm import sparse
from ..comm.handle import Done

SCHEMES = ("none", "fp16", "topk", "powersgd")


class NoCompression:
    name = "none"

    def bind(self, buckets: dict) -> None:
        """``{bucket index: [(offset in the bucket, shape) of each parameter]}``."""

    def start(self, comm, grad, key):
        return comm.iallreduce(grad, op="avg", out=grad)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def on_new_layout(self, reader, step: int, same_model_split: bool, replicas: int):
        """A checkpoint of another layout is being loaded: what becomes of this scheme's
        per-rank state (``reader``: the checkpoint; ``same_model_split``: TP and PP as
        written; ``replicas``: the ranks the state is now shared over). Returns what to say,
        or None."""
        return None


class FP16Compression(NoCompression):
    """Half the bytes: float16 travels, each hop's sum is taken in the gradient's dtype."""
    name = "fp16"

    def start(self, comm, grad, key):
        return comm.iallreduce(grad, op="avg", out=grad, wire_dtype=np.float16)


class _KeyedState(NoCompression):
    """Per-rank state kept as ``self.state[bucket][name] = array`` plus a step counter; saved
    and loaded under ``"<bucket>.<name>"``."""

    step = 0
    state: dict

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


class TopKCompression(_KeyedState):
    """DGC. Per bucket: u (momentum) and v (accumulated velocity: the error-feedback residual).

    Each step, with g the local gradient (clipped to ``clip / sqrt(P)`` of norm when ``clip``):
        u = m * u + g;  v = v + u            (momentum correction; m = 0 gives plain EF)
        send the top-k of |v| (k = density(step) * n), average over ranks -> grad
        v[sent] = 0;  u[sent] = 0             (error feedback keeps the rest; masking)
    The optimizer should then run without its own momentum (it is applied here).
    """
    name = "topk"

    def on_new_layout(self, reader, step: int, same_model_split: bool, replicas: int):
        """Residuals summed over the old ranks and split evenly (dropped where the model is
        split otherwise: they belong to other parameters' pieces)."""
        if not same_model_split:
            return "Top-K residuals dropped (another model-parallel layout)"
        total = None
        for r in range(reader.world):
            res = {k: v for k, v in reader.own(r).items() if k.startswith("compress.")}
            total = res if total is None else {k: total[k] + res[k] for k in total}
        self.load_state_dict({k[len("compress."):]: v / replicas
                              for k, v in (total or {}).items()})
        return "Top-K residuals summed over the old ranks and split evenly"

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


class PowerSGDCompression(_KeyedState):
    """PowerSGD (Vogels et al., 2019, Algorithm 1 with error feedback), per bucket.

    For each gradient matrix G (a parameter of shape (n, ...) viewed as n x m) and rank
    r = min(rank, n, m), with E the error this rank kept last step and Q (m x r) last step's
    averaged Q (seeded alike on every rank at the first step):
        M = G + E;   P = avg(M Q);   P = orthonormal basis of P (QR)
        Q = avg(M^T P);   G~ = P Q^T;   E = M - G~           (this rank's error feedback)
    All P's of a bucket, and its dense pieces, travel in one allreduce; all Q's in a second.
    A matrix is compressed only where its n m values are at least ``min_rate`` times the
    r (n + m) it would send (PyTorch's ``min_compression_rate``); the rest travel dense.
    The first ``start_step`` steps average densely (PyTorch's ``start_powerSGD_iter``).
    At r = min(n, m) the approximation is exact: P spans the averaged M's columns.
    """
    name = "powersgd"

    def on_new_layout(self, reader, step: int, same_model_split: bool, replicas: int):
        self.step = step                 # error feedback and warm start begin afresh
        return "PowerSGD errors and warm-start factors start afresh"

    def __init__(self, rank: int = 1, start_step: int = 0, min_rate: float = 2.0,
                 seed: int = 0):
        if rank < 1:
            raise ValueError(f"powersgd rank must be at least 1, got {rank}")
        self.rank, self.start_step, self.min_rate, self.seed = rank, start_step, min_rate, seed
        self.step = 0
        self.state: dict = {}        # bucket -> {"q<i>": Q, "e<i>": error} per compressed matrix
        self.split: dict = {}       # bucket -> ([(offset, n, m, r)], [(offset, size)])

    def bind(self, buckets: dict) -> None:
        self.split = {}
        for key, params in buckets.items():
            mats, dense = [], []
            for off, shape in params:
                size = int(np.prod(shape))
                if len(shape) >= 2:
                    n, m = int(shape[0]), size // int(shape[0])
                    r = min(self.rank, n, m)
                    if n * m >= self.min_rate * r * (n + m):
                        mats.append((off, n, m, r))
                        continue
                dense.append((off, size))
            self.split[key] = (sorted(mats), sorted(dense))

    def elements(self, key) -> tuple[int, int]:
        """Values bucket ``key`` sends per step: (P's allreduce, Q's allreduce)."""
        mats, dense = self.split[key]
        return (sum(n * r for _, n, _, r in mats) + sum(s for _, s in dense),
                sum(m * r for _, _, m, r in mats))

    def start(self, comm, grad, key):
        mats, dense = self.split.get(key, ((), ()))
        if self.step < self.start_step or not mats:
            return comm.iallreduce(grad, op="avg", out=grad)
        xp = backend.array_module(grad)
        st = self.state.setdefault(key, {})
        parts = []
        for i, (off, n, m, r) in enumerate(mats):
            M = grad[off:off + n * m].reshape(n, m)
            if f"e{i}" in st:
                M += st[f"e{i}"]                       # error feedback
            if f"q{i}" not in st:                      # the same start on every rank
                rng = np.random.default_rng([self.seed, int(key), i])
                st[f"q{i}"] = backend.to_device(rng.standard_normal((m, r))).astype(grad.dtype)
            parts.append((M @ st[f"q{i}"]).reshape(-1))
        parts += [grad[off:off + size] for off, size in dense]
        buf = xp.concatenate(parts)
        handle = comm.iallreduce(buf, op="avg", out=buf)
        return _Then(lambda: self._finish(comm, grad, key, buf, handle))

    def _finish(self, comm, grad, key, buf, handle) -> None:
        xp = backend.array_module(grad)
        handle.wait()
        mats, dense = self.split[key]
        st = self.state[key]
        o, ps = 0, []
        for off, n, m, r in mats:
            ps.append(xp.linalg.qr(buf[o:o + n * r].reshape(n, r))[0])
            o += n * r
        for off, size in dense:
            grad[off:off + size] = buf[o:o + size]
            o += size
        qs = xp.concatenate([(grad[off:off + n * m].reshape(n, m).T @ p).reshape(-1)
                             for (off, n, m, _), p in zip(mats, ps)])
        comm.allreduce(qs, op="avg", out=qs)
        o = 0
        for i, ((off, n, m, r), p) in enumerate(zip(mats, ps)):
            q = qs[o:o + m * r].reshape(m, r)
            o += m * r
            M = grad[off:off + n * m].reshape(n, m)
            approx = p @ q.T
            st[f"e{i}"] = M - approx
            M[...] = approx
            st[f"q{i}"] = q.copy()                     # warm start for the next step


class _Then:
    """A handle whose ``wait()`` runs the rest of the exchange once."""

    def __init__(self, fn):
        self._fn, self._done = fn, False

    def test(self) -> bool:
        return self._done

    def wait(self):
        if not self._done:
            self._done = True
            self._fn()


def make_compression(name: str, density: float = 0.01, momentum: float = 0.9,
                     clip: float = 0.0, warmup_steps: int = 0, rank: int = 1,
                     *, start_step: int = 0):
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return FP16Compression()
    if name == "topk":
        return TopKCompression(density, momentum, clip, warmup_steps)
    if name == "powersgd":
        return PowerSGDCompression(rank, start_step)
    raise ValueError(f"unknown compression {name!r}: choose one of {', '.join(SCHEMES)}")
