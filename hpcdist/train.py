"""Train a GPT over MPI ranks: ``mpirun -n 8 python -m hpcdist.train [--tp 2] [--zero 1]``.

Distributed state is decided once, here: the communicator, this rank's device, the strategy
(data parallel, ZeRO, tensor parallel: ``parallel/strategy.py``), the data shard and the seed.
Every rank checks the settings before any work; a bad setting ends every rank with one line on
stderr and exit code 2. Rank 0 prints a header, a progress line every ``log_every`` steps and
the held-out accuracy, and writes every step to ``out_dir/metrics.jsonl``. An exception on any
rank ends the whole job with that rank's traceback (comm.abort); a rank that stalls is named by
the watchdog (comm.watchdog).
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
import time

import numpy as np

from . import backend, checkpoint, data, optim, runtime, signals, threads, timeline
from .comm import Communicator, abort, watchdog
from .comm.model import fit_alpha_beta
from .config import ConfigError, TrainConfig, checkpoint_meta, parse_config, validate_world
from .evaluate import evaluate
from .parallel import state
from .parallel.strategy import DataParallelStep, build_strategy
from .preemption import EXIT_PREEMPTED, StopRequest

__all__ = ["TrainConfig", "ConfigError", "parse_config", "train", "main", "evaluate",
           "EXIT_PREEMPTED", "DataParallelStep"]


def prepare(cfg: TrainConfig, comm):
    """Everything a run needs from disk, checked before any work: the (train, test) datasets
    (validated against the world size) and the verified checkpoint to resume from, if any.
    Raises ConfigError, CheckpointError or OSError on this rank only."""
    datasets = data.make_task(cfg.task, length=cfg.length, num_digits=cfg.num_digits,
                              data=cfg.data or None, block_size=cfg.block_size,
                              encoding=cfg.data_encoding)
    validate_world(cfg, comm.size, len(datasets[0]))
    if not cfg.resume:
        return datasets, None
    folder, note = checkpoint.find_resume(cfg.save_dir)
    if folder is None:
        return datasets, (None, note, None)
    reader = checkpoint.Reader(folder)
    checkpoint.check_meta(reader.manifest, checkpoint_meta(cfg), folder)
    return datasets, (folder, note, reader)


def build(cfg: TrainConfig, comm, datasets):
    """(model, training step) for this rank over prepared datasets (strategy.build_strategy)."""
    return build_strategy(cfg, comm, datasets[0])


def train(cfg: TrainConfig, comm=None, log=print, probe_cosine: bool = False,
          prepared=None) -> dict:
    """Train on every rank of ``comm``; return the final metrics (the same on every rank).

    ``prepared``: what ``prepare`` returned (main checks it before any work); made here if
    not given. ``probe_cosine`` (benchmarks): also measure each step's cosine similarity
    between the averaged gradient and the dense average. With ``cfg.save_dir``, SIGUSR1/SIGTERM
    save a checkpoint and stop the run early: the result then has ``"event": "preempted"``.
    """
    comm = comm or Communicator()
    recorder = clocks = alpha_beta = None
    if cfg.trace or cfg.comm_log:
        recorder, clocks = timeline.Recorder(comm.rank), timeline.ClockSync()
        clocks.measure(comm.mpi)
        if cfg.comm_log:
            alpha_beta = fit_alpha_beta(comm.mpi, big=4 << 20)
        timeline.activate(recorder)
    # main() decided what signals mean before anything could be signalled; a library caller
    # gets checkpoint-on-signal for the duration of this call.
    ours = bool(cfg.save_dir) and signals.mode() == signals.EXIT \
        and signals.checkpoint_on_signal()
    watching = bool(cfg.save_dir) and signals.mode() == signals.STOP
    try:
        final = _run(cfg, comm, log, probe_cosine, prepared,
                     StopRequest() if watching else None)
    finally:
        if ours:
            signals.exit_on_signal()
        timeline.deactivate()
    if recorder is not None:
        runtime.report_timeline(cfg, comm, recorder, clocks, alpha_beta, log)
    return final


def _run(cfg, comm, log, probe_cosine, prepared, stop) -> dict:
    rank, world = comm.rank, comm.size
    device = backend.init(cfg.device, comm.local_rank)
    (train_set, test_set), resume = prepared if prepared is not None else prepare(cfg, comm)
    model, step_fn = build_strategy(cfg, comm, train_set)
    data_comm = step_fn.data_comm                  # tensor-parallel ranks read the same batch
    sampler = data.DistributedSampler(len(train_set), cfg.batch_size, data_comm.rank,
                                      data_comm.size, seed=cfg.seed)
    xp = backend.xp()
    is_main = rank == 0
    say = log if is_main else (lambda *a, **k: None)
    start = 0
    if resume is not None:
        folder, note, reader = resume
        if folder is not None:
            extra = state.restore_checkpoint(reader, cfg, comm, step_fn, sampler)
            start = reader.step
            note += f" at step {start}" + (f" ({extra})" if extra else "")
        say(note)
    hosts = runtime.record_ranks(comm, cfg.out_dir)
    runtime.test_hooks(rank, "start")
    metrics = runtime.open_metrics(cfg.out_dir, resumed=start > 0, say=say) if is_main else None
    layout = f"DP {data_comm.size} x TP {cfg.tp} x PP {cfg.pp}" + (
        " (sequence parallel)" if cfg.sequence_parallel else "") + (
        f" | {cfg.schedule}, {step_fn.m} micro-batches" + (
            f", {cfg.virtual_stages} virtual stages" if cfg.virtual_stages > 1 else "")
        if cfg.pp > 1 else "")
    say(f"hpcdist | GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), "
        f"{cfg_parameters(model, cfg):,} parameters | task {cfg.task} "
        f"({len(train_set):,} train / {len(test_set):,} held-out) | device {device} | "
        f"world size {world} on {hosts}: {layout} | BLAS threads {threads.choice} | "
        f"{cfg.precision}" + (" (emulated: matmul operands rounded to bf16, fp32 storage; "
                              "this CuPy has no bfloat16)" if backend.bf16_emulated() else "")
        + " | " + (f"ZeRO stage {cfg.zero} | " if cfg.zero else
                                 f"compress {cfg.compress} | ")
        + f"{cfg.steps} steps x batch {cfg.batch_size} x {data_comm.size} replicas"
        + (f" x {cfg.grad_accum} accum" if cfg.grad_accum > 1 else ""))
    if cfg.zero:
        say(f"ZeRO stage {cfg.zero}: rank 0 holds elements [{step_fn.lo}, {step_fn.hi}) of "
            f"{step_fn.L:,}; padding to equal shards would add {step_fn.padding} "
            f"(the last shards are shorter instead)")
    tokens_per_step = cfg.batch_size * cfg.grad_accum * train_set.block_size * data_comm.size
    lr_scale = data_comm.size if cfg.scale_lr else 1

    def overflow_ok():  # fp16 overflows are expected (the scaler skips the step): no warnings
        return (np.errstate(over="ignore", invalid="ignore") if step_fn.scaler.enabled
                else contextlib.nullcontext())  # a new one each time: NumPy 2 refuses re-entry

    ddp = getattr(step_fn, "ddp", None)
    if ddp is not None:
        ddp.probe_cosine = probe_cosine
    span = timeline.span
    t_start = time.perf_counter()
    bytes_start = step_fn.comm.bytes_sent           # the gradient communicator's count
    step_times, history = [], []
    loss_value = float("nan")
    stopped = 0                                     # the signal that stopped the run early
    step = start
    stopped = stop.before_first_step(comm) if stop is not None and start < cfg.steps else 0
    if stopped:                                     # nothing new to save: exit to be requeued
        say(f"asked to stop ({signal.Signals(stopped).name}) before step {start + 1}: "
            "nothing new to save" + (f"; the checkpoint of step {start} stays the latest"
                                     if start else ""))
    for step in range(start + 1, (cfg.steps if not stopped else start) + 1):
        t0 = time.perf_counter()
        bytes0 = step_fn.comm.bytes_sent
        runtime.test_hooks(rank, step)
        lr = optim.lr_at(step, cfg.lr * lr_scale, cfg.warmup, cfg.steps, cfg.min_lr * lr_scale)
        with span("step", step=step):
            step_fn.zero_grad()
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                x, y = train_set.batch(sampler.next_batch())
                last = micro == cfg.grad_accum - 1           # communicate on the last only
                with step_fn.micro_context(last), overflow_ok():
                    loss_sum += step_fn.forward_backward(xp.asarray(x), xp.asarray(y),
                                                         1.0 / cfg.grad_accum)
            with span("gradient sync"):
                step_fn.sync()
            with span("optimizer step"):
                _, norm = step_fn.apply(lr, cfg.grad_clip)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        loss_value = float(data_comm.allreduce(np.array([loss_sum / cfg.grad_accum]),
                                               op="avg")[0])          # the global mean loss
        rec = {"step": step, "loss": loss_value, "lr": lr, "step_ms": dt * 1e3,
               "tokens_per_s": tokens_per_step / dt, "grad_norm": norm,
               "bytes_sent": step_fn.comm.bytes_sent - bytes0,
               "loss_scale": step_fn.scaler.scale, "skipped_steps": step_fn.scaler.skipped}
        history.append(rec)
        if is_main:
            metrics.write(json.dumps(rec) + "\n")
        if step % cfg.log_every == 0 or step == cfg.steps:
            eta = (time.perf_counter() - t_start) / (step - start) * (cfg.steps - step)
            say(f"step {step:5d}/{cfg.steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {dt * 1e3:.1f} ms/step | "
                f"{rec['bytes_sent'] / 1024:,.0f} KiB sent | ETA {eta:.0f} s")
            if is_main:
                metrics.flush()
        if not np.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower --lr")
        if stop is not None:
            stopped = stop.poll(comm, more=step < cfg.steps - 1)
        if cfg.save_dir and (stopped or (cfg.save_every and step % cfg.save_every == 0)
                             or step == cfg.steps):
            runtime.test_hooks(rank, "save")
            with span("checkpoint", step=step):
                folder = state.save_checkpoint(cfg, step, comm, step_fn, sampler)
            say(f"saved {folder}")
        if stopped:
            break

    if stopped:
        name = signal.Signals(stopped).name
        if step > start:
            say(f"stopped after step {step} of {cfg.steps} on {name}: the checkpoint above "
                f"holds the run; exit code {EXIT_PREEMPTED} (the job script requeues, --resume "
                f"continues)")
        final = {"event": "preempted", "step": step, "signal": name, "steps": cfg.steps,
                 "world": world, "seconds": time.perf_counter() - t_start}
    else:
        runtime.test_hooks(rank, "end")
        train_bytes = step_fn.comm.bytes_sent - bytes_start    # before evaluation's gathers
        with step_fn.eval_context(), span("evaluate"):
            accuracy, test_loss = evaluate(model, test_set, cfg.eval_batch, data_comm)
        ran = max(cfg.steps - start, 1)
        final = {"event": "final", "accuracy": float(accuracy), "test_loss": float(test_loss),
                 "train_loss": loss_value, "steps": cfg.steps, "world": world,
                 "seconds": time.perf_counter() - t_start,
                 "skipped_steps": step_fn.scaler.skipped, "bytes_per_step": train_bytes / ran,
                 "step_ms_median": float(np.median(step_times)) * 1e3 if step_times else 0.0}
        if ddp is not None and ddp.cosines:
            final["cosine_mean"] = float(np.mean(ddp.cosines))
        final["memory_peak"] = step_fn.peak_memory()  # the largest within any step
        final["memory_state"] = step_fn.memory()      # between steps
        say("model state per rank, MiB (peak within a step): "
            + ", ".join(f"{k} {v / 2 ** 20:.3f}" for k, v in final["memory_peak"].items()))
        what = "exact-match" if cfg.task != "text" else "next-char"
        say(f"held-out accuracy ({what}): {accuracy * 100:.2f}% | held-out loss "
            f"{test_loss:.4f} | {final['seconds']:.1f} s")
    if is_main:
        metrics.write(json.dumps(final) + "\n")
        metrics.close()
    final["history"] = history                    # every step's record (tests compare them)
    final["params"] = backend.to_numpy(step_fn.full_parameters())   # on the host (tests compare)
    return final


def cfg_parameters(model, cfg) -> int:
    """Parameters of the one logical model (a tensor-parallel rank holds only its shards)."""
    full = getattr(model, "full", model)          # a pipeline stage: the whole model's count
    if cfg.tp == 1:
        return full.num_parameters()
    return sum(p.size * (cfg.tp if spec else 1) for _, p, spec in full.named_specs())


def _agree_on_error(comm, message: str | None) -> str | None:
    """Every rank learns whether any rank failed setup; the lowest failing rank reports."""
    flag = comm.allreduce(np.array([1.0 if message else 0.0,
                                    (comm.size - comm.rank) if message else 0.0]), op="max")
    if flag[0] == 0:
        return None
    reporter = comm.size - int(flag[1])
    if comm.rank == reporter:
        return message if comm.size == 1 else f"rank {comm.rank}: {message}"
    return ""       # another rank reports it; this one exits quietly with the same code


def main(argv=None) -> int:
    errors = (ConfigError, backend.DeviceError, checkpoint.CheckpointError, OSError, ValueError)
    message, cfg = None, None
    try:
        cfg = parse_config(argv)
    except errors as e:
        message = str(e)
    # What a signal means is decided here, once, before anything can be signalled (ranks.json
    # comes later): with a checkpoint folder, SIGTERM/SIGUSR1 request a stop until exit.
    if cfg is not None and cfg.save_dir:
        signals.checkpoint_on_signal()
    comm = Communicator()                              # collective: every rank, always
    abort.install()
    if message is None:
        try:                                           # every check that needs no collective
            watchdog.set_timeout(cfg.timeout or None)
            runtime.test_hooks(comm.rank, "prepare")
            backend.init(cfg.device, comm.local_rank)
            prepared = prepare(cfg, comm)
        except errors as e:
            message = str(e)
    message = _agree_on_error(comm, message)
    if message is not None:
        if message:
            print(f"hpcdist.train: error: {message}", file=sys.stderr)
        return 2
    try:
        final = train(cfg, comm, prepared=prepared)
    except checkpoint.CheckpointError as e:       # raised alike on every rank (agreed)
        if comm.rank == 0:
            print(f"hpcdist.train: error: {e}", file=sys.stderr)
        return 1
    return EXIT_PREEMPTED if final.get("event") == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
