"""``--gpu cpu``: a cluster of CPU nodes like this one, each of ``--gpus`` ranks a share of a
node's cores (``--gpus-per-node`` ranks a node). A rank's peak is a GEMM's measured on this
machine with its share of the cores (run/mfu.py's probe, kept in its cache), in fp32 (bf16 on
a CPU is emulated: the planner plans fp32); a rank's memory is this host's available memory
over the ranks a node holds (``--memory-gb`` a rank instead); the links are shared memory
inside a node and the network between nodes, at ``--nvlink-gbs`` / ``--network-gbs`` where
given, else 5 GB/s and 1.25 GB/s (10 GbE) a rank. The command it prints runs on
``--device cpu`` (jobs/train-cpu.sbatch across nodes)."""
from __future__ import annotations

from .facts import GB, GPU

SHARED_MEMORY_GBS = 5.0      # a rank's copy bandwidth through MPI's shared memory (assumed)
NETWORK_GBS = 1.25           # 10 GbE a rank (assumed; --network-gbs to set)


def target(args) -> GPU:
    """The CPU rank of ``args`` (the planner's command line) as the planner's card."""
    from ..host import meminfo, threads
    from ..run.mfu import cpu_peak
    cores = max(1, threads.usable_cores() // max(1, args.gpus_per_node))
    rate, _ = cpu_peak(cores)
    memory = args.memory_gb * GB if args.memory_gb else \
        (meminfo.host_available() or 8 * GB) / max(1, args.gpus_per_node)
    return GPU(f"CPU ranks ({cores} core{'s' if cores > 1 else ''} each, {rate / 1e12:.2f} "
               "TFLOP/s fp32 measured here)", {"fp32": rate}, memory,
               (args.nvlink_gbs or SHARED_MEMORY_GBS) * GB,
               (args.network_gbs or NETWORK_GBS) * GB, nvlink_alpha=2e-6, network_alpha=30e-6)
