"""--tensorboard and --wandb (issue 91, part 7): every record metrics.jsonl holds — the
steps' loss, lr, gradient norm, tokens/s, MFU and the evaluations' held-out loss — read back
with TensorBoard's own event reader and from the W&B run's file equals metrics.jsonl's, across
a resume; a sink whose library is missing is one line."""
import glob
import json
import math
import os
import struct
import sys

import pytest

from test_edges import ROOT, one_line, py


def _records(out) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _expected(records) -> dict:
    """(tag, step) -> value of every finite number of every record with a step."""
    out = {}
    for r in records:
        if "step" not in r:
            continue
        group = r.get("event") or "train"
        for k, v in r.items():
            if k not in ("step", "time", "event") and isinstance(v, (int, float)) and \
                    not isinstance(v, bool) and math.isfinite(v):
                out[(f"{group}/{k}", r["step"])] = float(v)
    return out


def _tensorboard(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            assert (tag, e.step) not in got, f"{tag} at step {e.step} twice"
            got[(tag, e.step)] = e.value
    return got


def _wandb_history(out) -> list:
    """The history rows of the offline W&B run's file (LevelDB's log format: 32 KiB blocks of
    records, each a checksum, a length, a kind; a W&B Record protobuf in each)."""
    from wandb.proto import wandb_internal_pb2
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))):
        rows += _log_records(open(path, "rb").read(), wandb_internal_pb2)
    return rows


def _log_records(raw: bytes, pb2) -> list:
    pos, rows, part = 7, [], b""
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        part, pos = part + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):                          # a whole record, or its last piece
            rec = pb2.Record()
            rec.ParseFromString(part)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
            part = b""
    return rows


def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    out, save = str(tmp_path / "o"), str(tmp_path / "ck")
    base = ["-m", "hpcdist.train", "--batch-size", "8", "--eval-every", "3", "--tensorboard",
            "--wandb", "--out-dir", out, "--save-dir", save]
    rc, _, err = py(*base, "--steps", "4", timeout=300)
    assert rc == 0, err
    rc, _, err = py(*base, "--steps", "7", "--resume", timeout=300)
    assert rc == 0, err
    want = _expected(_records(out))
    assert {s for (t, s) in want if t == "train/loss"} == set(range(1, 8))
    assert ("eval/test_loss", 3) in want and ("eval/test_loss", 6) in want
    got = _tensorboard(os.path.join(out, "tensorboard"))
    assert set(got) == set(want)
    for key, value in want.items():                 # (TensorBoard keeps float32)
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    rows = _wandb_history(out)                       # (one W&B run, in two files)
    logged = {(k, r["_step"]): v for r in rows for k, v in r.items() if not k.startswith("_")}
    assert logged == pytest.approx(want)
    ids = {os.path.basename(p).split("-")[-1] for p in glob.glob(
        os.path.join(out, "wandb", "offline-run-*"))}
    assert len(ids) == 1, ids


def test_a_sink_whose_library_is_missing_is_one_line(tmp_path):
    import subprocess
    hide = tmp_path / "hide"
    hide.mkdir()
    for name in ("wandb", "tensorboardX"):
        (hide / f"{name}.py").write_text("raise ImportError('hidden by the test')\n")
    for flag, package in (("--wandb", "wandb"), ("--tensorboard", "tensorboardX")):
        r = subprocess.run([sys.executable, "-m", "hpcdist.train", "--steps", "1", flag],
                           capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                           env=dict(os.environ, PYTHONPATH=f"{hide}:{ROOT}"))
        assert r.returncode == 2
        one_line(r.stderr, rf"{flag} needs the {package} package: pip install")
