"""What a training run says: its header, a progress line per log step, and the final report
(held-out accuracy and loss, memory, MFU) or the line of a run stopped by a signal."""
from __future__ import annotations

from .. import nn

import signal
import time
import warnings

import numpy as np

from ..device import backend, kernels
from ..device.kernels import fp8_gemm
from ..nn.module import padded_length
from ..nn import lora
from ..nn.family import count_parameters
from ..nn.nf4 import NF4
from ..nn.moe import moe_layers
from ..autograd import memtrace
from ..host import signals, threads, timeline
from . import graphed
from .evaluate import evaluate_run
from .preemption import EXIT_PREEMPTED


def header(cfg, model, strategy, world, hosts, train_set, *, test_set) -> list[str]:
    """The run's header: model, task, device, world and layout, precision, the strategy's
    own lines (``describe``), steps."""
    data_size = strategy.batch_comm.size
    lines = strategy.describe()
    layout = f"DP {data_size}" + (f" (EP {cfg.ep} of it)" if cfg.ep > 1 else "") + \
        (f" x CP {cfg.cp} ({cfg.cp_impl})" if cfg.cp > 1 else "") + \
        f" x TP {cfg.tp} x PP {cfg.pp}" + (" (sequence parallel)" if cfg.sequence_parallel else "")
    if strategy.mesh is not None and not strategy.mesh.tp_within_node:
        layout += (" (TP spans nodes: its collectives cross the slow links; place TP groups "
                   "inside a node: --tp dividing the ranks per node)")
    first, _, pipeline = lines[0].partition(" | ") if lines else ("", "", "")
    if pipeline:
        layout += f" | {pipeline}"
    emulated = ""
    why = backend.bf16_why() or "this CuPy has no bfloat16"
    if backend.bf16_emulated():
        emulated = (f" (GEMMs in bf16 on tensor cores, activations fp32: {why})"
                    if backend.device_label() == "gpu" else
                    f" (emulated: matmul operands rounded to bf16, fp32 storage; {why})")
    elif cfg.precision in ("bf16", "fp8") and backend.device_label() != "cpu":
        emulated = " (native: bf16 weights, activations and gradients; fp32 master weights)"
    if cfg.precision == "fp8":
        emulated += (" | fp8: the linear layers' GEMMs on e4m3 operands and e5m2 gradients, "
                     "per-tensor power-of-two scales; " + fp8_gemm.describe())
    if cfg.tf32:
        emulated += " | " + kernels.describe(cfg.tf32)
    emulated += " | " + attention_words(cfg)
    if cfg.cuda_graph != "off":
        emulated += " | " + graphed.describe(cfg, strategy)
    moe = (f", {cfg.experts} experts top-{cfg.top_k} ({cfg.router}"
           f"{', every ' + str(cfg.moe_every) + ' blocks' if cfg.moe_every > 1 else ''})"
           if cfg.experts else "")
    line = (f"hpcdist | {model_words(cfg)}{moe}), "
            f"{parameter_words(model, cfg)}{vocab_words(model, cfg)} | task {cfg.task} "
            f"({len(train_set):,} train / {len(test_set):,} held-out{documents_words(train_set)})"
            f" | device "
            f"{backend.device_label()} | world size {world} on {hosts}: {layout} | BLAS threads "
            f"{threads.choice}{cpu_kernels()} | {cfg.precision}{emulated} | {first} | "
            f"{cfg.steps} steps x batch {cfg.batch_size} x {data_size} replicas"
            + (f" x {cfg.grad_accum} accum" if cfg.grad_accum > 1 else ""))
    return [line] + lines[1:] + comm_paths(cfg, strategy)


def documents_words(train_set) -> str:
    """What a run on instruction data says of its rows and its loss ("" for plain text)."""
    if not getattr(train_set, "masked", False):
        return ""
    cut = getattr(train_set, "truncated", 0)
    cut = f", {cut:,} truncated to the block" if cut else ""
    if getattr(train_set, "packed", False):
        rows = (f"; documents packed best-fit into rows{cut}, each attending to itself: "
                f"padding {train_set.padding:.1%} (a row each: "
                f"{train_set.unpacked_padding:.1%})")
    else:
        rows = f"; a padded row per document{cut}"
    return rows + "; the loss per trained token"


