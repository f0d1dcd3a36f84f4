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

if __name__ == "__main__":      # before MPI starts (the imports below start it): a limit MPI
    from hpcdist.host import limits     # cannot start under is one line; a supervisor
    limits.refuse_before_mpi("hpcdist.train")   # process names this rank if it is killed
    from hpcdist.run import supervisor
    supervisor.start()

import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from . import checkpoint, data  # noqa: E402
from .autograd import memtrace  # noqa: E402
from .comm import Communicator, watchdog  # noqa: E402
from .comm.model import fit_links  # noqa: E402
from .device import backend, kernels  # noqa: E402
from .host import signals, threads, timeline  # noqa: E402
from .parallel import state  # noqa: E402
from .parallel.strategy import DataParallelStrategy, build_strategy  # noqa: E402
from .comm import ulfm  # noqa: E402
from .run import fits, loop, mfu, recovery, report, runtime, savedir, supervisor  # noqa: E402
from .run import sinks  # noqa: E402
from .run.config import ConfigError, TrainConfig, parse_config, validate_world  # noqa: E402
from .run.pretrained import shape_from_pretrained  # noqa: E402
from .run.evaluate import evaluate  # noqa: E402
from .run.preemption import EXIT_PREEMPTED, StopRequest  # noqa: E402
from .run.report import exit_code, header  # noqa: E402

__all__ = ["TrainConfig", "ConfigError", "parse_config", "train", "main", "evaluate",
           "EXIT_PREEMPTED", "DataParallelStrategy"]


def prepare(cfg: TrainConfig, comm):
    """Everything a run needs before any work, checked: this rank's device, the (train, test)
    datasets (validated against the world size) and the verified checkpoint to resume from,
    if any. Raises ConfigError, DeviceError, CheckpointError or OSError on this rank only."""
    backend.init(cfg.device, comm.local_rank)
    datasets = data.datasets_of(cfg)
    if cfg.init_from:
        shape_from_pretrained(cfg, datasets[0], datasets[0].vocabulary)
    validate_world(cfg, comm.size, len(datasets[0]), datasets[0].block_size)
    too_big = fits.problem(cfg, comm.size, comm.local_size, datasets[0].vocab_size,
                           datasets[0].block_size, backend.device_free())
    if too_big:                                    # before any parameter is allocated
        raise ConfigError(too_big, "n_embd")
    if not cfg.resume:
        return datasets, None
    folder, note = checkpoint.find_resume(cfg.save_dir)
    if folder is None:
        return datasets, (None, note, None)
    reader = checkpoint.Reader(folder)
    checkpoint.check_meta(reader.manifest,
                          checkpoint.checkpoint_meta(cfg, datasets[0].vocabulary), folder,
                          datasets[0].vocabulary)
    return datasets, (folder, note, reader)


def build(cfg: TrainConfig, comm, datasets):
    """(model, training step) for this rank over prepared datasets (strategy.build_strategy)."""
    return build_strategy(cfg, comm, datasets[0])


def train(cfg: TrainConfig, comm=None, log=print, prepared=None, on_build=None) -> dict:
    """Train on every rank of ``comm``; return the final metrics (the same on every rank).

    ``prepared``: what ``prepare`` returned (main checks it before any work); made here if
    not given. ``on_build(step)``: called with the strategy once it is built (benchmarks
    attach their probes there). With ``cfg.save_dir``, SIGUSR1/SIGTERM save a checkpoint and
    stop the run early: the result then has ``"event": "preempted"``.
    """
    comm = comm or Communicator()
    recorder = clocks = links = None
    if cfg.trace or cfg.comm_log:
        recorder, clocks = timeline.Recorder(comm.rank), timeline.ClockSync()
        clocks.measure(comm.mpi)
        if cfg.comm_log:
            links = fit_links(comm, big=4 << 20)
        timeline.activate(recorder)
    # main() decided what signals mean before anything could be signalled; a library caller
    # gets checkpoint-on-signal for the duration of this call.
    ours = bool(cfg.save_dir) and signals.mode() == signals.EXIT \
        and signals.checkpoint_on_signal()
    watching = signals.mode() == signals.STOP       # SIGINT stops without --save-dir too
    try:
        final = _run(cfg, comm, log, prepared or prepare(cfg, comm),
                     StopRequest() if watching else None, on_build)
    finally:
        if ours:
            signals.exit_on_signal()
        timeline.deactivate()
    if recorder is not None:
        runtime.report_timeline(cfg, comm, recorder, clocks, links, log)
    return final


