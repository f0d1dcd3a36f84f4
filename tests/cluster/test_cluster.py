"""Multi-node behaviour on the cluster in a box (hpcdist/cluster.py): network namespaces as
nodes, shaped veth links, MPICH's launcher entering each namespace.

Skipped, saying why, where namespaces cannot be made (no root, no iproute2) or the launcher is
not MPICH's hydra; ``make test`` runs them where they can run.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from procs import finish

from hpcdist import cluster as box

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PREFIX = "hpct"                 # not the user's default "hpcd"
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _why_not() -> str | None:
    why = box.available()
    if why:
        return why
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "hydra_pmi_proxy")):
        return "needs MPICH's hydra launcher in the venv (the mpich wheel)"
    return None


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"cluster in a box: {WHY}")


def run(cluster, args, limit=120, n=None, env=None):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    cmd = cluster.mpiexec(n, MPIEXEC) + [sys.executable] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)


def train_args(tmp, steps, **extra):
    args = ["-m", "hpcdist.train", "--steps", str(steps), "--batch-size", "16",
            "--out-dir", str(tmp / "out"), "--log-every", "5", "--timeout", "6"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return args


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3), (4, 2)])
def test_two_level_collectives_against_mpi_and_the_byte_formula(nodes, per_node):
    with box.Cluster(nodes, per_node, link=None, prefix=PREFIX) as c:
        r = run(c, [os.path.join(HERE, "two_level.py"), str(nodes), str(per_node)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("two-level checks passed") == nodes * per_node


def test_training_across_nodes_logs_the_link_of_each_call(tmp_path):
    with box.Cluster(2, 2, link="1gbit", prefix=PREFIX) as c:
        r = run(c, train_args(tmp_path, 6, comm_log=True))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 4 on 2 hosts (node1, node2)" in r.stdout
    doc = json.load(open(tmp_path / "out" / "comm_log.json"))
    links = {row["link"] for row in doc["rows"]}
    assert "inter" in links and set(doc["links"]) == {"intra", "inter"}, links
    big = [row for row in doc["rows"] if row["collective"] == "allreduce"
           and row["bytes"] > 100_000]
    assert big and all(row["link"] in ("inter", "2-level") for row in big)


def test_tensor_parallel_across_nodes_is_allowed_and_said(tmp_path):
    with box.Cluster(2, 1, link=None, prefix=PREFIX) as c:
        r = run(c, train_args(tmp_path, 2, tp=2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TP spans nodes" in r.stdout


def _latest_step(save) -> int:
    try:
        return int(open(save / "latest").read().strip().rsplit("_", 1)[1])
    except (OSError, ValueError, IndexError):
        return 0


def _start_and_wait_for_checkpoint(c, tmp_path, min_step=10):
    save = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(c.mpiexec(None, MPIEXEC) + [sys.executable] + train_args(
        tmp_path, 100000, save_dir=save, save_every=5), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    t0 = time.time()
    while _latest_step(save) < min_step:
        if proc.poll() is not None or time.time() - t0 > 90:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no checkpoint of step {min_step}:\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.2)
    return proc, save


def _verify(save):
    r = subprocess.run([sys.executable, "-m", "hpcdist.checkpoint", "verify", str(save)],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("fault", ["link_down", "node_killed"])
def test_a_lost_node_is_named_and_the_run_resumes_on_the_others(tmp_path, fault):
    """A node's link goes down (``ip link set down``) or every process on it is SIGKILLed
    mid-run: the watchdog on the surviving node names that node and its ranks within the
    deadline (6 s + 1 s grace), the job ends, the last checkpoint verifies, and --resume
    continues on the remaining node with the same global batch."""
    with box.Cluster(2, 2, link="1gbit", prefix=PREFIX) as c:
        proc, save = _start_and_wait_for_checkpoint(c, tmp_path)
        t0 = time.time()
        if fault == "link_down":
            c.set_link(2, up=False)
        else:
            c.kill_node(2)
        rc, out, err, _ = finish(proc, 60)
        took = time.time() - t0
    assert rc != 0
    assert re.search(r"unresponsive: ranks 2, 3 on node2 \(every rank of node2: the node or "
                     r"its link is down\)", err), err[-3000:]
    assert took < 6 + 1 + 10, took          # deadline + grace + the report and the teardown
    _verify(save)
    step = _latest_step(save)
    # the two ranks of node1 go on alone: twice the batch per rank, the same global batch
    with box.Cluster(1, 2, link=None, prefix=PREFIX) as c:
        args = train_args(tmp_path, step + 5, save_dir=save, resume=True)
        args[args.index("--batch-size") + 1] = "32"
        r = run(c, args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {step}" in r.stdout and "resumed as" in r.stdout, r.stdout[-2000:]
    assert "global batch changed" not in r.stdout
    assert "held-out accuracy" in r.stdout


def test_a_link_slowed_100x_slows_the_run_without_a_false_alarm(tmp_path):
    """1 Gbit/s -> 10 Mbit/s on one node's link mid-run: steps take longer, nobody is named,
    the run finishes."""
    with box.Cluster(2, 2, link="1gbit", prefix=PREFIX) as c:
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen(c.mpiexec(None, MPIEXEC) + [sys.executable] + train_args(
            tmp_path, 40, log_every=1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=ROOT, env=env)
        metrics = tmp_path / "out" / "metrics.jsonl"
        t0 = time.time()
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 15) \
                and time.time() - t0 < 90 and proc.poll() is None:
            time.sleep(0.1)
        c.shape(2, "10mbit")
        rc, out, err, _ = finish(proc, 180)
    assert rc == 0, err[-3000:]
    assert "watchdog" not in err
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if '"step"' in line and '"loss"' in line]
    before = sorted(s["step_ms"] for s in steps[2:12])
    after = sorted(s["step_ms"] for s in steps[-10:])
    print(f"step ms median before {before[len(before) // 2]:.1f}, after {after[len(after) // 2]:.1f}")
    assert after[len(after) // 2] > 2 * before[len(before) // 2], (before, after)


def _final(out) -> dict:
    return json.loads(open(out / "metrics.jsonl").read().splitlines()[-1])


def test_diloco_and_hybrid_sharding_cross_the_slow_link_as_the_formulas_say(tmp_path):
    """2 nodes x 2 ranks on 100 Mbit links. Hierarchical DDP moves each step's gradient across
    the link once (per node, 2 (N - 1) / N of it); hybrid ZeRO-2 (sharded in the node)
    moves its shards the same bytes; DiLoCo with a group a node moves the pseudo-gradient
    once a round: 1/H of DDP's bytes, and a round's exchange is split between the node's
    ranks as DDP's is."""
    steps, H = 8, 4
    with box.Cluster(2, 2, link="100mbit", prefix=PREFIX) as c:
        runs = {"ddp": run(c, train_args(tmp_path / "ddp", steps),
                           env={"HPCDIST_ALLREDUCE": "hierarchical"}),
                "hybrid": run(c, train_args(tmp_path / "hybrid", steps, zero=2,
                                            shard_group="node")),
                "diloco": run(c, train_args(tmp_path / "diloco", steps, strategy="diloco",
                                            inner_steps=H))}
    for name, r in runs.items():
        assert r.returncode == 0, (name, r.stderr[-3000:])
    assert "DiLoCo 2 groups x 2 ranks, H 4" in runs["diloco"].stdout
    assert "hybrid: sharded over 2 ranks, replicated over 2 groups" in runs["hybrid"].stdout
    inter = {k: _final(tmp_path / k / "out")["inter_node_bytes"] for k in runs}
    assert inter["ddp"] > 0
    assert abs(inter["hybrid"] / inter["ddp"] - 1) < 0.02, inter
    assert abs(inter["ddp"] / inter["diloco"] - H) < 0.05 * H, inter
