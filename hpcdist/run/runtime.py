"""What a training run leaves beside its metrics: the rank table, the metrics file, the
Chrome trace and communication log; and the fault-injection hooks the tests use."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

import numpy as np

from .. import checkpoint
from ..host import timeline
from ..comm import hierarchical, model, select


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


# What a launcher tells the processes it starts about the world it made: the variable, who
# sets it. The first that is set wins (each launcher sets its own; SLURM's step variables
# only mean this launch when srun started it: sbatch's batch shell has no step).
LAUNCHER_SIZES = (("PMI_SIZE", "the MPICH/Hydra or srun --mpi=pmi2 launcher"),
                  ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
                  ("PMIX_SIZE", "a PMIx launcher"),
                  ("SLURM_STEP_NUM_TASKS", "srun"),
                  ("SLURM_NTASKS", "sbatch or salloc"))


def launch_problem(world: int, allowed: bool = False) -> str | None:
    """Why this 1-rank world is not what the launcher meant (None: it is, or ``allowed``).

    A launcher/MPI mismatch — srun without ``--mpi=pmi2`` for an MPI that speaks PMI-2,
    mpi4py built against another MPI than the mpirun used — starts every task as its own
    1-rank world: N copies of the run, writing the same files."""
    if world != 1 or allowed:
        return None
    import os
    for var, who in LAUNCHER_SIZES:
        value = os.environ.get(var, "")
        if value.isdigit():
            if int(value) <= 1:
                return None
            if var == "SLURM_NTASKS":
                return (f"the job has {value} tasks (SLURM_NTASKS) but this process is a world "
                        "of 1 rank that no launcher started: start the ranks with srun "
                        "--mpi=pmi2 (or mpiexec) inside the job. --allow-singletons runs "
                        "one rank anyway")
            return (f"the launcher promised {value} tasks ({var}, set by {who}) but MPI "
                    "started a world of 1 rank: every task is running alone. Likely causes: "
                    "srun without --mpi=pmi2 (or the --mpi your MPI speaks: srun --mpi=list), "
                    "or mpi4py built against another MPI than the launcher's (python -c "
                    "'from mpi4py import MPI; print(MPI.Get_library_version())'). "
                    "--allow-singletons runs anyway")
    return None


def tee(log, logfile):
    """``log`` that also writes each line to ``logfile`` (train.log), flushed per line."""
    if logfile is None:
        return log

    def say(*args, **kw):
        log(*args, **kw)
        logfile.write(" ".join(str(a) for a in args) + "\n")
        logfile.flush()
    return say


class RunFile:
    """A record of the run (metrics.jsonl, train.log) whose failure never ends the run: a
    write that fails (a full disk, a quota, a file-size limit) warns once on stderr, naming
    the file and the error, and the file is written no more; training and its
    checkpoints go on (a checkpoint has its own checks and says when it cannot be written).
    --resume later appends to the file again."""

    def __init__(self, f, path: str):
        self.f, self.path, self.failed = f, path, None
        self.whole = os.path.getsize(path)       # bytes of whole lines written
        self.sinks = None                        # --tensorboard, --wandb (run/sinks.py)

    def record(self, rec: dict) -> None:
        """``rec`` as a JSON line (metrics.jsonl), and to the run's sinks as it is."""
        self.write(json.dumps(rec) + "\n")
        if self.sinks is not None:
            self.sinks.add(rec)

    def write(self, text: str) -> None:
        self._do(lambda: self.f.write(text))
        if self.failed is None and text.endswith("\n"):
            self.whole += len(text.encode())

    def flush(self) -> None:
        self._do(self.f.flush)

    def close(self) -> None:
        self._do(self.f.close)
        if self.sinks is not None:
            self.sinks.flush()

    def _do(self, op) -> None:
        if self.failed is not None:
            return
        try:
            op()
        except OSError as e:
            self.failed = e.strerror or str(e)
            print(f"[hpcdist] warning: writing {self.path} failed ({self.failed}); it is not "
                  f"written any more in this run, which goes on (checkpoints are written as "
                  f"before): free space in {os.path.dirname(os.path.abspath(self.path))}",
                  file=sys.stderr, flush=True)
            try:
                self.f.close()
            except OSError:
                pass
            try:                                 # no torn last line for a reader (or
                os.truncate(self.path, self.whole)   # --resume's append) to stumble on
            except OSError:
                pass


