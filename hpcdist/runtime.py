"""What a training run leaves beside its metrics: the rank table, the metrics file, the
Chrome trace and communication log; and the fault-injection hooks the tests use."""
from __future__ import annotations

import json
import os
import signal
import socket

import numpy as np

from . import checkpoint, timeline


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


def test_hooks(rank: int, step: int) -> None:
    """Test hooks: HPCDIST_FAIL_AT=RANK:STEP raises on that rank at that step;
    HPCDIST_SIGNAL_AT=RANK:STEP[:SIGNAL] sends that rank SIGNAL (default SIGUSR1) there —
    STEP a step number or a moment: prepare (data preparation), start (before the first
    step), save (as a checkpoint save begins), end (after the last step);
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


def report_timeline(cfg, comm, recorder, clocks, alpha_beta, log) -> None:
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
