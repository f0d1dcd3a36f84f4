"""Pipeline schedules and their verifier: pure logic, no MPI."""
import pytest

from hpcdist.parallel import schedules as S
from hpcdist.parallel.schedules import partition


def _all_cases():
    for name in S.SCHEDULES:
        for P in range(1, 9):
            for m in range(1, 17):
                for v in (range(1, 4) if name == "interleaved" else [1]):
                    yield name, P, m, v


def test_every_schedule_is_verified_or_refused_with_a_reason():
    verified = refused = 0
    for name, P, m, v in _all_cases():
        try:
            sched = S.make(name, P, m, v)
        except S.ScheduleError as e:      # never a hang: a reason, naming what to change
            assert any(w in str(e) for w in ("multiple of", "needs --pp", "virtual-stages"))
            refused += 1
            continue
        result = S.verify(sched, P, m, v, stash_limit=S.promised_stash(name, P, m, v))
        assert 0 <= result.bubble < 1
        verified += 1
    assert verified > 400 and refused > 0


@pytest.mark.parametrize("P, m", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 3)])
def test_gpipe_and_1f1b_bubble_and_stash_match_the_theory(P, m):
    costs = {"F": 1.0, "B": 2.0}
    for name in ("gpipe", "1f1b"):
        r = S.verify(S.make(name, P, m), P, m, costs=costs)
        assert r.bubble == pytest.approx((P - 1) / (m + P - 1), abs=1e-12)
    assert S.verify(S.make("gpipe", P, m), P, m).peak_stash == [m] * P
    assert S.verify(S.make("1f1b", P, m), P, m).peak_stash == [min(P - s, m) for s in range(P)]


