"""A new pipeline schedule is one record: registered in a test, the planner lays models out
with it and ``python -m hpcdist.bench schedule`` draws it, with no file of plan/ or bench/
touched. (A new collective algorithm, the same: tests/mpi/test_collectives.py.)"""
import dataclasses
import json

import pytest

from hpcdist.parallel import schedules as S
from hpcdist import plan as P


@pytest.fixture
def reversed_1f1b():
    """1F1B under another name, with a makespan of its own the planner must read: 1F1B's,
    plus one forward per stage (so its bubble is larger, and it is a distinct record)."""
    base = S.get("1f1b")
    record = dataclasses.replace(
        base, name="1f1b-slow", about="1F1B, priced one forward slower per stage",
        makespan=lambda P_, m, v, f, b: (m + P_ - 1) * (f + b) + P_ * f)
    S.register(record)
    yield record
    S.REGISTRY.pop(record.name)


def test_a_registered_schedule_is_planned_and_drawn(reversed_1f1b, tmp_path, capsys):
    model = P.Model(layers=8, hidden=512, heads=8, seq=256, vocab=1000)
    gpu = P.HARDWARE["a100-80g"]
    fits, _ = P.plan(model, gpu, 8, 4, 32)
    names = {e.layout.schedule for e in fits}
    assert "1f1b-slow" in names and "1f1b" in names
    same = {}
    for e in fits:                          # the same layout under both names: its bubble
        if e.layout.schedule in ("1f1b", "1f1b-slow"):
            key = dataclasses.replace(e.layout, schedule="-")
            same.setdefault(key, {})[e.layout.schedule] = e.bubble
    pairs = [v for v in same.values() if len(v) == 2]
    assert pairs and all(v["1f1b-slow"] > v["1f1b"] for v in pairs)   # its makespan, read
    P.main(["--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "256", "--vocab",
            "1000", "--global-batch", "32", "--gpus", "8", "--gpus-per-node", "4", "--json",
            "--top", "1000"])
    rows = json.loads(capsys.readouterr().out)
    assert any(r["schedule"].startswith("1f1b-slow") for r in rows)
    from hpcdist.bench import schedule
    pytest.importorskip("matplotlib")
    schedule.main(["--schedule", "1f1b-slow", "--pp", "2", "--micro-batches", "4",
                   "--out", str(tmp_path / "s.png")])
    assert (tmp_path / "s.png").exists()
    assert "1f1b-slow, 2 stages" in capsys.readouterr().out
