"""The training entry point: it learns, and bad input ends in one line with exit code 2."""
import json
import os
import subprocess
import sys

import pytest

from hpcdist import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpcdist.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_default_task_reaches_90_percent(tmp_path):
    cfg = train.parse_config(["--steps", "400", "--out-dir", str(tmp_path), "--log-every", "100"])
    lines = []
    final = train.train(cfg, log=lines.append)
    assert final["accuracy"] >= 0.90, lines
    assert "parameters" in lines[0] and "world size 1" in lines[0]
    assert "attention flash (tiled, numba + BLAS)" in lines[0]
    records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records[:-1]] == list(range(1, 401))   # every step is recorded
    assert sum(1 for line in lines if line.startswith("step ")) == 4    # printed every 100
    assert records[-1]["event"] == "final" and records[-1]["accuracy"] == final["accuracy"]
    assert records[-1]["train_loss"] < records[0]["loss"]


def test_cli_trains_text_file(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    r = run_train("--task", "text", "--data", str(text), "--block-size", "16", "--steps", "60",
                  "--n-embd", "32", "--out-dir", str(tmp_path), "--log-every", "20")
    assert r.returncode == 0, r.stderr
    assert "held-out accuracy (next-char)" in r.stdout


def test_the_header_says_when_dropout_keeps_the_probabilities():
    """Attention dropout runs op by op, its (T, T) probabilities kept: the header says so
    instead of "flash", and how to run tiled."""
    from hpcdist.run.report import attention_words
    assert attention_words(train.parse_config([])).startswith("attention flash (tiled")
    words = attention_words(train.parse_config(["--dropout", "0.1"]))
    assert "op by op" in words and "--dropout 0" in words


@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_a_context_of_8192_trains_in_little_memory(tmp_path, device):
    """Issue 59's bound on every machine: GPT 2x64, 2 heads, T 8192, batch 1 trains 2 steps
    (and scores its held-out tokens) under 1.2 GB of resident memory, the process's own peak
    (T x T scores in fp32 would be 256 MiB a head, a copy)."""
    text = tmp_path / "long.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 3000)
    args = ["--task", "text", "--data", str(text), "--block-size", "8192", "--n-layer", "2",
            "--n-embd", "64", "--n-head", "2", "--batch-size", "1", "--steps", "2",
            "--device", device, "--log-every", "1", "--out-dir", str(tmp_path / "run")]
    peak = ("import atexit, resource, runpy, sys; atexit.register(lambda: print('max RSS KiB',"
            " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)); sys.argv[1:] = "
            f"{args!r}; runpy.run_module('hpcdist.train', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", peak, "hpcdist.train"], capture_output=True,
                       text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "step     2/2" in r.stdout and "8,192 tokens scored" in r.stdout, r.stdout
    kib = int(r.stdout.rsplit("max RSS KiB", 1)[1])
    assert kib < 1.2e9 / 1024, f"{kib / 1024:.0f} MiB"


def test_the_evaluation_is_bounded_in_tokens_at_any_context_length(tmp_path):
    """At most --eval-tokens tokens (default 262,144), no more windows than an eighth of the
    sequences a rank trains on, and a forward of at most the training batch or 16,384
    tokens: T 8192 scores 32 windows, not 4,096 (ten minutes after two 1.2 s steps, once);
    the digit tasks keep their 4,096 examples; the result line says the tokens scored."""
    from hpcdist.run.evaluate import bounds

    def cfg(*args):
        return train.parse_config(list(args))
    assert bounds(cfg(), 11) == (512, 4096)                            # sort: as before
    assert bounds(cfg("--steps", "1000", "--batch-size", "8"), 8192) == (8, 32)
    assert bounds(cfg("--steps", "2", "--batch-size", "1"), 8192) == (2, 1)
    assert bounds(cfg("--steps", "2", "--batch-size", "1", "--eval-tokens", "0"), 8192) == \
        (2, 4096)
    assert bounds(cfg("--steps", "5000", "--batch-size", "4", "--eval-tokens", "65536"),
                  1024) == (16, 64)
    # the windows follow the run's sequences, not a rank's: any layout of one global batch
    # (replicas, accumulation) scores the same ones
    one = bounds(cfg("--steps", "40", "--batch-size", "16"), 64)[1]
    assert one == 80 == bounds(cfg("--steps", "40", "--batch-size", "4"), 64, replicas=4)[1] \
        == bounds(cfg("--steps", "40", "--batch-size", "2", "--grad-accum", "2"), 64, 4)[1]
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    r = run_train("--task", "text", "--data", str(text), "--block-size", "64", "--steps", "40",
                  "--batch-size", "4", "--n-embd", "32", "--out-dir", str(tmp_path),
                  "--log-every", "20", "--eval-tokens", "640")
    assert r.returncode == 0, r.stderr
    final = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][-1]
    assert final["eval_tokens"] == 10 * 64                              # 640 // 64 windows
    assert "| 640 tokens scored in " in r.stdout
    r = run_train("--eval-tokens", "-1")
    assert r.returncode == 2 and "--eval-tokens must be 0 or more, got -1" in r.stderr


