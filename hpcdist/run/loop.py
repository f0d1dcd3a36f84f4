"""The training loop (``hpcdist.train`` builds the run, then hands it here): the steps from
the first to ``--steps`` or an agreed stop, each one optimizer step over its micro-batches
with its metrics record; the checkpoints and held-out evaluations between them; the final
report."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np

from .. import checkpoint, optim
from ..checkpoint import background
from ..nn import moe
from ..autograd import memtrace
from ..device import backend
from ..host import timeline
from ..parallel import state
from . import graphed, report, runtime
from .evaluate import evaluate_run
from .report import final_report, progress_line, stopped_report


@dataclass(kw_only=True)
class Run:
    """What a training run is made of, built once by train.py and read by the loop: the
    settings, the communicator, the model and its strategy, the data and its sampler, rank
    0's metrics file and MFU meter (None elsewhere), the line printer; and ``actions``'s
    save / held-out evaluation and recovery's Mark, set before the steps."""
    cfg: object
    comm: object
    model: object
    strategy: object
    train_set: object
    test_set: object
    sampler: object
    metrics: object = None
    meter: object = None
    say: object = print
    save: object = None
    held_out: object = None
    mark: object = None
    background: object = None     # --async-save: the save in flight (checkpoint/background.py)
    saved: object = None          # what a published save prints and prunes (actions)


@dataclass(kw_only=True)
class Start:
    """Where the steps begin: the steps already done (a resume's), the run's StopRequest
    (None: nothing watches signals) and the signal that stopped it before step 1 (0: none)."""
    step: int = 0
    stop: object = None
    stopped: int = 0


def steps(run: Run, start: Start):
    """The steps, then the final report: (its metrics, every step's record)."""
    cfg, comm, strategy = run.cfg, run.comm, run.strategy
    if backend.device_label() == "cpu":               # the CPU kernels loaded before the clock
        from ..device.kernels import cpu
        cpu.ready(backend.default_float(), largest=largest_activation(run))
    t_start = time.perf_counter()
    inter_start = getattr(strategy.comm, "bytes_inter_node", 0)    # of it, across nodes
    history, step, stopped = loop(run, start)
    # the steps' own traffic (gradients, exchanges, the meetings at saves and the end): what
    # the records add up to, not the loss reads between them nor evaluation's gathers
    train_bytes = sum(rec["bytes_sent"] for rec in history)
    inter = report.inter_node(cfg, comm, strategy, inter_start)
    extra = strategy.summary()                      # collective where the strategy gathers
    line = extra.pop("line", None)
    if stopped:
        final = stopped_report(cfg, stopped, step, start.step, comm.size, t_start, say=run.say)
    else:
        runtime.test_hooks("end")
        final = final_report(run, history, t_start, train_bytes)
        if line:
            run.say(line)
    final.update(extra, inter_node_bytes=int(inter))
    return final, history


def actions(run: Run):
    """(save(step), evaluate(step)): a checkpoint (then --keep-last's pruning) and
    --eval-every's held-out evaluation, each collective."""
    cfg, comm, strategy, say = run.cfg, run.comm, run.strategy, run.say

    run.background = background.Background() if getattr(cfg, "async_save", False) else None

    def saved(folder: str, how: str = "") -> None:
        say(f"saved {folder}{how}")
        if cfg.keep_last and comm.rank == 0:
            for old in checkpoint.prune(cfg.save_dir, cfg.keep_last):
                say(f"removed {old} (--keep-last {cfg.keep_last})")

    def save(at: int, final: bool = True) -> None:
        """A checkpoint of step ``at``; with --async-save the one in flight is published
        first, and the last (``final``: the end, a stop) is written in the step."""
        if run.background is not None:
            finish_background(run, saved)
            if not final:
                folder = state.save_checkpoint(cfg, at, comm, strategy, run.sampler,
                                               run.train_set.vocabulary,
                                               background=run.background)
                say(f"saving {folder} in the background (--async-save)")
                return
        saved(state.save_checkpoint(cfg, at, comm, strategy, run.sampler,
                                    run.train_set.vocabulary))
    run.saved = saved

    def held_out(at: int) -> None:                   # --eval-every (collective)
        t0 = time.perf_counter()
        with strategy.eval_context(), timeline.span("evaluate"):
            accuracy, loss, tokens = evaluate_run(cfg, run.model, run.test_set,
                                                  strategy.batch_comm)
        say(f"step {at:5d} | held-out loss {loss:.4f} | held-out accuracy {accuracy * 100:.2f}%"
            f" | {tokens:,} tokens scored in {time.perf_counter() - t0:.1f} s")
        if run.metrics is not None:
            run.metrics.record({"event": "eval", "step": at, "test_loss": float(loss),
                                "accuracy": float(accuracy), "eval_tokens": tokens})
    return save, held_out


