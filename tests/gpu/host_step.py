"""The host's share of a training step on a lent GPU. GPT 12 layers at a shape whose GPU work
is negligible (C 64, T 16, batch 2): the step's wall time is what Python, hpcdist and CuPy
spend issuing it. Prints ms a step, the launches of the same step (counted on the standin
GPU) and so the host's microseconds a launch, then the functions that spend it (cProfile,
by own time). ``python tests/gpu/host_step.py [MODE ...]`` (default fp32 bf16); run by
tests/gpu/session.sh. On 2026-11-27 (H200) the 12x768 T 256 step took 22.6 ms in bf16 for
about 13.5 ms of kernels: host-bound."""
import cProfile
import io
import pstats
import sys

from hpcdist.bench.gpu import _hpcdist_mode, count
from hpcdist.bench.gpu_peers import timed
from hpcdist.device import backend

SHAPE = (12, 64, 16, 2, 128, 4)          # layers, embd, seq, batch, vocab, heads


def host_ms(mode: str, steps: int = 30):
    """(ms a step, the cProfile text of 10 more) of the tiny step in ``mode`` on the GPU."""
    step, _ = _hpcdist_mode(SHAPE, mode)
    ms = timed(step, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    backend.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    return ms, text.getvalue()


def main(modes=tuple(sys.argv[1:]) or ("fp32", "bf16")):
    backend.init("gpu")
    results = {mode: host_ms(mode) for mode in modes}
    launches = count(*SHAPE, which=tuple((f"fused {m}", "1", "bf16" if m == "bf16" else "fp32")
                                         for m in modes))
    for mode, (ms, text) in results.items():
        n = launches[f"fused {mode}"]
        print(f"{mode}: {ms:.2f} ms a step on the host, {n} launches: "
              f"{ms * 1e3 / max(n, 1):.1f} us a launch")
    for mode, (_, text) in results.items():
        print(f"---- {mode}: where the host's time goes (10 steps, by own time)\n{text}")


if __name__ == "__main__":
    main()
