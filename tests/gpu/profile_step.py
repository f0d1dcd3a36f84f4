"""Two GPT training steps under torch.profiler: the kernel table (CUPTI sees CuPy's kernels
too). ``python tests/gpu/profile_step.py [MODE [LAYERS EMBD SEQ BATCH VOCAB]]`` (default fp32
12 768 256 16 50257). Run by tests/gpu/session.sh on a lent GPU."""
import sys

from torch.profiler import ProfilerActivity, profile

from hpcdist.bench.gpu import _hpcdist_mode
from hpcdist.device import backend


def main(mode=sys.argv[1] if len(sys.argv) > 1 else "fp32",
         shape=tuple(int(a) for a in sys.argv[2:7]) or (12, 768, 256, 16, 50257)):
    backend.init("gpu")
    step, _ = _hpcdist_mode(shape, mode)        # the bench's own step in this mode
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
