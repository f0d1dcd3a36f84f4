"""cuDNN's fused attention as a second GPU backend for bf16 runs (``--attention cudnn``, or
``auto`` where it measures faster): the SDPA graph PyTorch and llm.c call, driven through
``nvidia-cudnn-frontend`` (the ``cudnn`` extra: ``pip install 'hpcdist[cudnn]'``) with raw
device pointers on CuPy's stream, a graph built once per shape. cuDNN takes bf16 in and out:
q|k|v, y and dy are rounded to bf16 words (gemm.py's conversion kernels), the outputs come
back to float32. Like every fused kernel it checks itself against its twin (the bf16 flash
twin) on first use; head sizes it does not take (not a multiple of 8, over 128) run the
flash kernels instead, and ``why_not()`` says why cuDNN is not in use at all."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from . import flash, gemm

_graphs: dict = {}
_handle = None


def why_not() -> str | None:
    """None where cuDNN's attention can run here, else why not, in one line."""
    if backend.device_label() != "gpu":
        return "cuDNN's attention runs on a GPU only"
    try:
        import cudnn
    except ImportError:
        return "nvidia-cudnn-frontend is not installed (pip install 'hpcdist[cudnn]')"
    try:
        cudnn.backend_version()
    except Exception as e:                     # the frontend without the library
        return f"the cuDNN library did not load ({type(e).__name__}: {str(e)[:80]})"
    return None


def passed(dtype: str = "float32") -> bool:
    """Whether both directions passed their self-check on this GPU for arrays of ``dtype``
    (run now if not yet): a refused one would run as its slow twin, so ``auto`` and
    ``--attention cudnn`` then take the flash kernels (``fused.refusals()`` says why)."""
    return CUDNN_FWD.ready(dtype) and CUDNN_BWD.ready(dtype)


def _words(k, x):
    """x as the bf16 words cuDNN reads: a bf16 array's own (a view), else one TO_BF16 pass."""
    xp = backend.xp()
    if x.dtype.name == "bfloat16":
        return xp.ascontiguousarray(x).view(np.uint16)
    return gemm._to_bf16(k, xp.ascontiguousarray(x, dtype=np.float32))


def _out(k, words, like):
    """cuDNN's bf16 words as the caller's dtype: viewed as bf16, or converted to float32."""
    return words.view(like.dtype) if like.dtype.name == "bfloat16" else gemm._from_bf16(k, words)


def takes(hs: int) -> bool:
    """Whether cuDNN's SDPA takes this head size (the flash kernels run the others)."""
    return hs % 8 == 0 and hs <= 128


def _handle_on_stream():
    import cudnn
    global _handle
    if _handle is None:
        _handle = cudnn.create_handle()
    cudnn.set_stream(_handle, backend.xp().cuda.get_current_stream().ptr)
    return _handle


def _tensor(graph, name, dims, strides):
    import cudnn
    return graph.tensor(name=name, dim=list(dims), stride=list(strides),
                        data_type=cudnn.data_type.BFLOAT16)


def _build(B, T, nh, nkv, hs, scale, backward):
    """(graph, its tensors by name, workspace) of the forward or backward, cached per shape."""
    key = (B, T, nh, nkv, hs, float(scale), backward)
    if key in _graphs:
        return _graphs[key]
    import cudnn
    fp32, bf16 = cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
    handle = _handle_on_stream()
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32,
                      handle=handle)
    W = (nh + 2 * nkv) * hs                       # qkv's row: (B, T, W), heads [B, H, T, hs]
    fused = lambda H: ([B, H, T, hs], [T * W, hs, W, 1])                  # noqa: E731
    plain = ([B, nh, T, hs], [T * nh * hs, hs, nh * hs, 1])               # y, dy: (B, T, nh hs)
    t = {"q": _tensor(g, "q", *fused(nh)), "k": _tensor(g, "k", *fused(nkv)),
         "v": _tensor(g, "v", *fused(nkv))}
    if not backward:
        o, stats = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], is_inference=False,
                          attn_scale=float(scale), use_causal_mask=True)
        o.set_output(True).set_dim(plain[0]).set_stride(plain[1]).set_data_type(bf16)
        stats.set_output(True).set_data_type(fp32)
        t.update(o=o, stats=stats)
    else:
        t["o"], t["do"] = _tensor(g, "o", *plain), _tensor(g, "do", *plain)
        t["stats"] = g.tensor(name="stats", dim=[B, nh, T, 1], stride=[nh * T, T, 1, 1],
                              data_type=fp32)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"],
                                     o=t["o"], dO=t["do"], stats=t["stats"],
                                     attn_scale=float(scale), use_causal_mask=True)
        for name, grad, H in (("dq", dq, nh), ("dk", dk, nkv), ("dv", dv, nkv)):
            grad.set_output(True).set_dim(fused(H)[0]).set_stride(fused(H)[1]).set_data_type(bf16)
            t[name] = grad
    g.validate()
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    space = backend.xp().empty(max(1, g.get_workspace_size()), dtype=np.uint8)
    _graphs[key] = (g, t, space)
    return _graphs[key]


