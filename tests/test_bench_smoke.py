"""Every benchmark command runs end to end on small settings and writes sane results."""
import importlib.util
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "hpcdist.bench", *args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def test_autograd_bench_at_training_shapes(tmp_path):
    out_json = tmp_path / "shapes.json"
    out = bench("autograd", "--shapes", "1x64:16:50:2,2x64:9:30:3", "--threads", "1",
                "--steps", "2", "--warmup", "1", "--profile", "--memory", "--out", str(out_json))
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["shape"], r["T"], r["batch"]) for r in rows] == [("1x64", 16, 2), ("2x64", 9, 3)]
    assert all(r["hpcdist_ms"] > 0 and r["peak_bytes_kernels"] > 0 for r in rows)
    assert abs(sum(rows[0]["profile_hpcdist"].values()) - 1) < 1e-9
    assert "where hpcdist's step goes" in out and "one layer's attention" in out
    if importlib.util.find_spec("torch") is not None:
        assert all(r["ratio"] > 0 for r in rows) and "median hpcdist / pytorch" in out


def test_autograd_bench_pool_on_and_off():
    out = bench("autograd", "--shapes", "1x64:16:50:2", "--threads", "2", "--pool-ab", "1")
    if importlib.util.find_spec("torch") is not None:
        m = re.search(r"pool ([0-9.]+) ms, no pool ([0-9.]+) ms, pytorch ([0-9.]+) ms", out)
        assert m and all(float(v) > 0 for v in m.groups()), out[-500:]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="compares with PyTorch")
def test_nanogpt_bench_trains_the_same_model_on_the_same_batches(tmp_path):
    """hpcdist's run and the nanoGPT-style loop from the same weights on the same batches:
    the same loss after the same steps (float32; attention's and the sums' order differ), in
    each of two rounds (PyTorch's run first in the second), and their median ratio."""
    out = bench("nanogpt", "--steps", "4", "--batch", "4", "--threads", "1", "--rounds", "2",
                "--out", str(tmp_path), timeout=600)
    losses = [float(v) for v in re.findall(r"loss after 4 steps ([0-9.]+)", out)]
    assert len(losses) == 4 and max(losses) - min(losses) < 1e-3, out[-800:]
    assert "round 2 of 2 (nanoGPT-style PyTorch first)" in out, out[-800:]
    got = json.loads((tmp_path / "results.json").read_text())
    assert len(got["ratios"]) == 2 and got["rounds"][1]["hpcdist"]["tokens_per_s"] > 0
    m = re.search(r"median over 2 rounds: ([0-9.]+)", out)
    assert m and float(m.group(1)) == pytest.approx(float(np.median(got["ratios"])), abs=1e-3)


def test_autograd_bench():
    out = bench("autograd", "--steps", "3", "--warmup", "1")
    assert "MLP 784-128-10" in out and "Tensor overhead" in out
    if importlib.util.find_spec("torch") is None:       # no PyTorch: nothing to compare
        return
    # the PyTorch twin is the same model: float64 losses agree over 30 AdamW steps
    m = re.search(r"GPT twin check: .* max \|loss difference\| = ([0-9.e+-]+)", out)
    assert m and float(m.group(1)) < 1e-9, out[-500:]


