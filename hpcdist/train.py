"""Train a GPT, data-parallel over MPI ranks: ``mpirun -n 8 python -m hpcdist.train``.

Distributed state is decided once, here: the communicator, this rank's device, its data shard
and its seed. Every rank checks the settings before any work; a bad setting ends every rank with
one line on stderr and exit code 2. Rank 0 prints a header, a progress line every
``log_every`` steps and the held-out accuracy, and writes ``out_dir/metrics.jsonl``.
An exception on any rank ends the whole job with that rank's traceback (comm.abort).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time

import numpy as np

from . import backend, checkpoint, data, nn, optim, threads, timeline
from .comm import Communicator, abort, watchdog
from .comm.model import fit_alpha_beta
from .config import ConfigError, TrainConfig, parse_config, validate_world
from .parallel import DistributedDataParallel, make_compression
from .parallel.mixed_precision import LossScaler, MixedPrecision
from .parallel.zero import Zero
from .preemption import EXIT_PREEMPTED, StopRequest
from .tensor import no_grad

__all__ = ["TrainConfig", "ConfigError", "parse_config", "train", "main", "evaluate",
           "EXIT_PREEMPTED"]


# ---- evaluation -------------------------------------------------------------------------------

def evaluate(model, dataset, batch: int, comm=None, max_examples: int = 4096):
    """Held-out (accuracy, loss), the examples split over the ranks and the counts summed.

    Digit tasks: exact match — every scored position's argmax equals its target. With teacher
    forcing this equals greedy decoding getting the whole answer right. Text: next-character
    accuracy over up to ``max_examples`` evenly spaced windows.
    """
    xp = backend.xp()
    n = len(dataset)
    idx = np.arange(n) if n <= max_examples else np.linspace(0, n - 1, max_examples).astype(int)
    if comm is not None:
        idx = idx[comm.rank::comm.size]
    exact = isinstance(dataset, data.DigitTask)
    correct = total = 0
    loss_sum = 0.0
    was_training = model.training
    model.eval()
    with no_grad():
        for s in range(0, len(idx), batch):
            x, y = dataset.batch(idx[s:s + batch])
            logits, loss = model(xp.asarray(x), xp.asarray(y))
            pred = backend.to_numpy(logits.data.argmax(axis=-1))
            scored = y != data.IGNORE
            hit = (pred == y) | ~scored
            if exact:
                correct += int(hit.all(axis=1).sum())
                total += len(y)
            else:
                correct += int((hit & scored).sum())
                total += int(scored.sum())
            loss_sum += float(loss.data) * len(y)
    model.train(was_training)
    sums = np.array([correct, total, loss_sum, len(idx)], dtype=np.float64)
    if comm is not None:
        sums = comm.allreduce(sums)
    return sums[0] / max(sums[1], 1), sums[2] / max(sums[3], 1)


# ---- building the run -------------------------------------------------------------------------

class DataParallelStep:
    """The plain data-parallel path (``--zero 0``): DDP + mixed precision + a full optimizer,
    behind the same small interface as ``parallel.zero.Zero``."""

    def __init__(self, ddp, opt, mp, comm):
        self.ddp, self.opt, self.mp, self.host = ddp, opt, mp, comm
        self.comm = ddp.comm                       # the gradient communicator (bytes count)
        self.scaler = mp.scaler

    def zero_grad(self):
        self.mp.zero_grad()

    def micro_context(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def scale_loss(self, loss):
        return self.mp.scale_loss(loss)

    def sync(self):
        self.ddp.sync_gradients()

    def apply(self, lr: float, grad_clip: float = 0.0):
        overflow = self.mp.unscale_and_check(self.host) if self.scaler.enabled else False
        if not self.scaler.update(overflow):
            return False, None
        norm = optim.clip_grad_norm(self.mp.master.grad, grad_clip) if grad_clip else None
        self.opt.step(lr)
        self.mp.copy_master_to_compute()
        return True, norm

    def eval_context(self):
        return contextlib.nullcontext()

    def state(self):
        shared = {"params": backend.to_numpy(self.mp.master.data)}
        shared.update({f"opt.{k}": np.asarray(v) for k, v in self.opt.state_dict().items()})
        own = {f"compress.{k}": v for k, v in self.ddp.compression.state_dict().items()}
        return shared, own

    def restore(self, shared, own):
        self.mp.master.data[...] = backend.to_device(shared["params"])
        self.mp.copy_master_to_compute()
        self.opt.load_state_dict({k[len("opt."):]: (int(v) if k == "opt.step_count" else v)
                                  for k, v in shared.items() if k.startswith("opt.")})
        self.ddp.compression.load_state_dict({k[len("compress."):]: v for k, v in own.items()
                                              if k.startswith("compress.")})

    def memory(self) -> dict:
        """Bytes alive in parameters, gradients and optimizer state (compute + master)."""
        mp = self.mp
        params = mp.compute.data.nbytes
        # mixed precision: the fp32 master weights count as optimizer state (the ZeRO paper's
        # K), and DDP averages into an fp32 gradient beside the compute gradient
        grads = mp.compute.grad.nbytes + (mp.master.grad.nbytes if mp.mixed else 0)
        state = sum(v.nbytes for v in self.opt.state.values() if hasattr(v, "nbytes")) + \
            (mp.master.data.nbytes if mp.mixed else 0)
        return {"params": params, "grads": grads, "optimizer": state,
                "total": params + grads + state}

    peak_memory = memory                            # nothing here changes size in a step

    def full_parameters(self):
        return self.mp.master.data


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
        return datasets, (None, note)
    manifest, shared, own = checkpoint.load(folder, comm)
    checkpoint.check_meta(manifest, run_meta(cfg), folder)
    return datasets, (folder, note, manifest, shared, own)


def run_meta(cfg: TrainConfig) -> dict:
    """What a checkpoint must share with the run that resumes it (checked on --resume)."""
    return {"task": cfg.task, "zero": cfg.zero, "length": cfg.length,
            "num_digits": cfg.num_digits, "block_size": cfg.block_size, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_embd": cfg.n_embd, "bias": cfg.bias,
            "tie_weights": cfg.tie_weights, "dtype": cfg.dtype, "precision": cfg.precision,
            "optimizer": cfg.optimizer, "compress": cfg.compress}


def build(cfg: TrainConfig, comm, datasets):
    """Model and the training step (DDP or ZeRO) for this rank, over prepared datasets."""
    train_set, test_set = datasets
    backend.set_default_float("float64" if cfg.dtype == "fp64" else "float32")
    nn.manual_seed(cfg.seed)
    backend.seed(cfg.seed + 1000 * comm.rank)        # per-rank dropout streams
    model = nn.GPT(nn.GPTConfig(
        block_size=train_set.block_size, vocab_size=train_set.vocab_size, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
        tie_weights=cfg.tie_weights, checkpoint_activations=cfg.checkpoint_activations))
    scaler = LossScaler(init_scale=cfg.loss_scale, enabled=cfg.precision == "fp16")
    # With DGC the momentum lives in the compressor; the optimizer must not add its own.
    momentum = 0.0 if cfg.compress == "topk" and cfg.compress_momentum else cfg.momentum

    def make_optimizer(flat):
        if cfg.optimizer == "adamw":
            return optim.AdamW(flat, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                               weight_decay=cfg.weight_decay)
        return optim.SGD(flat, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)

    if cfg.zero:
        low = None if cfg.precision == "fp32" else backend.dtype(cfg.precision)
        step = Zero(model, comm, cfg.zero, make_optimizer, compute_dtype=low, scaler=scaler,
                    bucket_mb=cfg.bucket_mb, first_bucket_mb=cfg.first_bucket_mb)
        return model, step
    mp = MixedPrecision(model.parameters(), cfg.precision, scaler)
    compression = make_compression(cfg.compress, cfg.density, cfg.compress_momentum,
                                   cfg.compress_clip, cfg.density_warmup)
    grad_comm = comm
    if cfg.backend == "nccl":                      # gradients over NCCL, the rest over MPI
        from .comm.nccl import NcclCommunicator
        grad_comm = NcclCommunicator(comm.mpi)
    ddp = DistributedDataParallel(model, grad_comm, flat=mp.master, compute=mp.compute,
                                  bucket_mb=cfg.bucket_mb, first_bucket_mb=cfg.first_bucket_mb,
                                  overlap=cfg.overlap, compression=compression)
    return model, DataParallelStep(ddp, make_optimizer(mp.master), mp, comm)


def run_state(step, sampler):
    """(shared, own) arrays that make a run resumable bit for bit."""
    shared, own = step.state()
    own["sampler"] = np.array([sampler.epoch, sampler.position], dtype=np.int64)
    own["rng"] = checkpoint.json_array(backend.rng_state())
    own.update({f"scaler.{k}": v for k, v in step.scaler.state_dict().items()})
    return shared, own


def restore_state(shared, own, step, sampler) -> None:
    step.restore(shared, own)
    sampler.load_state_dict({"epoch": own["sampler"][0], "position": own["sampler"][1]})
    backend.set_rng_state(checkpoint.from_json_array(own["rng"]))
    step.scaler.load_state_dict({k[len("scaler."):]: v for k, v in own.items()
                                 if k.startswith("scaler.")})


def record_ranks(comm, out_dir: str) -> str:
    """Rank 0 writes ``out_dir/ranks.json``: every rank's host and PID, so that a launcher's
    "PID X died" maps to a rank. Returns a short summary of the hosts (for the header)."""
    me = np.zeros(256, dtype=np.uint8)
    raw = json.dumps([socket.gethostname(), os.getpid()]).encode()[:256]
    me[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = comm.allgather(me).reshape(comm.size, 256)
    ranks = [json.loads(bytes(row).rstrip(b"\0").decode()) for row in every]
    if comm.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        table = [{"rank": r, "host": h, "pid": p} for r, (h, p) in enumerate(ranks)]
        checkpoint.write_json_atomic(os.path.join(out_dir, "ranks.json"), table)
    hosts = sorted({h for h, _ in ranks})
    return f"{len(hosts)} host{'s' * (len(hosts) > 1)} ({', '.join(hosts[:3])}" + \
        (", ..." if len(hosts) > 3 else "") + ")"


def open_metrics(out_dir: str, resumed: bool, say):
    """``out_dir/metrics.jsonl`` for appending. A resumed run continues the file; a new run
    moves an earlier run's file aside (metrics.jsonl.1, .2, ...) rather than truncating it."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not resumed and os.path.exists(path) and os.path.getsize(path) > 0:
        n = 1
        while os.path.exists(f"{path}.{n}"):
            n += 1
        os.replace(path, f"{path}.{n}")
        say(f"moved the earlier {path} to {path}.{n}")
    return open(path, "a")