@pytest.mark.parametrize("P, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 9, 2)])
def test_interleaved_bubble_matches_the_theory(P, m, v):
    r = S.verify(S.make("interleaved", P, m, v), P, m, v, costs={"F": 1.0, "B": 2.0})
    assert r.bubble == pytest.approx((P - 1) / (v * m + P - 1), abs=1e-12)


@pytest.mark.parametrize("P, m, most", [(2, 8, 0.40), (4, 16, 0.65), (8, 32, 0.6)])
def test_zb_h1_cuts_the_1f1b_bubble_at_1f1b_memory(P, m, most):
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    base = S.verify(S.make("1f1b", P, m), P, m, costs=costs)
    zb = S.verify(S.make("zb-h1", P, m), P, m, costs=costs)
    assert zb.bubble < most * base.bubble
    assert max(zb.peak_stash) <= max(base.peak_stash)


def test_clear_errors_for_impossible_parameters():
    with pytest.raises(S.ScheduleError, match="not a multiple of --pp 4"):
        S.make("interleaved", 4, 6, 2)
    with pytest.raises(S.ScheduleError, match="needs --schedule interleaved"):
        S.make("1f1b", 2, 4, 2)
    with pytest.raises(S.ScheduleError, match="unknown schedule"):
        S.make("pipedream", 2, 4)
    with pytest.raises(S.ScheduleError, match=">= 1"):
        S.make("gpipe", 2, 0)


def _hand(P=2, m=2):
    """A hand-written 2-stage GPipe with one op per COMM."""
    A, Op = S.Action, S.Op
    s0 = [S.F(0), A("COMM", ops=(Op("SEND", "ACT", 0, 0, 1),)), S.F(1),
          A("COMM", ops=(Op("SEND", "ACT", 1, 0, 1),)),
          A("COMM", ops=(Op("RECV", "GRAD", 0, 0, 1),)), S.B(0),
          A("COMM", ops=(Op("RECV", "GRAD", 1, 0, 1),)), S.B(1)]
    s1 = [A("COMM", ops=(Op("RECV", "ACT", 0, 0, 0),)), S.F(0),
          A("COMM", ops=(Op("RECV", "ACT", 1, 0, 0),)), S.F(1), S.B(0),
          A("COMM", ops=(Op("SEND", "GRAD", 0, 0, 0),)), S.B(1),
          A("COMM", ops=(Op("SEND", "GRAD", 1, 0, 0),))]
    return [s0, s1]


def test_hand_written_schedule_is_accepted():
    S.verify(_hand(), 2, 2)


def test_swapped_send_and_receive_deadlock_named_per_stage():
    sched = _hand()
    s0 = sched[0]
    s0[1], s0[4] = s0[4], s0[1]        # stage 0 waits for gradient 0 before sending activation 0
    with pytest.raises(S.ScheduleError, match=r"deadlock: stage 0 waits at action 1: "
                                              r"COMM\[RECV_GRAD\(mb 0, chunk 0, from 1\)\]; "
                                              r"stage 1 waits at action 0: "
                                              r"COMM\[RECV_ACT\(mb 0, chunk 0, from 0\)\]"):
        S.verify(sched, 2, 2)


def test_backward_before_its_gradient_arrives_is_refused():
    sched = _hand()
    s0 = sched[0]
    s0[4], s0[6] = s0[6], s0[4]        # stage 0 receives gradient 1, then runs B0
    with pytest.raises(S.ScheduleError, match="stage 0: action 5 B0 runs before its gradient "
                                              "is received"):
        S.verify(sched, 2, 2)


def test_missing_receive_is_refused():
    sched = _hand()
    del sched[1][2]                    # stage 1 never receives micro-batch 1's activation
    with pytest.raises(S.ScheduleError, match="stage 1: action 2 F1 runs before its activation "
                                              "is received"):
        S.verify(sched, 2, 2)
    sched = _hand()                    # a send that nobody receives
    sched[0].append(S.Action("COMM", ops=(S.Op("SEND", "ACT", 1, 0, 1),)))
    with pytest.raises(S.ScheduleError, match=r"stage 0: SEND_ACT\(mb 1, chunk 0, to 1\) has "
                                              "no matching receive"):
        S.verify(sched, 2, 2)


def test_backward_before_forward_is_refused_naming_the_stage():
    sched = _hand()
    sched[1][3], sched[1][4] = sched[1][4], sched[1][3]      # B0 before F1: fine
    S.verify(sched, 2, 2)
    sched = _hand()
    s1 = sched[1]
    s1.insert(0, s1.pop(4))                                 # B0 before F0
    with pytest.raises(S.ScheduleError, match="stage 1: B0 comes before F0"):
        S.verify(sched, 2, 2)


def test_shape_mismatch_between_stages_is_refused():
    sched = _hand()
    op = sched[1][0].ops[0]
    sched[1][0] = S.Action("COMM", ops=(S.Op(op.kind, op.what, op.mb, op.chunk, op.peer,
                                             (2, 3, 4)),))
    op = sched[0][1].ops[0]
    sched[0][1] = S.Action("COMM", ops=(S.Op(op.kind, op.what, op.mb, op.chunk, op.peer,
                                             (2, 3, 5)),))
    with pytest.raises(S.ScheduleError, match="shape mismatch"):
        S.verify(sched, 2, 2)


def test_stash_above_the_promise_is_refused():
    with pytest.raises(S.ScheduleError, match="stage 0 stashes 4 micro-batches, more than the 2"):
        S.verify(S.make("gpipe", 2, 4), 2, 4, stash_limit=S.promised_stash("1f1b", 2, 4))


def test_partition():
    assert partition(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert partition(5, 3, [1, 1, 3]) == [(0, 1), (1, 2), (2, 5)]
    with pytest.raises(ValueError, match="adding up to n_layer"):
        partition(5, 3, [2, 2, 2])
    assert partition(2, 4) == [(0, 0), (0, 1), (1, 2), (2, 2)]   # embed | 1 | 1 | head
    assert partition(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    with pytest.raises(ValueError, match="every stage but the first and the last needs a block"):
        partition(1, 4)


def test_zb_h1_planned_with_measured_costs_beats_1f1b_where_unit_costs_do_not():
    real = {"F": 2.7, "B": 6.7, "I": 5.2, "W": 1.95, "send": 0.1}     # measured here (README)
    P, m = 4, 16
    base = S.verify(S.make("1f1b", P, m), P, m, costs=real)
    unit = S.verify(S.make("zb-h1", P, m), P, m, costs=real)
    aware = S.verify(S.make("zb-h1", P, m, costs=real), P, m, costs=real,
                     stash_limit=S.promised_stash("zb-h1", P, m))
    assert unit.bubble > base.bubble            # the unit-cost order does not fit these costs
    assert aware.bubble < 0.75 * base.bubble