def test_collectives_bench(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "hpcdist.bench",
                        "collectives", "--max-bytes", "4096", "--algorithms",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.load(open(tmp_path / "bench_collectives_n2.json"))
    main = [row for row in res["rows"] if row["collective"] == "allreduce"]
    assert [row["bytes"] for row in main] == [8, 32, 128, 512, 2048, 4096]
    assert all(row["time_us"] > 0 and row["mpi_time_us"] > 0 for row in main)


def test_compression_bench(tmp_path):
    bench("compression", "--ranks", "2", "--steps", "3", "--out", str(tmp_path / "c.json"))
    rows = json.load(open(tmp_path / "c.json"))["rows"]
    dense = rows[0]
    assert [r["scheme"] for r in rows] == ["dense", "fp16", "topk 0.01", "topk 0.001"]
    assert rows[1]["bytes_per_step"] * 2 == pytest.approx(dense["bytes_per_step"], rel=0.01)
    assert rows[3]["bytes_per_step"] < rows[2]["bytes_per_step"] < dense["bytes_per_step"]


def test_ddp_bench(tmp_path):
    bench("ddp", "--sizes", "1,2", "--steps", "2", "--out", str(tmp_path / "d.json"))
    res = json.load(open(tmp_path / "d.json"))
    assert [r["ranks"] for r in res["scaling"]] == [1, 2]
    assert all(m["ratio"] > 1 for m in res["activation_memory"])


def test_zero_bench(tmp_path):
    bench("zero", "--sizes", "2", "--steps", "2", "--out", str(tmp_path / "z.json"))
    rows = json.load(open(tmp_path / "z.json"))["rows"]
    for r in rows:
        if r["level"] > 0:
            assert r["state_ratio"] == pytest.approx(1.0, abs=1e-9)
        assert r["comm_ratio"] == pytest.approx(1.0, abs=0.01)
    out = bench("zero", "--analytic", "7e9", "--world", "8")
    assert "448 GB per GPU" in out and "56 GB" in out


def test_tp_bench(tmp_path):
    out_file = tmp_path / "tp.json"
    out = bench("tp", "--ranks", "2", "--steps", "3", "--global-batch", "8", "--seq", "8",
                "--out", str(out_file))
    rows = json.loads(out_file.read_text())["rows"]
    layers = [r for r in rows if r["part"] == "layer"]
    assert {(r["tp"], r["sp"]) for r in layers} == {(1, False), (2, False), (2, True)}
    for r in layers:          # the measured traffic is Megatron's formula, element for element
        if r["tp"] > 1:
            assert r["comm_ratio"] == 1.0
        assert r["act_bytes"] > 0
    assert "x pure DP" in out


def test_schedule_picture(tmp_path):
    out = bench("schedule", "--schedule", "interleaved", "--pp", "2", "--micro-batches", "4",
                "--virtual-stages", "2", "--out", str(tmp_path / "s.png"))
    assert "simulated: bubble 11.1%" in out                 # (P-1)/(vm+P-1) = 1/9
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = subprocess.run([sys.executable, "-m", "hpcdist.bench", "schedule", "--schedule",
                        "interleaved", "--pp", "4", "--micro-batches", "6", "--virtual-stages",
                        "2", "--out", str(tmp_path / "x.png")], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode != 0 and "not a multiple of --pp 4" in r.stderr


def test_pipeline_bench_and_trace_picture(tmp_path):
    out_file = tmp_path / "pp.json"
    out = bench("pipeline", "--steps", "4", "--batch", "8", "--micro-batches", "2",
                "--n-layer", "2", "--n-embd", "16", "--out", str(out_file))
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved v2", "zb-h1"]
    for r in rows:
        assert 0 <= r["bubble"] < 1 and r["peak_stash"] == r["promised"]
    trace = tmp_path / "trace.json"
    r = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "hpcdist.train", "--pp", "2",
                        "--steps", "3", "--trace", str(trace), "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    kinds = {e["args"]["kind"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("cat") == "pipeline"}
    assert kinds == {"F", "B", "COMM"}
    out = bench("plot", str(trace), "--out", str(tmp_path / "plots"))
    assert "pipeline.png" in out


def test_checkpoint_bench(tmp_path):
    out_file = tmp_path / "ck.json"
    bench("checkpoint", "--ranks", "2", "--n-layer", "1", "--n-embd", "16", "--repeat", "1",
          "--out", str(out_file))
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["DDP -> ZeRO-1", "ZeRO-1 -> DDP"]
    ddp, zero = rows
    assert ddp["plain_bytes"] > ddp["bytes"]             # replicas each wrote a copy; we once
    assert all(r["save"] > 0 and r["load_other"] > 0 for r in rows)
    out = bench("checkpoint", "--async-save", "--ranks", "2", "--n-layer", "1", "--n-embd",
                "16", "--repeat", "1", "--batch", "2", "--out", str(out_file))
    (row,) = json.loads((tmp_path / "ck_async.json").read_text())["rows"]
    assert row["sync"] > 0 and 0 < row["stall"] and row["written"] > 0
    assert "async stall ms" in out


def test_peers_bench(tmp_path):
    out_file = tmp_path / "peers.json"
    out = bench("peers", "--sizes", "2", "--max-bytes", "2048", "--out", str(out_file))
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [8, 32, 128, 512, 2048]
    assert all(r["hpcdist"] > 0 and r["mpi"] > 0 for r in rows)
    assert "x MPI" in out and (tmp_path / "peers.png").exists()


def test_peers_train_bench(tmp_path):
    pytest.importorskip("torch")
    out = bench("peers", "--train", "--ranks", "1,2", "--steps", "5", "--batch", "8", "--out",
                str(tmp_path / "peers.json"))
    doc = json.loads((tmp_path / "peers_train.json").read_text())
    assert "x PyTorch" in out and "many buckets" in out
    for rows in (doc["default"], doc["many"]):
        assert [r["ranks"] for r in rows] == [1, 2]
        # the same model, data and optimizer: the losses agree to float32 round-off
        assert all(abs(r["ours_loss"] - r["torch_loss"]) < 1e-4 for r in rows)
        assert rows[0]["overlap_ms"] > 0 and rows[0]["no_overlap_ms"] > 0   # 1 rank only
        assert rows[1]["overlap_ms"] is None
    assert doc["many"][0]["buckets"] > doc["default"][0]["buckets"] == 1


def test_cp_bench(tmp_path):
    """Small: the memory search at CP 1 and 2, both variants' step times, the ring's trace."""
    out_file, png = tmp_path / "cp.json", tmp_path / "cp.png"
    out = bench("cp", "--ranks", "2", "--budget-mb", "2", "--start", "32", "--max-seq", "256",
                "--bisect", "1", "--seqs", "32", "64", "--steps", "2", "--n-head", "2",
                "--n-embd", "16", "--text-chars", "20000", "--out", str(out_file),
                "--plot", str(png) if importlib.util.find_spec("matplotlib") else "")
    rows = json.load(open(out_file))["rows"]
    memory = {(r["cp"], r["impl"]): r["longest"] for r in rows if r["part"] == "memory"}
    assert set(memory) == {(1, "-"), (2, "ring"), (2, "ulysses")}
    assert memory[(2, "ring")] > memory[(1, "-")] > 0             # a ring rank holds less
    times = [r for r in rows if r["part"] == "time"]
    assert {(r["impl"], r["T"]) for r in times} == {(i, T) for i in ("ring", "ulysses")
                                                    for T in (32, 64)}
    assert all(r["step_ms"] > 0 and r["model_ms"] > 0 for r in times)
    over = next(r for r in rows if r["part"] == "overlap")
    assert len(over["block_ms"]) == 2 and all(b > 0 for b in over["block_ms"])
    assert "longest sequence within" in out and "share of ring time computing" in out


def test_nccl_bench_counts_what_each_layout_sends(tmp_path):
    out = tmp_path / "n.json"
    bench("nccl", "--ranks", "4", "--only", "ddp", "zero1", "zero3", "pp2 1f1b", "cp2 ring",
          "cp2 ulysses", "--json", str(out))
    rows = {(r["layout"], r["group"], r["kind"]): r for r in json.load(open(out))["rows"]}
    ddp, rs, ag = (rows[("ddp", "dp", "allreduce")], rows[("zero1", "dp", "reduce_scatter")],
                   rows[("zero1", "dp", "allgather")])
    # a ring allreduce sends twice what its reduce-scatter half does; ZeRO-1 gathers back what
    # it scattered (pieces padded to the largest: equal up to 4 ranks x 4 bytes)
    assert ddp["bytes"] == pytest.approx(2 * rs["bytes"], abs=64)
    assert ag["bytes"] == pytest.approx(rs["bytes"], abs=64) and ag["calls"] == rs["calls"]
    assert not any(k[0] == "ddp" and k[2] != "allreduce" for k in rows)
    # ZeRO-3 gathers parameters in the forward and again in the backward: more than ZeRO-1
    assert rows[("zero3", "dp", "allgather")]["calls"] > ag["calls"]
    # the pipeline's 4 micro-batches: each stage sends 4 messages a step, receives 4
    assert rows[("pp2 1f1b", "pp", "send")]["calls"] == 4
    assert rows[("pp2 1f1b", "pp", "recv")]["calls"] == 4
    # the ring passes K and V blocks by send/recv; Ulysses moves the same through all-to-all
    assert ("cp2 ring", "cp", "send") in rows and ("cp2 ring", "cp", "alltoall") not in rows
    assert rows[("cp2 ulysses", "cp", "alltoall")]["calls"] > 0
    assert ("cp2 ulysses", "cp", "send") not in rows


def test_moe_bench_times_the_expert_all_to_all(tmp_path):
    out = tmp_path / "m.json"
    bench("moe", "--ranks", "2", "--steps", "2", "--n-layer", "1", "--experts", "4",
          "--batch", "8", "--json", str(out), "--png", str(tmp_path / "m.png"))
    rows = {(r["ep"], r["top_k"], r["capacity_factor"]): r for r in json.load(open(out))}
    assert set(rows) == {(e, k, c) for e in (1, 2) for k in (1, 2) for c in (0.0, 1.0)}
    for (ep, k, cap), r in rows.items():
        assert (r["a2a_kib"] > 0) == (ep > 1) and (r["a2a_ms"] > 0) == (ep > 1)
        assert 0 <= r["share"] < 1 and r["load"] >= 1.0
        assert r["dropped"] == 0 or cap > 0                 # dropless drops nothing
    # top-2 sends every token's row twice: about twice top-1's payload (the counts and the
    # keys' and flags' small exchanges ride beside it)
    assert 1.8 < rows[(2, 2, 0.0)]["a2a_kib"] / rows[(2, 1, 0.0)]["a2a_kib"] < 2.1


def test_slowlinks_table_from_runs(tmp_path):
    """``bench slowlinks``'s numbers from made-up runs: bytes against DDP's, the seconds to
    the target, the computing share; and its corpus, the standard library's docstrings."""
    from hpcdist.bench import slowlinks as S

    def run(step_ms, losses, inter, extra=None):
        steps = [{"step": i + 1, "step_ms": ms, "loss": l}
                 for i, (ms, l) in enumerate(zip(step_ms, losses))]
        final = {"test_loss": losses[-1], "train_seconds": sum(step_ms) / 1e3,
                 "inter_node_bytes": inter, **(extra or {})}
        return {"steps": steps, "final": final}
    n = 200
    runs = {"DDP hierarchical": run([30.0] * n, list(np.linspace(3, 2, n)), 1000),
            "DiLoCo H=100": run([10.0 if i % 100 else 50.0 for i in range(1, n + 1)],
                                list(np.linspace(3, 2.2, n)), 20,
                                {"outer_peak_bytes": 10})}
    rows = {r["contender"]: r for r in S.summarize(runs, n)}
    assert rows["DiLoCo H=100"]["fewer_bytes"] == 50
    assert rows["DDP hierarchical"]["compute_share"] == pytest.approx(10 / 30)
    assert rows["DiLoCo H=100"]["compute_share"] == pytest.approx(2000 / 2080)
    assert rows["DiLoCo H=100"]["to_target_s"] is None       # 2.2 > 1.05 x ~2.0
    assert rows["DDP hierarchical"]["to_target_s"] == pytest.approx(30 * n / 1e3, rel=0.1)
    text = S.markdown([{"nodes": 2, "link": "100mbit", "steps": n, "rows": list(rows.values())}])
    assert "| DiLoCo H=100 |" in text and "50.0x" in text
    path = S.corpus(str(tmp_path / "c.txt"), limit=5000)
    with open(path) as f:
        body = f.read()
    assert 4000 < len(body) <= 5000 and body.count(" ") > 500


def test_diloco_bench_goes_on_from_a_warm_start(tmp_path):
    """``bench diloco``: DDP's first 20 steps of the 40-step schedule saved at step 20 (not
    21: the stop), then DDP and DiLoCo (H 10, 2 groups of 1) from that checkpoint to step 40;
    the held-out losses and their ratio to DDP's in the JSON."""
    out = tmp_path / "d.json"
    text = bench("diloco", "--ranks", "2", "--groups", "2", "--inner", "10", "--warm", "20",
                 "--steps", "40", "--json", str(out), "--tmp", str(tmp_path))
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == ["DDP", "DiLoCo H=10, 2 groups"]
    assert rows[0]["vs_ddp"] == 1.0 and np.isfinite(rows[1]["held_out"])
    assert rows[1]["vs_ddp"] == pytest.approx(rows[1]["held_out"] / rows[0]["held_out"])
    (folder,) = tmp_path.glob("bench-diloco-*")
    assert sorted(p.name for p in (folder / "warm20" / "ck").glob("step_*")) == \
        ["step_00000020"]
    assert "| 20 | DiLoCo H=10, 2 groups |" in text
    for run in ("warm20-0", "warm20-1"):
        log = (folder / run / "train.log").read_text()
        assert "at step 20" in log and "step    40/40" in log


def test_kernels_bench_times_each_memory_bound_kernel_both_ways(tmp_path):
    """`bench kernels` on the CPU's model of a device (its times say nothing there): every
    kernel timed 16 bytes a thread and one element a thread as a replayed graph, the bytes
    each call must move, and the copy the last column is measured against."""
    out_json = tmp_path / "kernels.json"
    out = bench("kernels", "--device", "standin", "--rows", "48", "--embd", "64", "--vocab",
                "128", "--reps", "1", "--calls", "2", "--out", str(out_json))
    assert "bf16, 48 rows x 64 (standin; us a call, graph)" in out
    rows = {r["kernel"]: r for r in json.loads(out_json.read_text())["kernels"]}
    assert len(rows) == 19 and all(r["timed as"] == "graph" and r["us"] > 0 for r in rows.values())
    assert rows["add2 (engine's gradient sum)"]["bytes"] == 3 * 48 * 64 * 2
    assert rows["swiglu_bwd (4C)"]["bytes"] == 5 * 48 * 4 * 64 * 2
    assert rows["layernorm_bwd + the residual's gradient"]["bytes"] == 4 * 48 * 64 * 2
    assert rows["geglu_fwd (4C)"]["bytes"] == 3 * 48 * 4 * 64 * 2
    assert rows["cross_entropy_bwd (V 128)"]["bytes"] == 2 * 48 * 128 * 2
    assert all("us one a thread" in r for k, r in rows.items() if not k.startswith("copy"))
    assert rows["copy (4C, the yardstick)"]["of copy"] == 1.0
    from hpcdist.device import backend
    if backend.gpu_count() == 0:
        assert "no GPU visible" in bench("kernels", "--rows", "8", "--embd", "8")


def test_lora_bench_counts_the_adapters_state_alone(tmp_path):
    pytest.importorskip("peft")
    out = bench("lora", "--steps", "2", "--batch", "2", "--block", "32", "--records", "40",
                "--rank", "4")
    rows = {line[:30].strip(): line[30:].split() for line in out.splitlines()
            if line.startswith("  hpcdist") or line.startswith("  P")}
    full, lora, qlora = (rows[k] for k in ("hpcdist full fine-tuning", "hpcdist LoRA",
                                           "hpcdist QLoRA (nf4 base)"))
    peft_ = rows["PEFT + PyTorch LoRA"]
    assert lora[2:4] == peft_[2:4]                     # the same gradients and AdamW state
    assert float(lora[2]) < float(full[2]) / 4 and float(qlora[1]) < float(lora[1]) / 2
    assert "LoRA / PEFT step time" in out
