"""Causal self-attention from the fused q|k|v projection: which implementation runs, where.

Everywhere, tiled (flash) attention (flash.py): O(T) memory at any context length, its kind of
arithmetic (exact, bf16 or TF32 tensor cores) following the run's precision; on the CPU its
numba + BLAS kernels (cpu_attention.py). On a GPU two more ways: ``gemms``, PyTorch eager's
(batched cuBLAS GEMMs around the fused causal softmax, the (T, T) probabilities kept for the
backward), and ``cudnn``, cuDNN's fused attention (bf16; cudnn_attention.py). ``--attention
auto`` times the ways that can run on the run's own shape on its first call and keeps the
fastest (``choice()`` says which, for the run header)."""
from __future__ import annotations

import time

import numpy as np

from .. import backend
from . import attention_kinds, cudnn_attention, gemm
from .flash import (FLASH_BWD, FLASH_FWD, ROUNDING, flash_bwd_twin, flash_twin,
                    head_size)
from .gemm import matmul as gemm_matmul
from .rows import (SOFTMAX_CAUSAL_BWD, SOFTMAX_CAUSAL_FWD, softmax_causal_bwd_twin,
                   softmax_causal_twin)

PATHS = ("auto", "flash", "gemms", "cudnn")
_path = "auto"
_graphs = False                 # the steps are captured as CUDA graphs (configure)
_chosen: dict = {}              # (shape, dtype, kind) -> the path auto measured fastest


def _qkv_heads(qkv, n_head):
    """q (B, nh, T, hs), k (B, nh, hs, T), v (B, nh, T, hs): views of qkv (B, T, 3C)."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // n_head
    r = qkv.reshape(B, T, 3, n_head, hs)
    return (r[:, :, 0].transpose(0, 2, 1, 3), r[:, :, 1].transpose(0, 2, 3, 1),
            r[:, :, 2].transpose(0, 2, 1, 3))


def attention_twin(qkv, n_head, scale):
    """(y (B, T, C), lse (B, nh, T), the probabilities (B, nh, T, T)): the whole (T, T) at
    once, the plain definition (the tests' oracle for the tiled twin and kernels)."""
    return _attention(qkv, n_head, scale, softmax_causal_twin, backend.matmul)


def _attention(qkv, n_head, scale, softmax, mm, with_lse=True):
    """The twin's formulation with its softmax and GEMMs given: the twin's own, or the fused
    softmax and the run's GEMMs (the GPU's GEMM path, which keeps the probabilities and so
    skips lse: five elementwise passes over the scores, 4.3 ms of an 86 ms H200 step)."""
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    s = mm(q, k)
    att = softmax(s, scale)
    B, nh, T, hs = q.shape
    y = mm(att, v).transpose(0, 2, 1, 3).reshape(B, T, nh * hs)
    if not with_lse:
        return xp.ascontiguousarray(y), None, att
    z = xp.where(att > 0, s * scale, xp.asarray(-np.inf, dtype=s.dtype))
    zmax = z.max(axis=-1)
    lse = zmax + xp.log(xp.exp(z - zmax[..., None]).sum(axis=-1))
    return xp.ascontiguousarray(y), lse, att


def attention_bwd_twin(qkv, y, dy, lse, n_head, scale, att=None):
    """dqkv (B, T, 3C) of y = attention_twin(qkv)[0]."""
    return _attention_bwd(qkv, dy, lse, n_head, scale, att, softmax_causal_bwd_twin,
                          backend.matmul)


def _attention_bwd(qkv, dy, lse, n_head, scale, att, softmax_bwd, mm):
    xp = backend.array_module(qkv)
    q, k, v = _qkv_heads(qkv, n_head)
    B, nh, T, hs = q.shape
    if att is None:
        att = xp.exp(mm(q, k) * scale - lse[..., None])
        att = xp.where(xp.arange(T)[None, :] > xp.arange(T)[:, None], 0, att)
    g = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)            # (B, nh, T, hs)
    dv = mm(xp.swapaxes(att, -1, -2), g)                          # (B, nh, T, hs)
    datt = mm(g, xp.swapaxes(v, -1, -2))                          # (B, nh, T, T)
    ds = softmax_bwd(datt, att, scale)
    dq = mm(ds, xp.swapaxes(k, -1, -2))                           # (B, nh, T, hs)
    dk = mm(xp.swapaxes(ds, -1, -2), q)                           # (B, nh, T, hs)
    out = xp.empty(qkv.shape, dtype=qkv.dtype)
    r = out.reshape(B, T, 3, nh, hs)
    for part, grad in enumerate((dq, dk, dv)):
        r[:, :, part] = grad.transpose(0, 2, 1, 3)
    return out



# ---- which way runs -------------------------------------------------------------------------