def _run(graph, pointers):
    g, t, space = graph
    g.execute({t[name]: ptr for name, ptr in pointers.items()}, space.data.ptr,
              handle=_handle_on_stream())


def _heads(words, nh, nkv, hs):
    """Device pointers of q, k, v inside a fused (B, T, (nh + 2 nkv) hs) array of words."""
    base = words.data.ptr
    return {"q": base, "k": base + 2 * nh * hs, "v": base + 2 * (nh + nkv) * hs}


def _fwd_launch(k, qkv, nh, nkv, scale):
    B, T, W = qkv.shape
    hs = flash.head_size(W, nh, nkv)
    if not (takes(hs) and B and T):
        return flash.FLASH_FWD["bf16"](qkv, nh, nkv, scale)
    xp = backend.xp()
    words = _words(k, qkv)
    o = xp.empty((B, T, nh * hs), dtype=np.uint16)
    stats = xp.empty((B, nh, T), dtype=np.float32)
    _run(_build(B, T, nh, nkv, hs, scale, False),
         {**_heads(words, nh, nkv, hs), "o": o.data.ptr, "stats": stats.data.ptr})
    return _out(k, o, qkv), stats


def _bwd_launch(k, qkv, y, dy, lse, nh, nkv, scale):
    B, T, W = qkv.shape
    hs = flash.head_size(W, nh, nkv)
    if not (takes(hs) and B and T):
        return flash.FLASH_BWD["bf16"](qkv, y, dy, lse, nh, nkv, scale)
    xp = backend.xp()
    c = xp.ascontiguousarray
    words = _words(k, qkv)
    grads = xp.empty(qkv.shape, dtype=np.uint16)
    stats = c(lse, dtype=np.float32)
    # every array cuDNN reads is held by a name through the call: a pointer taken from a
    # temporary let the pool give y's words' memory to dy's, and cuDNN read dy as y (its
    # self-check refused it on an H200, off by 13.8)
    o, do = _words(k, y), _words(k, dy)
    pointers = {**_heads(words, nh, nkv, hs), "o": o.data.ptr, "do": do.data.ptr,
                "stats": stats.data.ptr}
    pointers.update({"d" + n: p for n, p in _heads(grads, nh, nkv, hs).items()})
    _run(_build(B, T, nh, nkv, hs, scale, True), pointers)
    return _out(k, grads, qkv)


# tolerance: the bf16 kernels' own, and cuDNN writes y and the gradients as bf16 (8 bits)
_fwd_twin, _bwd_twin, _rounding = flash._twins("bf16")
CUDNN_FWD = Fused("cudnn_fwd", gemm._TO_BF16, ["to_bf16", "from_bf16"], _fwd_launch, _fwd_twin,
                  lambda xp, rng, dt: flash._cases(xp, rng, dt),
                  launches=lambda qkv, *_: 1 + 2 * (qkv.dtype == np.float32), tolerance=3e-2,
                  compare=1, dtypes=("float32", "bfloat16"),
                  library="cuDNN's fused attention (nvidia-cudnn-frontend)")
CUDNN_BWD = Fused("cudnn_bwd", gemm._TO_BF16, ["to_bf16", "from_bf16"], _bwd_launch, _bwd_twin,
                  lambda xp, rng, dt: flash._cases(xp, rng, dt, True, _rounding),
                  launches=lambda qkv, *_: 1 + 4 * (qkv.dtype == np.float32),
                  tolerance=5e-2, dtypes=("float32", "bfloat16"),
                  library="cuDNN's fused attention (nvidia-cudnn-frontend)")