def _run(cfg, comm, log, prepared, stop, on_build) -> dict:
    (train_set, test_set), resume = prepared
    model, strategy = build_strategy(cfg, comm, train_set)
    if on_build is not None:
        on_build(strategy)
    memtrace.enable(cfg.trace_memory)
    batch_comm = strategy.batch_comm    # tensor- and context-parallel ranks read the same batch
    sampler = data.DistributedSampler(len(train_set), cfg.batch_size, batch_comm.rank,
                                      batch_comm.size, seed=cfg.seed)
    logfile = runtime.open_run_file(cfg.out_dir, "train.log", resume is not None and
                                    resume[0] is not None, say=log) if comm.rank == 0 else None
    say = runtime.tee(log, logfile) if comm.rank == 0 else (lambda *a, **k: None)
    start = _resume(cfg, comm, strategy, sampler, resume, say)
    hosts = runtime.record_ranks(comm, cfg.out_dir)
    runtime.test_hooks("start")
    resumed = start > 0 or (resume is not None and resume[0] is not None)   # (a recovery too)
    metrics = runtime.open_run_file(cfg.out_dir, "metrics.jsonl", resumed=resumed, say=say) \
        if comm.rank == 0 else None
    if metrics is not None:
        metrics.sinks = sinks.sinks(cfg, start)            # --tensorboard, --wandb
    meter = mfu.Meter(model, cfg, train_set.block_size, comm.size, comm.nodes,
                      threads.usable_cores()) if comm.rank == 0 else None
    for line in header(cfg, model, strategy, comm.size, hosts, train_set, test_set=test_set):
        say(line)
    if meter is not None:
        say(meter.describe())
    stopped = stop.before_first_step(comm) if stop is not None and start < cfg.steps else 0
    if stopped:                                     # nothing new to save: exit to be requeued
        say(f"asked to stop ({signal.Signals(stopped).name}) before step {start + 1}: "
            "nothing new to save" + (f"; the checkpoint of step {start} stays the latest"
                                     if start else ""))
    run = loop.Run(cfg=cfg, comm=comm, model=model, strategy=strategy, train_set=train_set,
                   test_set=test_set, sampler=sampler, metrics=metrics, meter=meter, say=say)
    run.save, run.held_out = loop.actions(run)
    if strategy.brings_loop:                         # a parameter server: answers the workers
        return strategy.run(stop, run.save, stopped, start)
    run.mark = recovery.Mark(cfg, comm)              # the committed step (--on-failure shrink)
    try:
        final, history = loop.steps(run, loop.Start(step=start, stop=stop, stopped=stopped))
    except Exception as e:                           # a peer died: RankLost, else as it was
        for f in (metrics, logfile):
            if f is not None:
                f.close()
        raise recovery.caught(e, cfg, strategy, sampler, run.mark)
    if backend.device_label() == "gpu":                # (an asked path that could not run:
        say(f"attention ({cfg.attention}): {kernels.attention.choice()}")  # flash, said here)
    if metrics is not None:
        metrics.record(final)
        metrics.close()
    if logfile is not None:
        logfile.close()
    final["history"] = history                    # every step's record (tests compare them)
    final["params"] = backend.to_numpy(strategy.full_parameters())   # on the host (tests compare)
    getattr(strategy, "close", lambda: None)()   # communicators a strategy made for itself
    return final


def _resume(cfg, comm, strategy, sampler, resume, say) -> int:
    """Load the checkpoint ``prepare`` found (any layout); the step it holds (0: none)."""
    if resume is None:
        return 0
    _, note, reader = resume
    start = 0
    if reader is not None:                       # (a recovery from the seed has none)
        extra = state.restore_checkpoint(reader, cfg, comm, strategy, sampler)
        start = reader.step
        note += f" at step {start}" + (f" ({extra})" if extra else "")
    say(note)
    change = reader is not None and state.schedule_change(reader.scalars.get("schedule"), cfg,
                                                          start)
    if change:
        say(change)
    return start