def _test_hooks(rank: int, step: int) -> None:
    """Test hooks: HPCDIST_FAIL_AT=RANK:STEP raises on that rank at that step;
    HPCDIST_SIGNAL_AT=RANK:STEP[:SIGNAL] sends that rank SIGNAL (default SIGUSR1) there;
    HPCDIST_FSIZE_AT=RANK:STEP:BYTES limits that rank's file size (a full disk) from there."""
    spec = os.environ.get("HPCDIST_FAIL_AT")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (HPCDIST_FAIL_AT)")
    spec = os.environ.get("HPCDIST_SIGNAL_AT", "").split(":")
    if len(spec) >= 2 and spec[:2] == [str(rank), str(step)]:
        os.kill(os.getpid(), getattr(signal, spec[2] if len(spec) > 2 else "SIGUSR1"))
    spec = os.environ.get("HPCDIST_FSIZE_AT", "").split(":")
    if len(spec) == 3 and spec[:2] == [str(rank), str(step)]:
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(spec[2]), int(spec[2])))


# ---- the run ----------------------------------------------------------------------------------

def train(cfg: TrainConfig, comm=None, log=print, probe_cosine: bool = False,
          prepared=None) -> dict:
    """Train on every rank of ``comm``; return the final metrics (the same on every rank).

    ``prepared``: what ``prepare`` returned (main checks it before any work); made here if
    not given. ``probe_cosine`` (benchmarks): also measure each step's cosine similarity between the
    averaged gradient and the dense average (an extra, uncounted allreduce per bucket).
    With ``cfg.save_dir``, SIGUSR1/SIGTERM save a checkpoint and stop the run early: the
    result then has ``"event": "preempted"`` and no evaluation.
    """
    comm = comm or Communicator()
    recorder = clocks = alpha_beta = None
    if cfg.trace or cfg.comm_log:
        recorder, clocks = timeline.Recorder(comm.rank), timeline.ClockSync()
        clocks.measure(comm.mpi)
        if cfg.comm_log:
            alpha_beta = fit_alpha_beta(comm.mpi, big=4 << 20)
        timeline.activate(recorder)
    stop = StopRequest()
    watching = bool(cfg.save_dir) and stop.install()
    try:
        final = _run(cfg, comm, log, probe_cosine, prepared, stop if watching else None)
    finally:
        stop.restore()
        timeline.deactivate()
    if recorder is not None:
        _report_timeline(cfg, comm, recorder, clocks, alpha_beta, log)
    return final


