"""Traces, the communication log and stopping on a signal, at every world size."""
import json
import os

import numpy as np
import pytest

from hpcdist.host import timeline
from hpcdist.comm.model import predict
from hpcdist.comm.select import SHORT, choose_allreduce, is_short
from hpcdist.train import train

import helpers

pytestmark = pytest.mark.mpi


def small(**kw):
    return helpers.small(**{"steps": 6, **kw})


def test_clock_offsets_on_one_node_are_within_half_a_round_trip(comm):
    """Every rank here reads the same monotonic clock, so the true offsets are 0 and each
    estimate may be off by at most half the round trip it came from."""
    got = timeline.clock_offsets(comm.mpi, rounds=30, with_rtt=True)
    if comm.rank == 0:
        offsets, rtts = got
        assert offsets[0] == 0
        for r in range(1, comm.size):
            assert rtts[r] > 0
            assert abs(offsets[r]) <= rtts[r] // 2 + 1000, (r, offsets[r], rtts[r])
    else:
        assert got is None


def test_trace_has_every_rank_and_respects_causality(comm, shared_dir):
    path = os.path.join(shared_dir, "trace.json")
    train(small(trace=path, out_dir=os.path.join(shared_dir, "out")), comm, log=lambda *a: None)
    assert timeline.active() is None                      # recording ends with the run
    if comm.rank == 0:
        doc = json.load(open(path))
        events = doc["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == set(range(comm.size))
        names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
        assert names == {(r, f"rank {r}") for r in range(comm.size)}
        for r in range(comm.size):
            mine = [e for e in spans if e["pid"] == r]
            for what in ("forward", "backward", "gradient sync", "optimizer step", "step"):
                assert sum(e["name"] == what for e in mine) == 6, (r, what)
            steps = sorted((e for e in mine if e["name"] == "step"), key=lambda e: e["ts"])
            fwd = sorted((e for e in mine if e["name"] == "forward"), key=lambda e: e["ts"])
            for s, f in zip(steps, fwd):                  # forward nests inside its step
                assert s["ts"] <= f["ts"] and f["ts"] + f["dur"] <= s["ts"] + s["dur"] + 1e-3
            for e in mine:
                assert e["dur"] >= 0 and {"name", "cat", "ts", "pid", "tid"} <= set(e)
                if e["cat"] == "comm":
                    assert e["args"]["bytes"] >= 0 and e["args"]["algorithm"]
        # The bucket allreduces: call i cannot finish on any rank before every rank started
        # it. On rank 0's clock that holds to within the alignment error (half a round trip).
        if comm.size > 1:
            calls = {r: sorted((e for e in spans if e["pid"] == r and e["name"] == "allreduce"
                                and e["tid"] != 0), key=lambda e: e["ts"]) for r in range(comm.size)}
            assert len({len(v) for v in calls.values()}) == 1 and len(calls[0]) == 6
            for i in range(6):
                latest_start = max(calls[r][i]["ts"] for r in calls)
                first_end = min(calls[r][i]["ts"] + calls[r][i]["dur"] for r in calls)
                assert first_end >= latest_start - 500, (i, first_end, latest_start)  # us


def test_comm_log_counts_calls_bytes_and_models_them(comm, shared_dir):
    out = os.path.join(shared_dir, "log")
    lines = []
    final = train(small(comm_log=True, out_dir=out), comm, log=lines.append)
    if comm.rank == 0:
        text = "\n".join(lines)
        assert "communication log" in text
        doc = json.load(open(os.path.join(out, "comm_log.json")))
        nbytes = final["params"].nbytes
        rows = [r for r in doc["rows"] if r["collective"] == "allreduce" and r["bytes"] == nbytes]
        if comm.size == 1:               # the average over one rank is the identity: no calls
            assert rows == []
            return
        assert len(rows) == 1
        row = rows[0]
        want = SHORT if is_short("allreduce", nbytes, comm.size) else choose_allreduce(nbytes,
                                                                                        comm.size)
        assert row["calls"] == 6 and row["algorithm"] == want
        assert row["time_us"] > 0 and row["total_s"] > 0
        if comm.size > 1:
            assert row["model_us"] == pytest.approx(
                predict("allreduce", nbytes, comm.size, doc["alpha_s"], doc["beta_s_per_byte"])
                * 1e6)
            assert row["busbw_GBs"] == pytest.approx(
                row["algbw_GBs"] * 2 * (comm.size - 1) / comm.size)


@pytest.mark.parametrize("zero", [0, 3])
def test_signal_on_one_rank_stops_every_rank_at_the_same_step_and_resume_matches(
        comm, shared_dir, monkeypatch, zero):
    """SIGUSR1 reaches one rank during step 3: every rank stops after step 4 with a
    checkpoint, and resuming from it ends bit-identical to a run that never stopped
    (plain DDP and ZeRO-3, whose gathers share the progress thread with the agreement)."""
    victim = comm.size - 1
    ckpt = os.path.join(shared_dir, "ckpt")
    cfg = dict(steps=8, dropout=0.1, zero=zero)
    monkeypatch.setenv("HPCDIST_SIGNAL_AT", f"{victim}:3")
    first = train(small(save_dir=ckpt, out_dir=os.path.join(shared_dir, "a"), **cfg), comm,
                  log=lambda *a: None)
    monkeypatch.delenv("HPCDIST_SIGNAL_AT")
    assert first["event"] == "preempted" and first["step"] == 4 and first["signal"] == "SIGUSR1"
    steps = comm.mpi.allgather(first["step"])
    assert steps == [4] * comm.size
    assert os.path.isdir(os.path.join(ckpt, "step_00000004"))
    resumed = train(small(save_dir=ckpt, resume=True, out_dir=os.path.join(shared_dir, "b"),
                          **cfg), comm, log=lambda *a: None)
    whole = train(small(out_dir=os.path.join(shared_dir, "c"), **cfg), comm, log=lambda *a: None)
    assert resumed["event"] == "final"
    np.testing.assert_array_equal(resumed["params"], whole["params"])