def configure(path: str = "auto", graphs: bool = False) -> None:
    """The run's ``--attention``: auto | flash | gemms | cudnn. gemms and cudnn where they can
    run (a GPU; gemms: n_kv_head == n_head; cudnn: bf16 and a head size it takes), flash
    elsewhere; ``check`` says in one line when the run's settings rule the asked one out.
    ``graphs``: the steps are captured as CUDA graphs (device/graphs.py), which the GEMM
    path's batched GEMMs cannot be (CuPy's cuBLAS refuses a capture): auto leaves it out."""
    global _path, _graphs
    if path not in PATHS:
        raise ValueError(f"--attention must be one of {', '.join(PATHS)}, got {path!r}")
    _path, _graphs = path, graphs
    _chosen.clear()


def check(path: str, precision: str, head: int, device: str) -> str | None:
    """Why ``--attention path`` cannot run with these settings (None: it can)."""
    if path in ("auto", "flash"):
        return None
    if device != "gpu":
        return f"--attention {path} runs on a GPU (this run: --device {device}); flash runs here"
    if path == "cudnn":
        if precision not in ("bf16", "fp8"):
            return (f"--attention cudnn takes bf16 (cuDNN's fused attention has no {precision}"
                    f" kernel): use --precision bf16 or --attention flash")
        if not cudnn_attention.takes(head):
            return f"--attention cudnn: cuDNN takes head sizes of a multiple of 8 up to 128, not {head}"
        return cudnn_attention.why_not()
    return None


def kind(dtype) -> str:
    """The flash kernels' arithmetic for arrays of ``dtype`` in this run: bf16 arrays (and
    float32 under bf16 emulation) on tensor cores, float32 under --tf32 in TF32, else exact."""
    if np.dtype(dtype).name == "bfloat16":
        return "bf16"
    if np.dtype(dtype) != np.float32:
        return "exact"
    if backend.bf16_emulated():
        return "bf16"
    return "tf32" if gemm.tf32_on() and backend.device_label() == "gpu" else "exact"


# auto weighs the GEMM path only while the (T, T) probabilities it keeps are at most the rest
# of a layer's activations (about 14 B T C elements, plan/memory.py's hpcdist_layer): T <=
# 14 x the head size (896 at 64). Longer, its memory grows as T^2 (12 heads at T 8192: 3 GiB a
# layer) and even the measuring call would leave that in the pool; --attention gemms still
# runs it at any length.
GEMMS_MAX_T_PER_HEAD_DIM = 14


def candidates(qkv, n_head, n_kv_head) -> list:
    """The ways this call can run: flash everywhere; on a GPU the GEMM path (n_kv_head ==
    n_head; for auto up to GEMMS_MAX_T_PER_HEAD_DIM x the head size) and cuDNN's (bf16, a
    head size it takes, the frontend installed)."""
    ways = ["flash"]
    if backend.device_label() != "gpu":
        return ways
    hs = head_size(qkv.shape[-1], n_head, n_kv_head)
    if n_kv_head == n_head and (_path == "gemms" or not _graphs and
                                qkv.shape[1] <= GEMMS_MAX_T_PER_HEAD_DIM * hs):
        ways.append("gemms")
    if kind(qkv.dtype) == "bf16" and cudnn_attention.takes(hs) and \
            cudnn_attention.why_not() is None and cudnn_attention.passed(qkv.dtype.name):
        ways.append("cudnn")
    return ways


def path_for(qkv, n_head, n_kv_head, scale) -> str:
    """The way this call runs (auto: measured once per shape, dtype and kind)."""
    key = (tuple(qkv.shape), n_head, n_kv_head, qkv.dtype.name, kind(qkv.dtype))
    if key not in _chosen:                   # (an asked path that cannot run here: flash,
        ways = candidates(qkv, n_head, n_kv_head)  # and choice() says so)
        if _path != "auto":
            _chosen[key] = _path if _path in ways else "flash"
        else:
            _chosen[key] = _measure(qkv, n_head, n_kv_head, scale, ways) if len(ways) > 1 \
                else ways[0]
    return _chosen[key]


def choice() -> str:
    """What ran so far, in words (the run's end and the bench): the path per shape."""
    if not _chosen:
        return _path
    return "; ".join(f"{path} at B, T = {shape[0]}, {shape[1]}"
                     for (shape, *_), path in _chosen.items())


def _measure(qkv, n_head, n_kv_head, scale, ways) -> str:
    """The fastest of ``ways`` on this shape: forward + backward, best of 3 after one."""
    dy = backend.xp().ones(qkv.shape[:2] + (head_size(qkv.shape[-1], n_head, n_kv_head)
                                            * n_head,), dtype=qkv.dtype)
    best = {}
    for path in ways:
        times = []
        for _ in range(4):
            backend.synchronize()
            t0 = time.perf_counter()
            y, lse, saved = _forward(path, qkv, n_head, n_kv_head, scale)
            _backward(qkv, y, dy, lse, n_head, n_kv_head, scale, saved)
            backend.synchronize()
            times.append(time.perf_counter() - t0)
        best[path] = min(times[1:])            # (the first compiles and self-checks)
    return min(best, key=best.get)