EARLIER_RUNS = 5      # a new run keeps this many earlier runs' train.log and metrics.jsonl


def open_run_file(out_dir: str, name: str, resumed: bool, say):
    """``out_dir/name`` (metrics.jsonl, train.log) for appending. A resumed run continues the
    file; a new run moves the earlier run's file to name.1 (as logrotate does: .1 the newest,
    each older one up a number, the ``EARLIER_RUNS`` newest kept), rather than truncating
    it: runs that share the default out folder do not pile up files there."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    if not resumed and os.path.exists(path) and os.path.getsize(path) > 0:
        for n in range(EARLIER_RUNS, 0, -1):
            if os.path.exists(f"{path}.{n}"):
                if n == EARLIER_RUNS:
                    os.remove(f"{path}.{n}")
                else:
                    os.replace(f"{path}.{n}", f"{path}.{n + 1}")
        os.replace(path, f"{path}.1")
        say(f"moved the earlier {path} to {path}.1 (the {EARLIER_RUNS} newest earlier runs "
            "are kept)")
    return RunFile(open(path, "a", buffering=1), path)   # a line at a time: tail -f shows each


_launched = []                                      # [this process's launch rank or None]


def _launch_rank():
    """MPI_COMM_WORLD's rank, None in a process the survivors spawned (asked once: the
    hooks run in every step)."""
    if not _launched:
        from mpi4py import MPI
        _launched.append(None if MPI.Comm.Get_parent() != MPI.COMM_NULL
                         else MPI.COMM_WORLD.Get_rank())
    return _launched[0]


def test_hooks(step) -> None:
    """Test hooks, RANK the one the launcher started (MPI_COMM_WORLD's: after a recovery
    renumbers the ranks, a hook still fires in one process only):
    HPCDIST_FAIL_AT=RANK:STEP raises on that rank at that step;
    HPCDIST_SIGNAL_AT=RANK:STEP[:SIGNAL][,...] sends that rank SIGNAL (default SIGUSR1) there —
    STEP a step number or a moment: prepare (data preparation), start (before the first
    step), save (as a checkpoint save begins), end (after the last step);
    HPCDIST_FSIZE_AT=RANK:STEP:BYTES limits that rank's file size (a full disk) from there."""
    rank = _launch_rank()
    if rank is None:                                # a process that joined (--respawn): none
        return
    spec = os.environ.get("HPCDIST_FAIL_AT")
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (HPCDIST_FAIL_AT)")
    for one in os.environ.get("HPCDIST_SIGNAL_AT", "").split(","):
        spec = one.split(":")
        if len(spec) >= 2 and spec[:2] == [str(rank), str(step)]:
            os.kill(os.getpid(), getattr(signal, spec[2] if len(spec) > 2 else "SIGUSR1"))
    spec = os.environ.get("HPCDIST_FSIZE_AT", "").split(":")
    if len(spec) == 3 and spec[:2] == [str(rank), str(step)]:
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(spec[2]), int(spec[2])))


def report_timeline(cfg, comm, recorder, clocks, links, log) -> None:
    """Write the Chrome trace and print the communication log (collective). ``links``: the
    per-level alpha-beta fits (comm.model.fit_links)."""
    clocks.measure(comm.mpi)
    if cfg.trace:
        try:                                     # (rank 0 writes; a failure is said, the
            path = timeline.write_chrome_trace(  # run's results stand)
                cfg.trace, recorder, clocks, comm.mpi,
                metadata={"world": comm.size, "task": cfg.task})
        except OSError as e:
            path = None
            log(f"[hpcdist] warning: the Chrome trace {cfg.trace} was not written: {e}")
        if path:
            log(f"wrote Chrome trace {path} ({comm.size} ranks; open in ui.perfetto.dev)")
    if cfg.comm_log:
        rows = comm_log(recorder, comm.mpi, links, comm.topology)
        if rows is not None:
            alpha, beta = links.get("intra", next(iter(links.values())))
            log(format_comm_log(rows, alpha, beta, links.get("inter")))
            path = os.path.join(cfg.out_dir, "comm_log.json")
            try:
                os.makedirs(cfg.out_dir, exist_ok=True)
                with open(path, "w") as f:
                    json.dump({"alpha_s": alpha, "beta_s_per_byte": beta,
                               "links": {k: {"alpha_s": a, "beta_s_per_byte": b}
                                         for k, (a, b) in links.items()},
                               "rows": rows}, f, indent=1)
            except OSError as e:
                log(f"[hpcdist] warning: {path} was not written: {e}")


