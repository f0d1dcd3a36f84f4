"""``python -m hpcdist.bench plot`` and ``python -m hpcdist.preflight``, without MPI."""
import json
import os
import subprocess
import sys

import pytest

from hpcdist import preflight
from hpcdist.run.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def run(module, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *module.split(), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


# ---- plots ------------------------------------------------------------------------------------

def _inputs(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in [
        {"step": 10, "loss": 2.0, "lr": 1e-3}, {"step": 20, "loss": 0.5, "lr": 5e-4},
        {"event": "final", "accuracy": 0.97, "world": 2}]) + "\n")
    bench = tmp_path / "bench_collectives_n2.json"
    bench.write_text(json.dumps({"ranks": 2, "alpha_s": 1e-6, "beta_s_per_byte": 1e-9, "rows": [
        {"collective": k, "bytes": b, "busbw_GBs": b / 1e6, "mpi_busbw_GBs": b / 5e5}
        for k in ("allreduce", "bcast") for b in (8, 1024, 65536)]}))
    comm_log = tmp_path / "comm_log.json"
    comm_log.write_text(json.dumps({"alpha_s": 1e-6, "beta_s_per_byte": 1e-9, "rows": [
        {"collective": "allreduce", "algorithm": "ring", "bytes": 4096, "time_us": 30.0,
         "model_us": 12.0}]}))
    trace = tmp_path / "trace.json"
    events = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}}
              for r in range(2)]
    for r in range(2):
        for s in range(3):
            t = 1000.0 * s
            events += [{"name": "step", "cat": "compute", "ph": "X", "pid": r, "tid": 0, "ts": t,
                        "dur": 900.0, "args": {}},
                       {"name": "forward", "cat": "compute", "ph": "X", "pid": r, "tid": 0,
                        "ts": t, "dur": 300.0, "args": {}},
                       {"name": "allreduce", "cat": "comm", "ph": "X", "pid": r, "tid": 1,
                        "ts": t + 400, "dur": 200.0, "args": {"bytes": 8, "algorithm": "ring"}}]
    trace.write_text(json.dumps({"traceEvents": events}))
    return [str(metrics), str(bench), str(comm_log), str(trace)]


def test_plot_writes_a_png_for_every_input(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    r = run("hpcdist.bench plot", *_inputs(tmp_path), "--out", str(out))
    assert r.returncode == 0, r.stderr
    for name in ("loss.png", "busbw.png", "comm_log.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, name
        assert f"wrote {out / name}" in r.stdout


def test_plot_refuses_unknown_input(tmp_path):
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"hello": 1}))
    r = run("hpcdist.bench plot", str(odd), "--out", str(tmp_path))
    assert r.returncode != 0 and "not a file this tool knows" in r.stderr
    r = run("hpcdist.bench plot", str(tmp_path / "missing.json"))
    assert r.returncode != 0 and "no such file" in r.stderr


# ---- preflight --------------------------------------------------------------------------------

def test_preflight_accepts_a_good_cpu_job():
    assert preflight.check(["--steps", "10"], world=4, tasks_per_node=4) == []


@pytest.mark.parametrize("args, world, tpn, gpn, needs_gpu, message", [
    (["--compress", "topk"], 1, 1, 0, False, "compresses nothing"),
    (["--batch-size", "100000"], 16, 8, 0, False, "fewer than one global step"),
    (["--device", "gpu"], 4, 4, 0, True, "the job has no GPUs"),
    (["--device", "gpu"], 8, 8, 4, True, "8 ranks per node but 4 GPUs per node"),
    (["--device", "cpu"], 2, 2, 2, True, "use jobs/train-cpu.sbatch"),
    (["--steps", "-1"], 2, 2, 0, False, "steps must be positive"),
    ([], 0, None, 0, False, "ask for at least one"),
])
def test_preflight_refuses_with_what_to_set(args, world, tpn, gpn, needs_gpu, message):
    with pytest.raises(ConfigError, match=message):
        preflight.check(args, world, tpn, gpn, needs_gpu, probe_device=False)


def test_preflight_warns_on_idle_gpus_and_checks_the_device():
    assert "2 GPUs stay idle" in preflight.check(["--device", "gpu"], 2, 2, 4,
                                                 probe_device=False)[0]
    assert "but --device cpu" in preflight.check([], 2, 2, 2)[0]
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs CuPy"):
            preflight.check(["--device", "gpu"], 1, 1, 1)


def test_preflight_accepts_any_world_size_and_refuses_another_model(tmp_path):
    from hpcdist import train
    save = str(tmp_path / "ck")
    train.train(train.parse_config(["--steps", "2", "--save-dir", save, "--out-dir",
                                    str(tmp_path / "o"), "--batch-size", "8"]), log=lambda *a: None)
    args = ["--save-dir", save, "--resume", "--batch-size", "4"]
    assert preflight.check(args, 2) == []                   # written by 1 rank, resumed by 2
    with pytest.raises(ConfigError, match="--n-embd 32 contradicts --resume: .* holds a run with --n-embd 64"):
        preflight.check(args + ["--n-embd", "32"], 2)


def test_preflight_cli_exit_codes():
    ok = run("hpcdist.preflight", "--world", "2", "--", "--steps", "5")
    assert ok.returncode == 0 and "hpcdist.preflight: ok (2 ranks" in ok.stdout
    bad = run("hpcdist.preflight", "--world", "2", "--gpus-per-node", "0", "--needs-gpu", "--",
              "--device", "gpu")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "hpcdist.preflight: error: --device gpu, but the job has no GPUs: submit with "
        "--gpus-per-task=1 (one rank per GPU) on a GPU partition (-p NAME), or train on CPUs "
        "with jobs/train-cpu.sbatch"]


def test_preflight_never_starts_mpi():
    """It runs in the batch shell, outside any launcher: importing mpi4py.MPI there would
    initialise MPI (and under srun's PMI variables, look for a launcher that is not there)."""
    r = run("hpcdist.preflight", "--world", "1", "--", "--steps", "5")
    assert r.returncode == 0
    probe = subprocess.run([sys.executable, "-c", "import sys, hpcdist.preflight; "
                            "print('mpi4py.MPI' in sys.modules)"], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert probe.stdout.strip() == "False", probe.stderr
