"""One GPT 12x768, T 256, batch 16 fp32 training step under torch.profiler: the kernel table
(CUPTI sees CuPy's kernels too). Run by tests/gpu/session.sh on a lent GPU."""
import sys

from torch.profiler import ProfilerActivity, profile

from hpcdist.bench.gpu import _step_fn
from hpcdist.device import backend


def main(batch=16, mode=sys.argv[1] if len(sys.argv) > 1 else "fp32"):
    backend.init("gpu")
    if mode == "bf16":
        backend.compute_dtype("bf16")
    step, _ = _step_fn(12, 768, 256, batch, 50257)
    for _ in range(3):
        step()
    backend.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(2):
            step()
        backend.synchronize()
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))


if __name__ == "__main__":
    main()
