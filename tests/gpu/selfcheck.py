"""Every fused kernel's self-check on the GPU: the worst error against its twin over its
cases, per dtype, and ``fused.refusals()``. Run by tests/gpu/session.sh on a lent GPU;
``python tests/gpu/selfcheck.py norm gelu`` checks only the kernels whose names hold a word.
"""
import sys
import time

from hpcdist.device import backend, fused, kernels  # noqa: F401  (kernels: registers them)


def main(only=tuple(sys.argv[1:])):
    backend.init("gpu")
    print(f"{'kernel':24s} {'dtype':8s} {'worst error':>12s} {'allowed':>8s} {'s':>6s}")
    bad = 0
    for name, op in sorted(fused.registry().items()):
        if only and not any(word in name for word in only):
            continue
        for dt in op.dtypes:
            t0 = time.perf_counter()
            ok = op.self_check(dt)
            try:
                worst = f"{op.worst_error(dt, lambda k, d=None, op=op, dt=dt: op._kernel(dt, k, d)):.2e}"
            except Exception as e:                     # the reason is in refusals()
                worst = type(e).__name__
            bad += not ok
            print(f"{name:24s} {dt:8s} {worst:>12s} {op.tolerance_for(dt):8.0e} "
                  f"{time.perf_counter() - t0:6.2f} {'ok' if ok else 'REFUSED'}", flush=True)
    print("refusals:", fused.refusals())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