BAD = [
    (["--task", "nope"], "unknown --task"),
    (["--beta2", "1.5"], "--beta1 and --beta2 (AdamW's moment decays) must be in [0, 1)"),
    (["--n-embd", "100000"], "optimizer state need 3576.4 GiB a rank"),
    (["--steps", "0"], "steps must be positive"),
    (["--batch-size", "-3"], "--batch-size must be positive"),
    (["--n-embd", "30", "--n-head", "4"], "divisible"),
    (["--task", "text"], "needs a data file"),
    (["--task", "text", "--data", "/no/such/file.txt"], "does not exist"),
    (["--device", "tpu"], "unknown --device"),
    (["--bogus-flag", "1"], "unrecognized arguments"),
    (["--steps", "ten"], "invalid int value"),
    (["--compress", "topk"], "compresses nothing"),
    (["--backend", "nccl"], "needs --device gpu"),
    (["--save-every", "5"], "need --save-dir"),
    (["--precision", "fp4"], "unknown --precision"),
    (["--density", "0"], "density must be in"),
    (["--length", "3", "--num-digits", "2", "--batch-size", "64"], "fewer than one global step"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3"),
    (["--zero", "2", "--compress", "fp16"], "compression runs with --zero 0 only"),
    (["--pp", "2", "--zero", "2"], "like Megatron-LM and DeepSpeed, pipelines run with"),
    (["--compress", "powersgd"], "compresses nothing"),
    (["--compress", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank (PowerSGD's approximation rank)"),
    (["--compress", "powersgd", "--rank", "0"], "--powersgd-rank (PowerSGD's approximation rank)"),
    (["--strategy", "ps"], "needs more ranks than servers"),
    (["--strategy", "ps", "--zero", "1"], "drop --zero"),
    (["--strategy", "ps", "--max-staleness", "-2"], "--max-staleness >= -1"),
    (["--max-staleness", "2"], "are for --strategy ps"),
    (["--straggler", "slow"], "--straggler takes RANK:MS"),
    (["--straggler", "3:10"], "is not a rank of a world of 1"),
    (["--experts", "4", "--top-k", "5"], "--top-k 5 must be between 1 and the 4 experts"),
    (["--experts", "4", "--ep", "3"], "--ep 3 must divide the 4 experts"),
    (["--experts", "4", "--ep", "2"], "--ep 2 must divide the data-parallel size 1"),
    (["--experts", "4", "--capacity-factor", "-1"], "--capacity-factor (0: dropless)"),
    (["--ep", "2"], "add --experts E"),
    (["--experts", "4", "--balance", "bias"], "add --router sigmoid"),
    (["--experts", "4", "--tp", "2", "--sequence-parallel"],
     "--sequence-parallel (the experts run whole on every rank"),
    (["--experts", "4", "--cp", "2", "--capacity-factor", "1"],
     "--capacity-factor with --cp (drops follow global token order"),
    (["--experts", "4", "--compress", "fp16"], "--compress with experts is not built yet"),
    (["--experts", "4", "--expert-hidden", "-1"], "--expert-hidden must be >= 0"),
    (["--expert-hidden", "32"], "add --experts E"),
    (["--inner-steps", "10"], "--inner-steps is for --strategy diloco"),
    (["--strategy", "diloco", "--pp", "2"], "--pp inside a group is not built"),
    (["--strategy", "diloco", "--inner-steps", "8", "--fragments", "4", "--outer-overlap", "2"],
     "must be below H / fragments = 2"),
    (["--strategy", "diloco", "--group-size", "3"], "--group-size 3 must divide the world size 1"),
    (["--shard-group", "node"], "add --zero 1, 2 or 3"),
    (["--on-failure", "shrink"], "lacks: run under Open MPI 5 (`make venv-ompi`"),
    (["--on-failure", "shrink", "--zero", "1", "--mirror-every", "0"],
     "shards its state (--mirror-every 0), so the survivors restore from the last checkpoint: "
     "add --save-dir"),
    (["--on-failure", "shrink", "--compress", "topk"],
     "shards its state (compression's residuals), so the survivors restore from the last"),
    (["--mirror-every", "-1"], "--mirror-every must be >= 0"),
    (["--on-failure", "shrink", "--strategy", "ps"], "with --strategy ps is not built"),
    (["--on-failure", "shrink", "--respawn", "--backend", "nccl", "--device", "standin"],
     "--respawn with --backend nccl is not built (a new process would need the lost rank's"),
    (["--shrink-batch", "keep"], "--shrink-batch and --respawn are for --on-failure shrink"),
    (["--respawn"], "--shrink-batch and --respawn are for --on-failure shrink"),
    (["--on-failure", "retry"], "unknown --on-failure 'retry'"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    r = run_train(*args, "--out-dir", str(tmp_path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bad_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("steps = = 3\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("stepz = 3\n")
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('steps = "many"\n')
    for args, message in [(["--task", "text", "--data", str(empty)], "is empty"),
                          (["--config", str(bad_toml)], "not valid TOML"),
                          (["--config", str(unknown)], "unknown key 'stepz'"),
                          (["--config", str(wrong_type)], "steps should be int"),
                          (["--config", str(tmp_path / "none.toml")], "does not exist")]:
        r = run_train(*args, "--out-dir", str(tmp_path))
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_toml_then_flags_override(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('n_layer = 3\nlr = 1\ntask = "reverse"\n')
    cfg = train.parse_config(["--config", str(cfg_file), "--n-layer", "1"])
    assert cfg.n_layer == 1 and cfg.lr == 1.0 and cfg.task == "reverse"


def test_gpu_without_cupy_is_a_clear_error(tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here; this checks the message when it is missing")
    except ImportError:
        pass
    r = run_train("--device", "gpu", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "CuPy" in r.stderr


def test_signal_saves_a_checkpoint_exits_75_and_resume_finishes(tmp_path):
    """SIGUSR1 (what the job templates forward before a time limit) during step 5: the run
    stops after step 6 with a checkpoint and exit code 75; --resume continues from it."""
    args = ["--steps", "20", "--n-layer", "1", "--n-embd", "16", "--log-every", "10",
            "--save-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HPCDIST_SIGNAL_AT="0:5")
    r = subprocess.run([sys.executable, "-m", "hpcdist.train", *args], capture_output=True,
                       text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == train.EXIT_PREEMPTED == 75, r.stderr
    assert "stopped after step 6 of 20 on SIGUSR1" in r.stdout
    assert (tmp_path / "ckpt" / "step_00000006" / "manifest.json").exists()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "preempted" and last["step"] == 6
    r = run_train(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "at step 6" in r.stdout and "held-out accuracy" in r.stdout