def _report_timeline(cfg, comm, recorder, clocks, alpha_beta, log) -> None:
    """Write the Chrome trace and print the communication log (collective)."""
    clocks.measure(comm.mpi)
    if cfg.trace:
        path = timeline.write_chrome_trace(cfg.trace, recorder, clocks, comm.mpi,
                                           metadata={"world": comm.size, "task": cfg.task})
        if path:
            log(f"wrote Chrome trace {path} ({comm.size} ranks; open in ui.perfetto.dev)")
    if cfg.comm_log:
        rows = timeline.comm_log(recorder, comm.mpi, *alpha_beta)
        if rows is not None:
            log(timeline.format_comm_log(rows, *alpha_beta))
            os.makedirs(cfg.out_dir, exist_ok=True)
            with open(os.path.join(cfg.out_dir, "comm_log.json"), "w") as f:
                json.dump({"alpha_s": alpha_beta[0], "beta_s_per_byte": alpha_beta[1],
                           "rows": rows}, f, indent=1)


def _run(cfg, comm, log, probe_cosine, prepared, stop) -> dict:
    rank, world = comm.rank, comm.size
    device = backend.init(cfg.device, comm.local_rank)
    if prepared is None:
        prepared = prepare(cfg, comm)
    (train_set, test_set), resume = prepared
    model, step_fn = build(cfg, comm, (train_set, test_set))
    sampler = data.DistributedSampler(len(train_set), cfg.batch_size, rank, world, seed=cfg.seed)
    xp = backend.xp()
    is_main = rank == 0
    say = log if is_main else (lambda *a, **k: None)

    start = 0
    if resume is not None:
        folder, note, *state = resume
        if folder is not None:
            manifest, shared, own = state
            restore_state(shared, own, step_fn, sampler)
            start = manifest["step"]
            note += f" at step {start}"
        say(note)

    hosts = record_ranks(comm, cfg.out_dir)
    if is_main:
        metrics = open_metrics(cfg.out_dir, resumed=start > 0, say=say)
    say(f"hpcdist | GPT {cfg.n_layer}x{cfg.n_embd} ({cfg.n_head} heads), "
        f"{model.num_parameters():,} parameters | task {cfg.task} "
        f"({len(train_set):,} train / {len(test_set):,} held-out) | device {device} | "
        f"world size {world} on {hosts} | BLAS threads {threads.choice} | {cfg.precision} | "
        + (f"ZeRO stage {cfg.zero} | " if cfg.zero else f"compress {cfg.compress} | ")
        + f"{cfg.steps} steps x batch {cfg.batch_size} x {world} ranks"
        + (f" x {cfg.grad_accum} accum" if cfg.grad_accum > 1 else ""))

    if cfg.zero:
        say(f"ZeRO stage {cfg.zero}: rank 0 holds elements [{step_fn.lo}, {step_fn.hi}) of "
            f"{step_fn.L:,}; padding to equal shards would add {step_fn.padding} "
            f"(the last shards are shorter instead)")
    tokens_per_step = cfg.batch_size * cfg.grad_accum * train_set.block_size * world
    lr_scale = world if cfg.scale_lr else 1
    # fp16 overflows are expected (the loss scaler finds them and skips the step): no warnings
    # (a new errstate each time: NumPy 2 refuses to re-enter one)
    def overflow_ok():
        return (np.errstate(over="ignore", invalid="ignore") if step_fn.scaler.enabled
                else contextlib.nullcontext())
    ddp = getattr(step_fn, "ddp", None)
    if ddp is not None:
        ddp.probe_cosine = probe_cosine
    span = timeline.span
    t_start = time.perf_counter()
    bytes_start = step_fn.comm.bytes_sent           # the gradient communicator's count
    step_times = []
    loss_value = float("nan")
    stopped = 0                                     # the signal that stopped the run early
    step = start
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        bytes0 = step_fn.comm.bytes_sent
        _test_hooks(rank, step)
        lr = optim.lr_at(step, cfg.lr * lr_scale, cfg.warmup, cfg.steps, cfg.min_lr * lr_scale)
        with span("step", step=step):
            step_fn.zero_grad()
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                x, y = train_set.batch(sampler.next_batch())
                last = micro == cfg.grad_accum - 1           # communicate on the last only
                with step_fn.micro_context(last), overflow_ok():
                    with span("forward", micro=micro):
                        _, loss = model(xp.asarray(x), xp.asarray(y))
                    with span("backward", micro=micro):
                        step_fn.scale_loss(loss * (1.0 / cfg.grad_accum)).backward()
                loss_sum += float(loss.data)
            with span("gradient sync"):
                step_fn.sync()
            with span("optimizer step"):
                _, norm = step_fn.apply(lr, cfg.grad_clip)
        loss_value = loss_sum / cfg.grad_accum
        dt = time.perf_counter() - t0
        step_times.append(dt)
        if step % cfg.log_every == 0 or step == cfg.steps:
            g = comm.allreduce(np.array([loss_value]), op="avg")[0]   # the global mean loss
            rec = {"step": step, "loss": float(g), "lr": lr, "step_ms": dt * 1e3,
                   "tokens_per_s": tokens_per_step / dt, "grad_norm": norm,
                   "bytes_sent": step_fn.comm.bytes_sent - bytes0,
                   "loss_scale": step_fn.scaler.scale, "skipped_steps": step_fn.scaler.skipped}
            eta = (time.perf_counter() - t_start) / (step - start) * (cfg.steps - step)
            say(f"step {step:5d}/{cfg.steps} | loss {g:.4f} | lr {lr:.2e} | "
                f"{rec['tokens_per_s']:,.0f} tok/s | {dt * 1e3:.1f} ms/step | "
                f"{rec['bytes_sent'] / 1024:,.0f} KiB sent | ETA {eta:.0f} s")
            if is_main:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if not np.isfinite(g):
                raise FloatingPointError(f"loss became {g} at step {step}; lower --lr")
        if stop is not None:
            stopped = stop.poll(comm, more=step < cfg.steps - 1)
        if cfg.save_dir and (stopped or (cfg.save_every and step % cfg.save_every == 0)
                             or step == cfg.steps):
            with span("checkpoint", step=step):
                folder = checkpoint.save(cfg.save_dir, step, comm, *run_state(step_fn, sampler),
                                         meta=run_meta(cfg))
            say(f"saved {folder}")
        if stopped:
            break

    if stopped:
        name = signal.Signals(stopped).name
        say(f"stopped after step {step} of {cfg.steps} on {name}: the checkpoint above "
            f"holds the run; exit code {EXIT_PREEMPTED} (the job script requeues, --resume "
            f"continues)")
        final = {"event": "preempted", "step": step, "signal": name, "steps": cfg.steps,
                 "world": world, "seconds": time.perf_counter() - t_start}
        if is_main:
            metrics.write(json.dumps(final) + "\n")
            metrics.close()
        final["params"] = step_fn.full_parameters()
        return final

    train_bytes = step_fn.comm.bytes_sent - bytes_start    # before evaluation's gathers
    with step_fn.eval_context(), span("evaluate"):
        accuracy, test_loss = evaluate(model, test_set, cfg.eval_batch, comm)
    ran = max(cfg.steps - start, 1)
    final = {"event": "final", "accuracy": float(accuracy), "test_loss": float(test_loss),
             "train_loss": loss_value, "steps": cfg.steps, "world": world,
             "seconds": time.perf_counter() - t_start, "skipped_steps": step_fn.scaler.skipped,
             "bytes_per_step": train_bytes / ran,
             "step_ms_median": float(np.median(step_times)) * 1e3 if step_times else 0.0}
    if ddp is not None and ddp.cosines:
        final["cosine_mean"] = float(np.mean(ddp.cosines))
    final["memory_peak"] = step_fn.peak_memory()  # the largest within any step
    final["memory_state"] = step_fn.memory()      # between steps
    say("model state per rank, MiB (peak within a step): "
        + ", ".join(f"{k} {v / 2 ** 20:.3f}" for k, v in final["memory_peak"].items()))
    what = "exact-match" if cfg.task != "text" else "next-char"
    say(f"held-out accuracy ({what}): {accuracy * 100:.2f}% | held-out loss {test_loss:.4f} | "
        f"{final['seconds']:.1f} s")
    if is_main:
        metrics.write(json.dumps(final) + "\n")
        metrics.close()
    final["params"] = step_fn.full_parameters()   # final master weights (tests compare them)
    return final


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
    comm = Communicator()                              # collective: every rank, always
    abort.install()
    message = None
    try:                                               # every check that needs no collective
        cfg = parse_config(argv)
        watchdog.set_timeout(cfg.timeout or None)
        backend.init(cfg.device, comm.local_rank)
        prepared = prepare(cfg, comm)
    except (ConfigError, backend.DeviceError, checkpoint.CheckpointError, OSError,
            ValueError) as e:
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