def vocab_words(model, cfg) -> str:
    """", vocabulary 50,257 padded to 50,304 rows" where the table is padded (--vocab-multiple;
    under tensor parallelism to a multiple of it times tp)."""
    c = getattr(model, "full", model).config
    unit = getattr(c, "vocab_multiple", 1) * cfg.tp
    if c.vocab_size % unit == 0:
        return ""
    return f", vocabulary {c.vocab_size:,} padded to {padded_length(c.vocab_size, unit):,} rows"


def model_words(cfg) -> str:
    """The family and its shape, as the header opens: "Llama 2x64 (4 heads, 2 kv heads"
    (the family's own words: nn/<family>.py's describe)."""
    family = nn.family(cfg.arch)
    cfg_ = nn.config_of(cfg, vocab_size=1, vocab_multiple=1)
    return f"{family.title} {cfg_.describe()}"


def attention_words(cfg) -> str:
    """The header's word on attention: which way, in which arithmetic."""
    way = {"auto": "auto (the fastest way that runs, measured on the first step's shape; the "
                   "run's end says which)", "flash": "flash (tiled)",
           "gemms": "gemms (cuBLAS around the fused softmax)", "cudnn": "cuDNN's fused"}
    if cfg.dropout > 0:                   # (nn/attention.py: the tiled kernels have none)
        return ("attention op by op (dropout on the probabilities keeps them, T x T a head; "
                "--dropout 0 runs it tiled)")
    if backend.device_label() != "gpu":
        return "attention flash (tiled" + (", numba + BLAS)" if backend.device_label() == "cpu"
                                            else ")")
    kind = kernels.attention.kind(np.float64 if cfg.dtype == "fp64" else np.float32)
    return f"attention {way[cfg.attention]}, flash kernels {kind}"


def cpu_kernels() -> str:
    """The CPU kernels' part of the header (on the CPU only)."""
    if backend.device_label() != "cpu":
        return ""
    from ..device.kernels import cpu
    return f" | CPU kernels {cpu.describe()}"


def comm_paths(cfg, strategy) -> list[str]:
    """Which path each group's device arrays take, under --backend nccl."""
    if cfg.backend != "nccl":
        return []
    mesh = strategy.mesh
    groups = ["dp"] + ([f"{a} {getattr(mesh, a)}" for a in ("tp", "pp", "cp")
                       if getattr(mesh, a) > 1] if mesh is not None else [])
    return [f"comm: NCCL carries the device arrays of every group ({', '.join(groups)}: "
            "collectives, and point-to-point batched into NCCL groups); host values "
            "(losses, norms, flags), agreement and point-to-point headers go over MPI"]


def progress_line(rec: dict, steps: int, eta: float) -> str:
    flops = f" | {rec['tflops']:.3g} TFLOP/s" if "tflops" in rec else ""
    flops += f", MFU {rec['mfu'] * 100:.2f}%" if rec.get("mfu") is not None else ""
    if "moe_load" in rec:                  # the busiest expert over the mean, drops this step
        flops += f" | experts max/mean {rec['moe_load']:.2f}, {rec['moe_dropped']:,} dropped"
    return (f"step {rec['step']:5d}/{steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
            f"{rec['tokens_per_s']:,.0f} tok/s | {rec['step_ms']:.1f} ms/step{flops} | "
            f"{rec['bytes_sent'] / 1024:,.0f} KiB sent | ETA {eta:.0f} s")


def stopped_report(cfg, stopped: int, step: int, start: int, world: int, t_start: float,
                   *, say) -> dict:
    name = signal.Signals(stopped).name
    code = exit_code(stopped)
    if step > start and cfg.save_dir:
        say(f"stopped after step {step} of {cfg.steps} on {name}: the checkpoint above "
            f"holds the run; exit code {code} (" + ("the job script requeues, " if code ==
                                                     EXIT_PREEMPTED else "")
            + "--resume continues)")
    elif step > start:
        say(f"stopped after step {step} of {cfg.steps} on {name}; nothing saved (no "
            f"--save-dir); exit code {code}")
    return {"event": "preempted", "step": step, "signal": name, "steps": cfg.steps,
            "world": world, "seconds": time.perf_counter() - t_start}