def main(argv=None) -> int:
    report.quiet_overflows()
    if ulfm.spawned():                                 # started by survivors (--respawn)
        return recovery.join(train, prepare)
    errors = (ConfigError, backend.DeviceError, checkpoint.CheckpointError, OSError, ValueError,
              savedir.SaveDirError)
    message, cfg, said = None, None, []
    try:
        cfg = _parse_once(argv)
    except errors as e:
        message = str(e)
    # What a signal means is decided here, once, before anything can be signalled: SIGINT
    # stops the run after a step; with a checkpoint folder SIGTERM and SIGUSR1 too (saving).
    if cfg is not None:
        signals.checkpoint_on_signal(checkpoint=bool(cfg.save_dir))
    mfu.probe_before_mpi(cfg)                          # the CPU's peak, while nobody spins
    if cfg is not None and cfg.on_failure == "shrink" and ulfm.problem() is None:
        ulfm.enable_world()                            # before any communicator is made
    comm = Communicator(abort_on_error=True)           # collective: every rank, always
    supervisor.tell(comm.rank, comm.size)
    if message is None:
        message = runtime.launch_problem(comm.size, cfg.allow_singletons)
    if message is None and cfg.on_failure == "shrink":
        message = ulfm.problem()
    if message is None and comm.rank == 0:             # whose folders they are (rank 0 decides)
        message, said = _claim_folders(cfg, errors)
    message = runtime.agree_on_error(comm, message)
    if message is None:
        for line in said:
            print(line)
        try:                                           # every check that needs no collective
            watchdog.set_timeout(cfg.timeout or None)
            runtime.test_hooks("prepare")
            message = savedir.writable_problems(cfg, comm.rank)
            if message is None:
                prepared = prepare(cfg, comm)
        except errors as e:
            message = str(e)
        message = runtime.agree_on_error(comm, message)
        if message is None:                            # validated: --overwrite moves now
            message = _commit_folders(comm, errors)
    if message is not None:
        if comm.rank == 0:                             # nothing of a refused run left behind
            savedir.unclaim()
        if message:
            print(f"hpcdist.train: error: {message}", file=sys.stderr)
        return 2
    resume = prepared[1]
    if resume is not None and resume[2] is not None and resume[2].step >= cfg.steps:
        if comm.rank == 0:                             # nothing left to do: say so
            print(f"nothing to do: {resume[0]} is at step {resume[2].step} and --steps is "
                  f"{cfg.steps}; raise --steps to train further")
        return 0
    final = recovery.train_through_failures(train, cfg, comm, prepared)
    if final is None:
        return 1
    if final.get("event") == "preempted":
        return exit_code(signal.Signals[final["signal"]])
    return 0


def _claim_folders(cfg, errors) -> tuple:
    """Rank 0 claims --save-dir and --out-dir: (the refusal or None, the lines to print)."""
    try:
        said = savedir.claim(cfg.save_dir, cfg.resume, cfg.overwrite, data=cfg.data,
                             others_ok=cfg.allow_other_files, trace=cfg.trace) \
            if cfg.save_dir else []
        if savedir.check_writable(cfg.out_dir, "--out-dir") is None:
            savedir.claim_out_dir(cfg.out_dir, cfg.save_dir)
    except errors as e:
        return str(e), []
    return None, said


def _commit_folders(comm, errors) -> str | None:
    """The run is validated on every rank: rank 0 carries out what its claim held back
    (--overwrite's move of the old run); every rank learns whether that failed."""
    message = None
    try:
        for line in savedir.commit() if comm.rank == 0 else []:
            print(line)
    except errors as e:
        message = str(e)
    return runtime.agree_on_error(comm, message)


def _parse_once(argv):
    """The configuration; ``--help`` is printed by rank 0 only (every rank parses)."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() == 0:
        return parse_config(argv)
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        return parse_config(argv)


if __name__ == "__main__":
    code = main()
    if ulfm.era():           # after a recovery Open MPI 5's MPI_Finalize can wait forever on
        sys.stdout.flush()   # the ranks lost (two lost at once: one run in two hung here);
        sys.stderr.flush()   # the survivors leave without it, and the launcher still reports
        os._exit(code)       # their exit code (tests/ulfm)
    sys.exit(code)
