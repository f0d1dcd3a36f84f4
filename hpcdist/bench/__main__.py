"""Benchmarks, one command each: ``python -m hpcdist.bench <name> [options]``."""
import importlib
import sys

BENCHMARKS = {
    "arch": "hpcdist.bench.arch",
    "attention": "hpcdist.bench.attention",
    "autograd": "hpcdist.bench.autograd",
    "checkpoint": "hpcdist.bench.checkpoint",
    "collectives": "hpcdist.bench.collectives",
    "compression": "hpcdist.bench.compression",
    "cp": "hpcdist.bench.cp",
    "ddp": "hpcdist.bench.ddp",
    "diloco": "hpcdist.bench.diloco",
    "exchange": "hpcdist.bench.exchange",
    "nccl": "hpcdist.bench.nccl",
    "moe": "hpcdist.bench.moe",
    "nanogpt": "hpcdist.bench.nanogpt",
    "gpu": "hpcdist.bench.gpu",
    "kernels": "hpcdist.bench.kernels",
    "lora": "hpcdist.bench.lora",
    "peers": "hpcdist.bench.peers",
    "pipeline": "hpcdist.bench.pipeline",
    "plan": "hpcdist.bench.plan",
    "plot": "hpcdist.bench.plot",
    "recovery": "hpcdist.bench.recovery",
    "schedule": "hpcdist.bench.schedule",
    "sft": "hpcdist.bench.sft",
    "shards": "hpcdist.bench.shards",
    "tp": "hpcdist.bench.tp",
    "slowlinks": "hpcdist.bench.slowlinks",
    "twolevel": "hpcdist.bench.twolevel",
    "zero": "hpcdist.bench.zero",
}


TORCH_IN_PROCESS = {"autograd", "attention"}      # PyTorch timed beside hpcdist, one process


def _torch_first() -> None:
    """PyTorch, where installed, loaded before hpcdist's MKL (host/blas.py): PyTorch's own
    MKL, linked into it, takes the sequential layer that hpcdist sets when hpcdist's loads
    first, and a peer timed in this process would run on one thread (a 1024 x 384 x 4096
    GEMM: 13 -> 23 ms on 2 threads). Loaded first, each keeps its own."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m hpcdist.bench {" + ",".join(BENCHMARKS) + "} [options]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if "--worker" not in argv:               # (a worker is a rank of the bench's own job)
        from hpcdist.bench.common import exit_on_sigterm
        exit_on_sigterm()
    if argv[0] in TORCH_IN_PROCESS:
        _torch_first()
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