def exit_code(signum: int) -> int:
    """A stopped run's exit code: 130 after Ctrl-C, as a shell reports it; 75 (requeue)
    after the scheduler's SIGTERM or SIGUSR1."""
    return signals.EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def with_frozen(memory: dict, model) -> dict:
    """``memory`` with a LoRA run's frozen base on this rank (its shards, its stage's
    blocks), in bytes as held: NF4's 4-bit form."""
    held = lora.frozen(model)
    if not held:
        return memory
    frozen = sum(t.nbytes if isinstance(t, NF4) else t.data.nbytes for _, t in held)
    out = {k: v for k, v in memory.items() if k != "total"}
    return dict(out, frozen=frozen, total=memory["total"] + frozen)


def final_report(run, history: list, t_start: float, train_bytes: int) -> dict:
    """Held-out accuracy and loss, memory, the run's totals (collective: evaluation).
    ``run``: loop.Run."""
    cfg, model, strategy, test_set, say = run.cfg, run.model, run.strategy, run.test_set, \
        run.say
    world = run.comm.size
    trained = time.perf_counter() - t_start
    with strategy.eval_context(), timeline.span("evaluate"):
        accuracy, test_loss, tokens = evaluate_run(cfg, model, test_set, strategy.batch_comm)
    evaluated = time.perf_counter() - t_start - trained
    ran = max(len(history), 1)          # this rank's steps (a PS worker's own count)
    step_ms = [r["step_ms"] for r in history]
    final = {"event": "final", "accuracy": float(accuracy), "test_loss": float(test_loss),
             "eval_tokens": tokens,
             "train_loss": history[-1]["loss"] if history else float("nan"),
             "steps": cfg.steps, "world": world, "seconds": time.perf_counter() - t_start,
             "train_seconds": trained, "eval_seconds": evaluated,
             "skipped_steps": strategy.scaler.skipped,
             "bytes_per_step": train_bytes / ran,
             "step_ms_median": float(np.median(step_ms)) if step_ms else 0.0,
             "memory_peak": with_frozen(strategy.peak_memory(), model),  # within any step
             "memory_state": with_frozen(strategy.memory(), model)}       # between steps
    say("model state per rank, MiB (peak within a step): "
        + ", ".join(f"{k} {v / 2 ** 20:.3f}" for k, v in final["memory_peak"].items()))
    held = memtrace.most()
    if held:
        final["memory_activations"] = held
        say(f"activations per rank, MiB (--trace-memory; the most in a step after the first): "
            f"held by the graph {held['activations'] / 2 ** 20:.3f}, everything above the "
            f"model state {held['peak'] / 2 ** 20:.3f}")
    rates = [r["mfu"] for r in history if r.get("mfu") is not None]
    if rates:
        final["mfu_median"] = float(np.median(rates))
        final["tflops_median"] = float(np.median([r["tflops"] for r in history]))
        say(f"model FLOP/s (median step): {final['tflops_median']:.3g} TFLOP/s, MFU "
            f"{final['mfu_median'] * 100:.2f}%")
    what = "exact-match" if cfg.task != "text" else "next-char" if \
        getattr(test_set, "vocabulary", {}).get("kind") == "chars" else "next-token"
    say(f"held-out accuracy ({what}): {accuracy * 100:.2f}% | held-out loss "
        f"{test_loss:.4f} | {tokens:,} tokens scored in {evaluated:.1f} s | run "
        f"{final['seconds']:.1f} s")
    return final


def parameter_words(model, cfg) -> str:
    """"N parameters", or under LoRA the base's and the adapters' counts."""
    full = getattr(model, "full", model)
    adapted = lora.adapters(full)
    if not adapted:
        return f"{cfg_parameters(model, cfg):,} parameters"
    a = adapted[0][1]
    packed = [t for _, t in lora.frozen(full) if isinstance(t, NF4)]
    bits = sum(t.nbytes for t in packed) * 8 / max(sum(t.size for t in packed), 1)
    nf4 = f" ({len(packed)} block weights in NF4, {bits:.2f} bits each)" if packed else ""
    return (f"{count_parameters(full.config):,} parameters frozen{nf4}, "
            f"{cfg_parameters(model, cfg):,} trained (LoRA rank {a.r}, scale "
            f"{a.scale:g}, on {len(adapted)} linears)")