def finish_background(run: Run, saved, only_if_ready: bool = False) -> None:
    """Publish the save in flight (collective): always (``only_if_ready`` False: waiting for
    this rank's file), or only once every rank's file is written."""
    bg = run.background
    if bg is None or bg.step is None or (only_if_ready and not bg.ready(run.comm)):
        return
    folder, seconds = bg.finish(run.comm)
    saved(folder, f" (written in the background, {seconds:.1f} s after its step)")


def largest_activation(run: Run) -> int:
    """An upper bound on the elements of a step's widest activation: a step's rows (the
    batch's tokens) times the widest dimension of any parameter (the vocabulary, the MLP's
    width, q | k | v)."""
    widest = max((max(p.shape) for p in run.model.parameters() if p.shape), default=1)
    return run.cfg.batch_size * run.train_set.block_size * widest


def loop(run: Run, start: Start):
    """Steps from ``start.step`` until ``cfg.steps`` or an agreed stop: (every step's record,
    the last step, the signal that stopped the run or 0)."""
    cfg, comm, strategy, sampler = run.cfg, run.comm, run.strategy, run.sampler
    save, held_out, mark, say = run.save, run.held_out, run.mark, run.say
    stop, stopped = start.stop, start.stopped
    start = start.step
    if start < cfg.steps and not stopped:
        strategy.begin(stop, start)
    lr_scale = strategy.batch_comm.size if cfg.scale_lr else 1
    delay = straggler_delay(cfg, comm.rank)
    t_start = time.perf_counter()
    history, step, more = [], start, start < cfg.steps and not stopped
    unread = report.Unread(strategy, run.meter, run.metrics, meaned=mark.recovers)
    choice = graphed.auto(cfg, strategy)         # --cuda-graph auto: timed, then chosen
    mark.unread = unread                         # (a recovery writes what it settled)
    while more:
        mark.at(step, sampler)
        step += 1
        runtime.test_hooks(step)
        lr = optim.lr_at(step, cfg.lr * lr_scale, cfg.warmup, cfg.steps, cfg.min_lr * lr_scale)
        if choice is not None:
            choice.before_step()
        rec = train_step(cfg, strategy, run.train_set, sampler, step, lr, delay=delay,
                         settle=mark.recovers, before_update=run.background and
                         run.background.wait_copied)
        if choice is not None and (chosen := choice.after_step()):
            say(chosen)
        history.append(rec)
        unread.add(rec)
        stopped, save_at, more = strategy.control(step, cfg, stop, comm)
        rec["bytes_sent"] += strategy.control_bytes()   # (a meeting at a save or the end)
        if mark.recovers:                        # the committed step's record kept on the host
            unread.settle()                      # (its loss meaned before the commit: no
                                                 # collective here)
        if more and mark.mirror is not None:     # peers' memory holds the committed state
            t0 = time.perf_counter()
            with timeline.span("mirror", step=step):
                rec["mirror_bytes"] = mark.committed(step, cfg, comm, strategy, sampler)
            rec["mirror_ms"] = (time.perf_counter() - t0) * 1e3    # (not in step_ms)
            rec["bytes_sent"] += rec["mirror_bytes"]
        if step % cfg.log_every == 0 or not more or save_at is not None:
            unread.read()                        # the device is waited for here only
            if step % cfg.log_every == 0 or step == cfg.steps:
                eta = (time.perf_counter() - t_start) / (step - start) * (cfg.steps - step)
                say(progress_line(rec, cfg.steps, eta))
        if save_at is not None:
            runtime.test_hooks("save")
            with timeline.span("checkpoint", step=save_at):
                save(save_at, final=not more or stopped)
        elif run.background is not None:                 # published once every rank wrote
            finish_background(run, run.saved, only_if_ready=True)
        if cfg.eval_every and step % cfg.eval_every == 0 and more:  # (the last: final report)
            unread.read()                        # (the step records before it, in order)
            held_out(step)
        if save_at is not None or (cfg.eval_every and step % cfg.eval_every == 0):
            unread.restart_clock()
    finish_background(run, run.saved)                     # (none is left in flight)
    return history, step, stopped


def straggler_delay(cfg, rank: int) -> float:
    """Seconds this rank sleeps in every step (``--straggler RANK:MS``)."""
    if not cfg.straggler:
        return 0.0
    r, ms = cfg.straggler.split(":")
    return float(ms) / 1e3 if int(r) == rank else 0.0