# ---- communication log ------------------------------------------------------------------------------

def comm_log(recorder: "timeline.Recorder", mpi, links: dict, topology=None) -> list | None:
    """Rows of the communication log on rank 0 (None elsewhere): per collective, algorithm,
    size and link, the calls and seconds summed on rank 0, the mean time per call averaged
    over the ranks, algbw and busbw from that mean, and the prediction of the alpha-beta
    model of the link it used (``links``: level -> (alpha, beta)). Collective."""
    mine = [[*key, c, s] for key, (c, s) in recorder.calls.items()]
    everyone = timeline.gather_json(mpi, mine)
    if everyone is None:
        return None
    per_call = {}                                    # key -> [mean seconds per call on each rank]
    calls = {}
    for rank, rows in enumerate(everyone):
        for k, a, n, p, link, c, s in rows:
            key = (k, a, n, p, link)
            per_call.setdefault(key, []).append(s / c)
            if rank == 0:
                calls[key] = (c, s)
    rows = []
    for key in sorted(per_call, key=lambda k: (k[0], k[1], k[2])):
        kind, algorithm, nbytes, P, link = key
        c, total = calls.get(key, (0, 0.0))
        t = float(np.mean(per_call[key]))
        predicted = None
        try:
            if link == "2-level" and topology is not None and "inter" in links:
                predicted = hierarchical.two_level_times(kind, nbytes, select.Topology(
                    topology.nodes, topology.per_node, {**select.DEFAULT_LINKS, **links}))[1]
            elif link in links or "intra" in links:
                alpha, beta = links.get(link, links.get("intra"))
                predicted = model.predict(kind, nbytes, P, alpha, beta,
                                          "" if algorithm in ("auto", "-") else algorithm)
        except (ValueError, KeyError):
            predicted = None
        rows.append({"collective": kind, "algorithm": algorithm, "link": link,
                     "bytes": nbytes, "ranks": P,
                     "calls": c, "total_s": total, "time_us": t * 1e6,
                     "algbw_GBs": nbytes / t / 1e9 if t > 0 else 0.0,
                     "busbw_GBs": nbytes / t / 1e9 * model.busbw_factor(kind, P) if t > 0 else 0.0,
                     "model_us": predicted * 1e6 if predicted is not None else None})
    return rows


def format_comm_log(rows: list, alpha: float, beta: float, inter=None) -> str:
    def link(a, b):
        return f"alpha {a * 1e6:.1f} us, 1/beta {f'{1 / b / 1e9:.2f} GB/s' if b else 'inf'}"
    models = f"model: {link(alpha, beta)}" + (f"; across nodes {link(*inter)}" if inter else "")
    lines = [f"communication log (rank 0's calls and total; time per call averaged over ranks; "
             f"{models} from a ping-pong)",
             f"{'collective':<17s}{'algorithm':<26s}{'link':<8s}{'bytes':>11s}{'calls':>8s}{'total ms':>10s}"
             f"{'us/call':>10s}{'algbw GB/s':>11s}{'busbw GB/s':>11s}{'model us':>10s}"
             f"{'meas/model':>11s}"]
    for r in rows:
        m = r["model_us"]
        ratio = f"{r['time_us'] / m:11.2f}" if m else f"{'-':>11s}"
        lines.append(f"{r['collective']:<17s}{r['algorithm']:<26s}{r.get('link', 'intra'):<8s}"
                     f"{r['bytes']:>11d}{r['calls']:>8d}"
                     f"{r['total_s'] * 1e3:10.1f}{r['time_us']:10.1f}{r['algbw_GBs']:11.3f}"
                     f"{r['busbw_GBs']:11.3f}{(f'{m:10.1f}' if m is not None else f'{chr(45):>10s}')}"
                     f"{ratio}")
    return "\n".join(lines)


def agree_on_error(comm, message: str | None) -> str | None:
    """Every rank learns whether any rank failed setup; the lowest failing rank reports."""
    flag = comm.allreduce(np.array([1.0 if message else 0.0,
                                    (comm.size - comm.rank) if message else 0.0]), op="max")
    if flag[0] == 0:
        return None
    reporter = comm.size - int(flag[1])
    if comm.rank == reporter:
        return message if comm.size == 1 else f"rank {comm.rank}: {message}"
    return ""       # another rank reports it; this one exits quietly with the same code
