"""Timeline recording, clock mapping and the alpha-beta model, without MPI."""
import threading

import numpy as np
import pytest

from hpcdist.run import runtime
from hpcdist.host import timeline
from hpcdist.comm import model


def test_nothing_is_recorded_without_an_active_recorder():
    assert timeline.active() is None
    with timeline.span("forward"):
        pass
    with timeline.collective("allreduce", "ring", 8, 2) as info:
        assert info is None


def test_recorder_spans_threads_and_collective_totals():
    rec = timeline.Recorder(rank=3)
    timeline.activate(rec)
    try:
        with timeline.span("forward", micro=0):
            pass
        for _ in range(2):
            with timeline.collective("allreduce", "ring", 1024, 4):
                pass

        def worker():
            with timeline.collective("recv", "p2p", 0, 4) as info:
                info["bytes"] = 64               # known only once the message arrived
        t = threading.Thread(target=worker, name="worker")
        t.start()
        t.join()
    finally:
        timeline.deactivate()
    names = [e[0] for e in rec.events]
    assert names == ["forward", "allreduce", "allreduce", "recv"]
    assert rec.events[0][2] == 0 and rec.events[-1][2] == 1          # main, then worker
    assert rec.events[0][5] == {"micro": 0}
    assert rec.events[1][5] == {"bytes": 1024, "algorithm": "ring", "ranks": 4, "link": "intra"}
    assert rec.calls[("allreduce", "ring", 1024, 4, "intra")][0] == 2
    assert rec.calls[("recv", "p2p", 64, 4, "intra")][0] == 1
    assert all(e[4] >= e[3] for e in rec.events)


def test_recorder_drops_beyond_its_limit():
    rec = timeline.Recorder(rank=0, max_events=3)
    for i in range(5):
        rec.add("x", "compute", i, i + 1)
    assert len(rec.events) == 3 and rec.dropped == 2


def test_clock_mapping_interpolates_a_drifting_offset():
    clocks = timeline.ClockSync()
    # rank 1's clock runs 1e-4 fast: offset 1000 ns at rank-0 time 0, 101000 ns at 1e9
    clocks.t = [0, 10 ** 9]
    clocks.offsets = [np.array([0, 1000]), np.array([0, 101_000])]
    true = np.array([0, 2 * 10 ** 8, 10 ** 9, 2 * 10 ** 9], dtype=np.int64)  # rank-0 times
    local = true + (1000 + (true * 1e-4)).astype(np.int64)
    np.testing.assert_allclose(clocks.to_rank0(1, local), true, atol=2)
    np.testing.assert_array_equal(clocks.to_rank0(0, true), true)
    one = timeline.ClockSync()
    one.t, one.offsets = [5], [np.array([0, -300])]
    np.testing.assert_array_equal(one.to_rank0(1, np.array([700])), [1000])


def test_alpha_beta_model_matches_the_formulas():
    a, b, n = 2e-6, 1e-9, 1 << 20
    assert model.predict("allreduce", n, 1, a, b) == 0
    # ring on 4 ranks: 2 log2 4 check latencies + 2(P-1) messages of n/P bytes
    assert model.predict("allreduce", n, 4, a, b, "ring") == pytest.approx(
        2 * a + 6 * a + 1.5 * n * b)
    # recursive doubling on 6 ranks: fold to 4 (2 messages of n), 2 rounds, 3 check latencies
    assert model.predict("allreduce", n, 6, a, b, "recursive_doubling") == pytest.approx(
        3 * a + 2 * (a + n * b) + 2 * (a + n * b))
    assert model.predict("allreduce", n, 8, a, b, "rabenseifner") == pytest.approx(
        3 * a + 6 * a + 2 * 7 / 8 * n * b)
    assert model.predict("reduce_scatter", n, 4, a, b) == pytest.approx(2 * a + 3 * a + 0.75 * n * b)
    assert model.predict("send", n, 4, a, b) == pytest.approx(a + n * b)
    assert model.predict("bcast", n, 8, a, b, "binomial") == pytest.approx(3 * a + 3 * (a + n * b))
    # all-to-all pairwise on 4 ranks: 2 check latencies + 3 messages of n/4 bytes; Bruck's: 2
    # rounds of n/2 bytes
    assert model.predict("alltoall", n, 4, a, b, "pairwise") == pytest.approx(
        2 * a + 3 * (a + n / 4 * b))
    assert model.predict("alltoall", n, 4, a, b, "bruck") == pytest.approx(
        2 * a + 2 * (a + n / 2 * b))
    with pytest.raises(ValueError, match="no cost model"):
        model.predict("gather", n, 4, a, b)
    assert model.busbw_factor("allreduce", 4) == 1.5
    assert model.busbw_factor("allgather", 4) == 0.75
    assert model.busbw_factor("bcast", 4) == 1.0 and model.busbw_factor("allreduce", 1) == 1.0


def test_comm_log_table_formats_rows():
    rows = [{"collective": "allreduce", "algorithm": "ring", "bytes": 4096, "ranks": 2,
             "calls": 3, "total_s": 0.003, "time_us": 1000.0, "algbw_GBs": 0.004,
             "busbw_GBs": 0.004, "model_us": 500.0},
            {"collective": "barrier", "algorithm": "dissemination", "bytes": 0, "ranks": 2,
             "calls": 1, "total_s": 0.0, "time_us": 3.0, "algbw_GBs": 0.0, "busbw_GBs": 0.0,
             "model_us": None}]
    text = runtime.format_comm_log(rows, 2e-6, 1e-9)
    lines = text.splitlines()
    assert "alpha 2.0 us" in lines[0] and "1/beta 1.00 GB/s" in lines[0]
    assert lines[2].split() == ["allreduce", "ring", "intra", "4096", "3", "3.0", "1000.0",
                                "0.004", "0.004", "500.0", "2.00"]
    assert lines[3].split()[-2:] == ["-", "-"]
