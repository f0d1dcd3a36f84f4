"""cuDNN's attention backward taken apart, for a GPU lease: per self-check case (batch, T,
heads, kv heads, head size), the worst error of dq, dk and dv apart against the bf16 flash
twin, for ways of calling it: as cudnn_attention.py does (gradients into one fused array,
the twin's log-sum-exp), with the gradient array zeroed first (a part cuDNN never writes
shows), with the statistics of cuDNN's own forward, and with each gradient in its own
[B, H, T, hs] array. ``python tests/gpu/cudnn_probe.py`` (tests/gpu/session.sh's setup)."""
import numpy as np

from hpcdist.device import backend, fused, kernels
from hpcdist.device.kernels import cudnn_attention as cd, flash, gemm


def _kernel(name):
    return cd.CUDNN_BWD._kernel("float32", name)


def _graph(B, T, nh, nkv, hs, scale, own_layout):
    """The backward graph, its gradients in the fused layout or each in [B, H, T, hs]."""
    import cudnn
    fp32, bf16 = cudnn.data_type.FLOAT, cudnn.data_type.BFLOAT16
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32,
                      handle=cd._handle_on_stream())
    W = (nh + 2 * nkv) * hs
    fused_ = lambda H: ([B, H, T, hs], [T * W, hs, W, 1])                 # noqa: E731
    own = lambda H: ([B, H, T, hs], [H * T * hs, T * hs, hs, 1])          # noqa: E731
    plain = ([B, nh, T, hs], [T * nh * hs, hs, nh * hs, 1])
    t = {n: cd._tensor(g, n, *fused_(H)) for n, H in (("q", nh), ("k", nkv), ("v", nkv))}
    t["o"], t["do"] = cd._tensor(g, "o", *plain), cd._tensor(g, "do", *plain)
    t["stats"] = g.tensor(name="stats", dim=[B, nh, T, 1], stride=[nh * T, T, 1, 1],
                          data_type=fp32)
    grads = g.sdpa_backward(name="bwd", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                            stats=t["stats"], attn_scale=float(scale), use_causal_mask=True)
    for name, grad, H in zip(("dq", "dk", "dv"), grads, (nh, nkv, nkv)):
        dims = own(H) if own_layout else fused_(H)
        grad.set_output(True).set_dim(dims[0]).set_stride(dims[1]).set_data_type(bf16)
        t[name] = grad
    g.validate()
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    space = backend.xp().zeros(max(1, g.get_workspace_size()), dtype=np.uint8)
    return g, t, space


def _errors(want, got):
    return " ".join(f"{n} {fused._error(backend.to_numpy(w), backend.to_numpy(g)):8.2e}"
                    for n, w, g in zip(("dq", "dk", "dv"), want, got))


def _split(d, nh, nkv, hs):
    B, T, _ = d.shape
    q, k, v = flash._split(d, nh, nkv)
    return [a.reshape(B, T, -1) for a in (q, k, v)]


def main():
    backend.init("gpu")
    import cudnn
    print("cuDNN", cudnn.backend_version(), "frontend", getattr(cudnn, "__version__", "?"))
    xp = backend.xp()
    rng = np.random.default_rng(0)
    fwd, bwd, rounding = flash._twins("bf16")
    for B, T, nh, nkv, hs in flash.CASES:
        if not cd.takes(hs):
            continue
        scale = 1.0 / hs ** 0.5
        qkv = xp.asarray(rng.standard_normal((B, T, (nh + 2 * nkv) * hs)).astype(np.float32))
        y, lse = fwd(qkv, nh, nkv, scale)
        dy = xp.asarray(rng.standard_normal(y.shape).astype(np.float32))
        want = _split(bwd(qkv, y, dy, lse, nh, nkv, scale), nh, nkv, hs)
        _, own_stats = cd._fwd_launch(_kernel, qkv, nh, nkv, scale)
        print(f"case B {B} T {T} nh {nh} nkv {nkv} hs {hs}: cuDNN's stats vs the twin's lse "
              f"{float(abs(own_stats - lse).max()):.2e}", flush=True)
        words = gemm._to_bf16(_kernel, qkv)
        o = gemm._to_bf16(_kernel, xp.ascontiguousarray(y))
        do = gemm._to_bf16(_kernel, dy)
        for label, stats, zero, own in (("as is", lse, False, False),
                                        ("zeroed", lse, True, False),
                                        ("own stats", own_stats, True, False),
                                        ("own layout", lse, True, True)):
            try:
                g, t, space = _graph(B, T, nh, nkv, hs, scale, own)
                st = xp.ascontiguousarray(stats, dtype=np.float32)
                ptr = {**cd._heads(words, nh, nkv, hs), "o": o.data.ptr, "do": do.data.ptr,
                       "stats": st.data.ptr}
                if own:
                    outs = [(xp.zeros if zero else xp.empty)((B, H, T, hs), dtype=np.uint16)
                            for H in (nh, nkv, nkv)]
                    ptr.update({n: a.data.ptr for n, a in zip(("dq", "dk", "dv"), outs)})
                else:
                    grads = (xp.zeros if zero else xp.empty)(qkv.shape, dtype=np.uint16)
                    ptr.update({"d" + n: p for n, p in cd._heads(grads, nh, nkv, hs).items()})
                g.execute({t[n]: p for n, p in ptr.items()}, space.data.ptr,
                          handle=cd._handle_on_stream())
                backend.synchronize()
                if own:
                    got = [gemm._from_bf16(_kernel, a).transpose(0, 2, 1, 3).reshape(B, T, -1)
                           for a in outs]
                else:
                    got = _split(gemm._from_bf16(_kernel, grads), nh, nkv, hs)
                print(f"  {label:10s} {_errors(want, got)}", flush=True)
            except Exception as e:
                print(f"  {label:10s} {type(e).__name__}: {str(e)[:160]}", flush=True)
    print("refused:", fused.refusals())


if __name__ == "__main__":
    kernels.configure(False)
    main()
