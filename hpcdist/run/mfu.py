"""Model FLOPs utilisation: the run's model FLOP/s against the hardware's peak.

FLOPs per token are counted as the peers count them and as the planner does
(``plan.flops_per_token``: 6N + 12 L d T, N without the position table). The peak: a GPU's
from the planner's table by its name and the run's precision (dense tensor-core numbers for
fp16/bf16, fp32's for fp32); a CPU's measured once by a GEMM probe on all of a node's cores
and cached in ``~/.cache/hpcdist/peak.json`` by processor, cores and dtype (the header says
which). The run's MFU is its model FLOP/s over all ranks / (the peak per node x nodes) on
CPUs, / (the peak per GPU x ranks) on GPUs.
"""
from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

from ..device import backend
from ..plan import HARDWARE, flops_per_token  # noqa: F401 (bench gpu uses it too)

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hpcdist", "peak.json")


def model_flops_per_token(model, cfg, seq: int) -> float:
    """``flops_per_token`` of the one logical model (``n_params``: its parameter count)."""
    full = getattr(model, "full", model)
    params = sum(p.size * (cfg.tp if spec else 1) for _, p, spec in full.named_specs()) \
        if cfg.tp > 1 else full.num_parameters()
    params -= full.wpe.weight.size                        # the position table: no matmul
    return flops_per_token(params, cfg.n_layer, cfg.n_embd, seq)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak(cores: int, dtype=np.float32) -> tuple[float, str]:
    """(FLOP/s of a GEMM on ``cores`` threads, where the number came from)."""
    key = f"{_cpu_name()} | {cores} cores | {np.dtype(dtype).name}"
    try:
        with open(CACHE) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    said = f"a GEMM probe on {cores} cores, kept in {CACHE}"
    if key in cached:
        return float(cached[key]), said
    from threadpoolctl import threadpool_limits
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    with threadpool_limits(cores):
        a @ a
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            a @ a
            reps += 1
        rate = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    cached[key] = rate
    try:
        os.makedirs(os.path.dirname(CACHE), exist_ok=True)
        with open(CACHE + ".tmp", "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(CACHE + ".tmp", CACHE)
    except OSError:
        pass
    return rate, said


def probe_before_mpi(cfg) -> None:
    """Fill the CPU peak's cache before the ranks start talking: MPICH's waiting ranks spin
    on the cores, and a probe run beside them measured half the machine. The node's local
    rank 0 probes; the others sleep until it has written the number (10 s at most)."""
    if cfg is None or cfg.device == "gpu":
        return
    from ..host import threads
    cores, dt = threads.usable_cores(), np.float64 if cfg.dtype == "fp64" else np.float32
    key = f"{_cpu_name()} | {cores} cores | {np.dtype(dt).name}"
    if backend.env_local_rank() == 0:
        cpu_peak(cores, dt)
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(CACHE) as f:
                if key in json.load(f):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)


def gpu_peak(precision: str) -> tuple[float, str]:
    """(dense FLOP/s of this GPU at ``precision``, where from); (0, why) if unknown."""
    name = backend.xp().cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, card in HARDWARE.items():
        if card.name.split()[0] in name:
            if precision == "tf32":         # dense TF32 is half of dense bf16 (A100, H100)
                return card.flops["bf16"] / 2, f"{card.name} tf32 (half the bf16 datasheet)"
            p = "bf16" if precision in ("bf16", "fp16") else "fp32"
            return card.flops[p], f"{card.name} {p} datasheet"
    return 0.0, f"no table entry for {name}"


class Meter:
    """MFU of a run: ``peak`` (FLOP/s the hardware offers the whole job) and ``rate`` ->
    (TFLOP/s, MFU) of a step."""

    def __init__(self, model, cfg, seq: int, world: int, nodes: int, cores_per_node: int):
        self.per_token = model_flops_per_token(model, cfg, seq)
        if backend.device() == "gpu":
            one, self.source = gpu_peak(cfg.precision)
            self.peak = one * world
        else:
            dt = np.float64 if cfg.dtype == "fp64" else np.float32
            one, self.source = cpu_peak(cores_per_node, dt)
            self.peak = one * nodes

    def rate(self, tokens_per_s: float) -> tuple[float, float]:
        flops = self.per_token * tokens_per_s
        return flops / 1e12, (flops / self.peak if self.peak else 0.0)

    def describe(self) -> str:
        return (f"MFU against {self.peak / 1e12:.3g} TFLOP/s ({self.source}; "
                f"{self.per_token / 1e6:.3g} MFLOP/token)")