def cfg_parameters(model, cfg) -> int:
    """Parameters of the one logical model (a tensor-parallel rank holds only its shards)."""
    full = getattr(model, "full", model)          # a pipeline stage: the whole model's count
    if cfg.ep > 1:                                # an EP rank holds 1/ep of the experts
        return full.logical_parameters() + sum((m.E - len(m.experts)) * m.expert_size
                                               for m in moe_layers(full))
    return full.logical_parameters()


def quiet_overflows() -> None:
    """A diverging run's overflows are NumPy's warnings on every rank, every step: the loss
    check (``Diverged``) says it once, from rank 0, naming the step."""
    warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) encountered",
                            RuntimeWarning)


class Diverged(FloatingPointError):
    """The mean loss became non-finite: every rank raises it at the same step (the mean is
    theirs alike), before any save of that step."""


class Unread:
    """The steps whose loss and gradient norm are still on the device, read together at log
    steps (and before a save or the end): one wait for the device and one collective for
    several steps, none inside a step. On a GPU a step's time is then the interval's mean
    (its kernels run after the host has moved on); on the CPU each step keeps its own.
    ``settle`` reads them without writing: under --on-failure shrink every step's record is
    settled after the step (``meaned``: its loss is already the replicas' mean, read before
    the step was committed), so that the records of committed steps outlive a lost rank."""

    def __init__(self, strategy, meter, metrics, meaned: bool = False):
        self.strategy, self.meter, self.metrics = strategy, meter, metrics
        self.meaned = meaned
        self.records: list = []
        self.settled: list = []                   # read, not yet written
        self.restart_clock()

    def restart_clock(self) -> None:
        self.t0 = time.perf_counter()

    def add(self, rec: dict) -> None:
        self.records.append(rec)

    def settle(self) -> None:
        """Read the pending records' losses and norms (one device read, and one collective
        for their mean over the replicas unless it was taken in the step)."""
        recs, self.records = self.records, []
        if not recs:
            return
        host = backend.host_values([r["loss"] for r in recs] + [
            0.0 if r["grad_norm"] is None else r["grad_norm"] for r in recs])   # one read
        losses, norms = host[:len(recs)], host[len(recs):]
        if not self.meaned:
            losses = self.strategy.mean_losses(list(losses))
        if backend.device() == "gpu":             # the interval, now that the device is done
            backend.synchronize()
            ms = (time.perf_counter() - self.t0) * 1e3 / len(recs)
            for r in recs:
                r["tokens_per_s"] *= r["step_ms"] / ms
                r["step_ms"] = ms
        self.restart_clock()
        for r, loss, norm in zip(recs, losses, norms):
            r["loss"] = float(loss)
            r["grad_norm"] = None if r["grad_norm"] is None else float(norm)
            if self.meter is not None:
                r["tflops"], mfu = self.meter.rate(r["tokens_per_s"])
                if mfu is not None:
                    r["mfu"] = mfu
        self.settled += recs
        scaler = getattr(self.strategy, "scaler", None)
        skips = scaler is not None and scaler.enabled   # (fp16 skips a step of inf gradients)
        alike = getattr(self.strategy, "norm_is_global", True) and not skips   # (DiLoCo's: a
        for r in recs:                                               # group's, not agreed)
            if not np.isfinite(r["loss"]) or (
                    alike and r["grad_norm"] is not None and not np.isfinite(r["grad_norm"])):
                self.write()
                what = "loss" if not np.isfinite(r["loss"]) else "gradient's norm"
                raise Diverged(f"the {what} became {r['loss' if what == 'loss' else 'grad_norm']}"
                               f" at step {r['step']}: the run diverged (lower --lr, or raise "
                               "--warmup)")

    def read(self) -> None:
        """Settle the pending records and write every settled one to metrics.jsonl."""
        self.settle()
        self.write()

    def write(self) -> None:
        recs, self.settled = self.settled, []
        if self.metrics is not None and recs:
            for r in recs:
                self.metrics.record(r)
            self.metrics.flush()


def inter_node(cfg, comm, strategy, start: int) -> float:
    """The bytes every rank sent across nodes since ``start`` (this rank's count), summed
    where every rank runs the loop (a parameter server runs its own)."""
    inter = getattr(strategy.comm, "bytes_inter_node", 0) - start
    return inter if cfg.strategy == "ps" else \
        comm.allreduce(np.array([inter], dtype=np.float64))[0]
