"""tests/gpu/session.sh, the one script a lent GPU runs (15 device-minutes a session, the
machine's start included), checked here so that none of them goes to a typo: the script
parses as bash; each benchmark it runs takes every flag it is given (bench gpu's modes, peers
and precisions too: a misspelt mode would time fp32); each trainer command parses and
validates as the trainer's settings; each file it names exists."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "session.sh"
NAMES = {"$B": "python -m hpcdist.bench", "$PYT": "python -m pytest -v", "$OUT": "/tmp/out"}


def commands() -> list[list[str]]:
    """Every command of the script's ``step NAME SECONDS "..."`` lines: the body split at
    ``&&``, its variables expanded, leading ``VAR=value`` and ``mpiexec -n N`` taken off."""
    out = []
    for line in SCRIPT.read_text().splitlines():
        if not line.startswith("step "):
            continue
        body = shlex.split(line)[3]
        for name, value in NAMES.items():
            body = body.replace(name, value)
        for part in body.split("&&"):
            words = shlex.split(part)
            while words and re.fullmatch(r"[A-Z_0-9]+=\S*", words[0]):
                words = words[1:]
            if words[:2] == ["mpiexec", "-n"]:
                words = words[3:]
            out.append(words)
    return out


def test_the_script_parses_and_its_steps_are_found():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cmds = commands()
    assert len(cmds) >= 20 and all(c and c[0] == "python" for c in cmds), cmds
    assert sum(c[1:4] == ["-m", "hpcdist.bench", "gpu"] for c in cmds) >= 10


def test_bench_gpu_takes_every_line_of_the_script():
    from hpcdist.bench import gpu
    lines = [c[4:] for c in commands() if c[1:4] == ["-m", "hpcdist.bench", "gpu"]]
    for argv in lines:
        modes, peers, precisions = gpu.lists(gpu.parser().parse_args(argv))
        assert modes, argv
    with pytest.raises(ValueError, match=r"--modes: bf61 \(known: fp32, tf32, bf16, fp8"):
        gpu.lists(gpu.parser().parse_args(["--modes", "bf16,bf61+graph"]))
    with pytest.raises(ValueError, match="--peers: eagre"):
        gpu.lists(gpu.parser().parse_args(["--peers", "eagre"]))
    r = subprocess.run([sys.executable, "-m", "hpcdist.bench", "gpu", "--modes", "tf23"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--modes: tf23" in r.stderr, r.stderr[-500:]


def test_every_other_benchmark_knows_its_flags():
    used: dict[str, set] = {}
    for c in commands():
        if c[1:3] == ["-m", "hpcdist.bench"] and c[3] != "gpu":
            used.setdefault(c[3], set()).update(w.split("=")[0] for w in c[4:]
                                                if w.startswith("--"))
    assert used, "the script runs no other benchmark"
    for bench, flags in used.items():
        r = subprocess.run([sys.executable, "-m", "hpcdist.bench", bench, "--help"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, (bench, r.stderr[-500:])
        known = set(re.findall(r"--[a-z][a-z0-9-]*", r.stdout))
        assert flags <= known, (bench, flags - known)


def test_every_training_command_is_valid_settings():
    from hpcdist.run.config import parse_config
    runs = [c[3:] for c in commands() if c[1:3] == ["-m", "hpcdist.train"]]
    assert len(runs) >= 5
    for argv in runs:
        cfg = parse_config(argv)
        assert cfg.device == "gpu", argv


def test_every_file_the_script_names_exists():
    named = [w for c in commands() for w in c
             if w.startswith("tests/") and (w.endswith(".py") or "::" not in w)]
    assert len(named) >= 10
    missing = [w for w in named if not (ROOT / w.split("::")[0]).exists()]
    assert not missing, missing