def train_step(cfg, strategy, train_set, sampler, step: int, lr: float,
               *, delay: float = 0.0, settle: bool = False, before_update=None) -> dict:
    """One optimizer step over ``cfg.grad_accum`` micro-batches; its metrics record.
    ``delay``: seconds this rank sleeps in the step (a straggler). ``settle`` (under
    --on-failure shrink): the loss's mean over the replicas is read before the step is
    committed, so that a committed step's record never needs a rank lost after it.
    ``before_update()``: called before the step changes the state (an --async-save's copy
    of it finishes while the forward and backward run)."""
    before_update = before_update or (lambda: None)
    forward_backward = graphed.forward_backward(cfg, strategy)
    t0 = time.perf_counter()
    bytes0 = strategy.comm.bytes_sent
    memtrace.start()
    counts = backend.device_counts()
    with timeline.span("step", step=step) as span:
        if delay:
            time.sleep(delay)
        if isinstance(forward_backward, graphed.GraphedStep) and \
                getattr(train_set, "masked", False):   # (its weights are the graph's constants)
            forward_backward = strategy.forward_backward
        if isinstance(forward_backward, graphed.GraphedStep):     # the whole step: one graph
            before_update()
            with timeline.span("graphed step"):
                loss, norm = forward_backward([train_set.batch(sampler.next_batch())
                                               for _ in range(cfg.grad_accum)])
            applied, trained = True, None
        else:
            loss, applied, norm, trained = _eager_step(
                cfg, strategy, train_set, sampler, lr, forward_backward=forward_backward,
                settle=settle, before_update=before_update)
        experts = moe.after_step(strategy.model, applied)    # balancing; load and drops
        if span is not None and counts is not None:   # the GPU stand-in's counts, per step
            after = backend.device_counts()
            span.update(launches=after[0] - counts[0], device_reads=after[1] - counts[1])
    dt = time.perf_counter() - t0
    held = memtrace.finish()
    tokens = cfg.batch_size * cfg.grad_accum * train_set.block_size * strategy.batch_comm.size
    return {"step": step, "loss": loss, "lr": lr, "step_ms": dt * 1e3, "time": time.time(),
            "tokens_per_s": tokens / dt, "grad_norm": norm,
            "bytes_sent": strategy.comm.bytes_sent - bytes0,
            "loss_scale": strategy.scaler.scale, "skipped_steps": strategy.scaler.skipped,
            # instruction data: the loss is per trained token, of this many in the step
            **({"trained_tokens": trained} if trained is not None else {}),
            **experts,
            **({"memory_activations": held["activations"], "memory_step_peak": held["peak"]}
               if held else {})}


def _eager_step(cfg, strategy, train_set, sampler, lr: float, *, forward_backward,
                settle: bool, before_update):
    """A step's work from the host, op by op (or each micro-batch's forward and backward as
    a graph): (loss, applied, gradient norm)."""
    xp = backend.xp()
    host = isinstance(forward_backward, graphed.GraphedForwardBackward)   # (copies batches in)
    strategy.zero_grad()
    loss_sum = 0.0                                   # stays on the device (Unread)
    batches = [train_set.batch(sampler.next_batch()) for _ in range(cfg.grad_accum)]
    weights, trained = token_weights(strategy, train_set, [y for _, y in batches])
    if weights is not None and host:                 # (a graph per weight would be captured)
        forward_backward = strategy.forward_backward
    for micro, (x, y) in enumerate(batches):
        last = micro == cfg.grad_accum - 1           # communicate on the last only
        w = 1.0 / cfg.grad_accum if weights is None else weights[micro]
        with strategy.micro_context(last), _overflow_ok(strategy):
            part = forward_backward(*((x, y) if host else (xp.asarray(x), xp.asarray(y))), w)
        loss_sum += part if weights is None else part * w
    before_update()
    with timeline.span("gradient sync"):
        strategy.sync()
    # the mean over the replicas (Unread.settle): per trained token of the global batch
    loss = loss_sum / cfg.grad_accum if weights is None else loss_sum
    if settle:
        loss = strategy.mean_losses([loss])[0]
    with timeline.span("optimizer step"):
        applied, norm = strategy.apply(lr, cfg.grad_clip)
    return loss, applied, norm, trained


def token_weights(strategy, train_set, targets) -> tuple[list | None, int | None]:
    """(each micro-batch's weight in a token-level loss, the trained tokens they weigh), or
    (None, None) where every micro-batch of every replica scores as many tokens (plain text,
    digit tasks: the weight is then 1 / micro-batches, as before).

    A micro-batch's loss is the mean over its scored tokens; a step's is the sum over the
    global batch's scored tokens divided by their count, whatever the split over
    micro-batches and ranks (transformers #34191, trl #2175: a mean of means weighs a short
    answer's tokens more). So micro-batch m of this rank weighs n_m * R / N: n_m its scored
    tokens, N those of every micro-batch of the R replicas whose gradients a step averages
    (one allreduce of a count per step, only for data whose rows score unequal counts)."""
    if not getattr(train_set, "masked", False):
        return None, None
    from .. import data
    counts = np.array([int((np.asarray(y) != data.IGNORE).sum()) for y in targets],
                      dtype=np.int64)
    comm = strategy.step_comm
    total = counts.sum() if comm is None or comm.size == 1 else \
        int(comm.allreduce(np.array([counts.sum()], dtype=np.int64))[0])
    replicas = 1 if comm is None else comm.size
    return [float(n) * replicas / max(int(total), 1) for n in counts], int(total)


def _overflow_ok(strategy):
    """fp16 overflows are expected (the scaler skips the step): no warnings for them."""
    return (np.errstate(over="ignore", invalid="ignore") if strategy.scaler.enabled
            else contextlib.nullcontext())  # a new one each time: NumPy 2 refuses re-entry
