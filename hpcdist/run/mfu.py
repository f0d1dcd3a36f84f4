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
from ..nn import lora
from ..nn.family import count_parameters
from ..nn.moe import moe_layers
from ..plan.facts import HARDWARE  # noqa: F401 (bench gpu uses it too)
from ..plan.model import flops_per_token, layer_windows

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hpcdist", "peak.json")


def model_flops_per_token(model, cfg, seq: int) -> float:
    """``flops_per_token`` of the one logical model (``n_params``: its parameter count)."""
    full = getattr(model, "full", model)
    if lora.adapters(full):       # LoRA: the frozen base's matmuls forward and for the
        base = count_parameters(full.config)       # activations' gradients (4N, no weight
        table = full.part("positions")             # gradients), the adapters' 6N
        base -= table.weight.size if table is not None else 0
        width = full.config.attention_shape().out_width
        return flops_per_token(base, cfg.n_layer, width, seq,
                               layer_windows(full.config)) - 2 * base + \
            6 * full.logical_parameters()
    params = full.logical_parameters()           # (a padded vocabulary's padding: not)
    table = full.part("positions")                        # a learned position table: no
    params -= table.weight.size if table is not None else 0   # matmul (rotary: no table)
    # experts: a token runs through k of each layer's (of those this rank holds, under EP)
    params += sum((m.k - len(m.experts)) * m.expert_size for m in moe_layers(full))
    width = full.config.attention_shape().out_width     # heads x head size
    return flops_per_token(params, cfg.n_layer, width, seq, layer_windows(full.config))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


PROBES, PROBE_S = 5, 0.1     # the best of five 0.1 s GEMM timings: one busy moment is not the peak


def probe(cores: int, dtype=np.float32) -> float:
    """FLOP/s of a 1024^3 GEMM on ``cores`` threads: the best of ``PROBES`` timings."""
    from threadpoolctl import threadpool_limits
    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    best = 0.0
    with threadpool_limits(cores):
        a @ a
        for _ in range(PROBES):
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < PROBE_S:
                a @ a
                reps += 1
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def cpu_peak(cores: int, dtype=np.float32, again: bool = False) -> tuple[float, str]:
    """(FLOP/s of a GEMM on ``cores`` threads, where the number came from): the cached
    number, or a probe's; ``again``: probe anew and keep the larger (a cached number
    measured under load is too low)."""
    key = f"{_cpu_name()} | {cores} cores | {np.dtype(dtype).name}"
    try:
        with open(CACHE) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    said = f"the best of {PROBES} GEMM probes on {cores} cores, kept in {CACHE}"
    if key in cached and not again:
        return float(cached[key]), said
    rate = max(probe(cores, dtype), float(cached.get(key, 0.0)))
    cached[key] = rate
    try:
        os.makedirs(os.path.dirname(CACHE), exist_ok=True)
        with open(CACHE + f".tmp{os.getpid()}", "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(CACHE + f".tmp{os.getpid()}", CACHE)
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


def peak_mode(cfg) -> str:
    """The arithmetic a run's GEMMs use, for its peak: fp32, tf32 (``--tf32`` on fp32), bf16,
    fp16 or fp64 (a tf32 run against the fp32 peak read "MFU 113.43%" on an H100)."""
    if cfg.dtype == "fp64":
        return "fp64"
    if cfg.precision in ("bf16", "fp16"):
        return cfg.precision
    if cfg.precision == "fp8":          # (fp8's values on bf16 GEMMs: bf16's peak until
        return "bf16"                   # cuBLASLt's FP8 GEMM is built)
    return "tf32" if getattr(cfg, "tf32", False) else "fp32"


def gpu_peak(precision: str) -> tuple[float, str]:
    """(dense FLOP/s of this GPU at ``precision`` — fp32, tf32, bf16, fp16; fp64 counts as
    fp32's, no card's fp64 being above it — where from); (0, why) if unknown."""
    name = backend.xp().cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, card in HARDWARE.items():
        if card.name.split()[0] in name:
            if precision == "tf32":         # dense TF32 is half of dense bf16 (A100, H100)
                return card.flops["bf16"] / 2, f"{card.name} tf32 (half the bf16 datasheet)"
            p = "bf16" if precision in ("bf16", "fp16", "fp8") else "fp32"  # (fp8: its
            # values on bf16 GEMMs until cuBLASLt's FP8 GEMM is built)
            return card.flops[p], f"{card.name} {p} datasheet"
    return 0.0, f"no table entry for {name}"


class Meter:
    """MFU of a run: ``peak`` (FLOP/s the hardware offers the whole job; 0 where unknown, as on
    the GPU stand-in) and ``rate`` -> (TFLOP/s, MFU or None) of a step. On a CPU a step past
    ``REPROBE`` of the cached peak probes the peak again once (the cache was measured under
    load) and keeps the larger."""

    REPROBE = 0.9

    def __init__(self, model, cfg, seq: int, world: int, nodes: int, cores_per_node: int):
        self.per_token = model_flops_per_token(model, cfg, seq)
        self.cpu = None
        if backend.device_label() == "standin":
            one, self.source = 0.0, "the GPU stand-in has no peak"
        elif backend.device() == "gpu":
            one, self.source = gpu_peak(peak_mode(cfg))
        else:
            self.cpu = (cores_per_node, np.float64 if cfg.dtype == "fp64" else np.float32)
            one, self.source = cpu_peak(*self.cpu)
        self.per_peak = world if backend.device() == "gpu" else nodes
        self.peak = one * self.per_peak

    def rate(self, tokens_per_s: float) -> tuple[float, float | None]:
        """(TFLOP/s, MFU); MFU is None where the peak is unknown or would be exceeded (a
        peak that a run beats is the wrong peak: it is not reported, never above 100%)."""
        flops = self.per_token * tokens_per_s
        if self.cpu is not None and self.peak and flops / self.peak > self.REPROBE:
            one, _ = cpu_peak(*self.cpu, again=True)
            self.peak = max(self.peak, one * self.per_peak)
            self.cpu = None                           # once a run
        if not self.peak or flops > self.peak:
            return flops / 1e12, None
        return flops / 1e12, flops / self.peak

    def describe(self) -> str:
        if not self.peak:
            return (f"MFU not reported: {self.source} ({self.per_token / 1e6:.3g} MFLOP/token)")
        return (f"MFU against {self.peak / 1e12:.3g} TFLOP/s ({self.source}; "
                f"{self.per_token / 1e6:.3g} MFLOP/token)")
