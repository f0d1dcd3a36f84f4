"""--async-save writes what a synchronous save writes (issue 91, part 8): at 2 ranks with
ZeRO-1 (each rank's shard of the optimizer state), every checkpoint's files have the same
SHA-256 as the synchronous run's, --keep-last prunes alike, and the training is the same."""
import json
import os
import subprocess
import sys

from test_edges import ROOT


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def _run(tmp_path, name, *extra):
    save = tmp_path / name
    r = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-m", "hpcdist.train", "--steps",
                        "9", "--batch-size", "8", "--zero", "1", "--save-dir", str(save),
                        "--save-every", "2", "--keep-last", "3", "--out-dir",
                        str(tmp_path / f"o-{name}"), *extra], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    steps = sorted(n for n in os.listdir(save) if n.startswith("step_"))
    digests = {}
    for s in steps:
        with open(save / s / "manifest.json") as f:
            digests[s] = json.load(f)["files"]
    return steps, digests, r.stdout


def test_async_saves_write_the_synchronous_saves_files(tmp_path):
    steps, sync, out = _run(tmp_path, "sync")
    asteps, asynced, aout = _run(tmp_path, "async", "--async-save")
    assert steps == asteps == ["step_00000006", "step_00000008", "step_00000009"]
    assert sync == asynced
    assert aout.count("in the background (--async-save)") == 4          # steps 2, 4, 6, 8
    assert aout.count("(written in the background") == 4 and "saved " in aout
    loss = [o.split("held-out loss ")[1].split()[0] for o in (out, aout)]
    assert loss[0] == loss[1]