def _forward(path, qkv, n_head, n_kv_head, scale):
    """(y, lse, what the backward needs to know: None for flash, or (path, its arrays))."""
    if path == "gemms":
        y, lse, att = _attention(backend.xp().ascontiguousarray(qkv), n_head, scale,
                                 SOFTMAX_CAUSAL_FWD, gemm_matmul, with_lse=False)
        return y, lse, ("gemms", att)
    if path == "cudnn":
        y, stats = cudnn_attention.CUDNN_FWD(qkv, n_head, n_kv_head, scale)
        return y, stats, ("cudnn", None)
    y, lse = FLASH_FWD[kind(qkv.dtype)](qkv, n_head, n_kv_head, scale)
    return y, lse, None


def _backward(qkv, y, dy, lse, n_head, n_kv_head, scale, saved):
    if saved is not None and saved[0] == "gemms":
        return _attention_bwd(backend.xp().ascontiguousarray(qkv), dy, lse, n_head, scale,
                              saved[1], SOFTMAX_CAUSAL_BWD, gemm_matmul)
    if saved is not None and saved[0] == "cudnn":
        return cudnn_attention.CUDNN_BWD(qkv, y, dy, lse, n_head, n_kv_head, scale)
    return FLASH_BWD[kind(qkv.dtype)](qkv, y, dy, lse, n_head, n_kv_head, scale)


def attention_fwd(qkv, n_head: int, n_kv_head: int, scale: float):
    """(y (B, T, n_head hs), lse (B, n_head, T), what the backward needs) of causal attention
    over qkv (B, T, (n_head + 2 n_kv_head) hs): the arguments ``attention_bwd`` takes."""
    head_size(qkv.shape[-1], n_head, n_kv_head)
    return _forward(path_for(qkv, n_head, n_kv_head, scale), qkv, n_head, n_kv_head, scale)


def attention_bwd(qkv, y, dy, lse, n_head: int, n_kv_head: int, scale: float, saved=None):
    """dqkv (the shape of qkv) of y = attention_fwd(qkv)[0] against dy."""
    return _backward(qkv, y, dy, lse, n_head, n_kv_head, scale, saved)


def _kinded(qkv, n_head, n_kv_head, scores):
    """(these rows' scores (a window of T or more dropped), the softmax scale, the run's
    arithmetic) for both directions."""
    scores = scores.within(qkv.shape[1])
    return (scores, scores.softmax_scale(head_size(qkv.shape[-1], n_head, n_kv_head)),
            kind(qkv.dtype))


def kinded_attention_fwd(qkv, n_head: int, n_kv_head: int, scores, sinks=None):
    """(y, lse, None) of attention with ``scores`` (attention_kinds.Scores) and, where it
    declares them, ``sinks`` (n_head,): the flash kernels where they take the scores, the
    tiled twin where they do not (choice() says which ran); sinks merged after either."""
    scores, scale, arith = _kinded(qkv, n_head, n_kv_head, scores)
    if scores.tiled_kernels_take:
        way = "flash"
        y, lse = FLASH_FWD[arith](qkv, n_head, n_kv_head, scale)
    else:                            # (q, k, v rounded as the run's arithmetic rounds them)
        way = (f"the tiled twin (soft-cap {scores.cap:g}, window {scores.window}: the flash "
               "kernels take neither yet)")
        y, lse = flash_twin(qkv, n_head, n_kv_head, scale, ROUNDING[arith], scores.cap,
                            scores.window)
    _chosen.setdefault((tuple(qkv.shape), n_head, n_kv_head, qkv.dtype.name, scores), way)
    if sinks is not None:
        y, lse = attention_kinds.with_sinks(y, lse, sinks)
    return y, lse, None


def kinded_attention_bwd(qkv, y, dy, lse, n_head: int, n_kv_head: int, scores, sinks=None):
    """(dqkv, dsinks or None) of kinded_attention_fwd, given its merged lse and final y."""
    scores, scale, arith = _kinded(qkv, n_head, n_kv_head, scores)
    if scores.tiled_kernels_take:
        dqkv = FLASH_BWD[arith](qkv, y, dy, lse, n_head, n_kv_head, scale)
    else:
        dqkv = flash_bwd_twin(qkv, y, dy, lse, n_head, n_kv_head, scale, ROUNDING[arith],
                              scores.cap, scores.window)
    return dqkv, None if sinks is None else attention_kinds.sink_grad(y, dy, lse, sinks)
