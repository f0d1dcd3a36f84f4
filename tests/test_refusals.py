"""What a new user hit fine-tuning real folders (issue 91, parts 4 and 6), each a case: one
line naming the flag or file and no traceback; a diverging run says which step, from rank 0
only, and keeps the checkpoints it had; flags are matched whole; the planner's small
numbers read as numbers; sample streams its tokens."""
import io
import json
import os
import sys

import pytest

from test_edges import one_line, py

TRAIN = ("-m", "hpcdist.train", "--steps", "2", "--batch-size", "8")


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


@pytest.mark.parametrize("args,says", [
    (["--seed", "-1"], r"--seed must be 0 or more, got -1"),
    (["--steps", "1000000000000"], r"--steps 1,000,000,000,000 is more than 1,000,000,000"),
    (["--batch-size", "0"], r"--batch-size must be positive"),
    (["--lr", "nan"], r"--lr must be a finite number"),
    (["--task", "nosuch"], r"unknown --task 'nosuch'"),
    (["--arch", "llama", "--n-embd", "30", "--n-head", "4"],
     r"--n-embd \(30\) must be divisible by --n-head \(4\), or give --head-dim"),
    (["--zer", "1"], r"--zer is not a flag \(flags are matched whole, not by a prefix\): "
                     r"did you mean --zero\?"),
    (["--stepz=3"], r"unrecognized arguments: --stepz=3"),
])
def test_a_bad_setting_is_one_line_naming_its_flag(args, says):
    rc, _, err = py(*TRAIN, *args)
    assert rc == 2, err
    one_line(err, r"^hpcdist.train: error: .*" + says)


def test_every_command_matches_flags_whole():
    for cmd, typed, means in [
            (["-m", "hpcdist.sample", "x"], "--temp", "--temperature"),
            (["-m", "hpcdist.checkpoint", "export", "a", "b"], "--overwr", "--overwrite"),
            (["-m", "hpcdist.plan"], "--lay", "--layers"),
            (["-m", "hpcdist.data", "prepare", "a", "--out", "b"], "--vocab", "--vocab-size"),
            (["-m", "hpcdist.evaluate", "x", "--data", "y"], "--batch", "--batch-size")]:
        rc, _, err = py(*cmd, typed, "1")
        assert rc == 2 and means in err, (cmd, err)
        one_line(err, rf"error: {typed} is not a flag")


def test_a_table_in_a_toml_config_says_settings_are_top_level(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nn_layer = 2\n")
    rc, _, err = py(*TRAIN, "--config", str(path))
    assert rc == 2
    one_line(err, r"\[model\] is a table; hpcdist's settings are top-level keys \(n_layer = ")


def test_hpcdist_device_is_read_by_the_trainer_as_by_the_library(tmp_path):
    env = dict(os.environ, HPCDIST_DEVICE="nosuch")
    import subprocess
    from test_edges import ROOT
    r = subprocess.run([sys.executable, *TRAIN], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=dict(env, PYTHONPATH=ROOT))
    assert r.returncode == 2
    one_line(r.stderr, r"HPCDIST_DEVICE='nosuch': choose one of .*or pass --device")
    r = subprocess.run([sys.executable, *TRAIN, "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, HPCDIST_DEVICE="standin", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert "standin" in r.stdout.split("\n", 3)[0] + r.stdout, r.stdout[:500]


def test_a_diverging_run_names_the_step_once_and_keeps_its_checkpoints(tmp_path):
    """--lr 1e10 at 2 ranks: one line from rank 0 (not a FloatingPointError per rank), exit
    1, and `latest` still the last save before the loss or the gradient became non-finite."""
    import subprocess
    from test_edges import ROOT
    save = tmp_path / "ck"
    base = [sys.executable, *TRAIN, "--save-dir", str(save), "--out-dir", str(tmp_path / "o")]
    r = subprocess.run(base, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    r = subprocess.run([_mpiexec(), "-n", "2", *base, "--resume", "--steps", "8", "--lr",
                        "1e10", "--save-every", "1", "--log-every", "4"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 1, r.stderr
    one_line(r.stderr, r"^hpcdist.train: error: the (loss|gradient's norm) became (nan|inf) at "
                       r"step (\d+): the run diverged \(lower --lr.*holds no state of the "
                       r"diverged steps$")
    step = int(r.stderr.split(" at step ")[1].split(":")[0])
    latest = (save / "latest").read_text().strip()
    assert latest == f"step_{step - 1:08d}", (latest, step)
    rc, _, err = py("-m", "hpcdist.checkpoint", "verify", str(save))
    assert rc == 0, err
    with open(tmp_path / "o" / "metrics.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if '"step"' in line]
    assert steps[-1] == step                      # the record of the step it happened in


def test_sample_takes_one_prompt_and_lists_every_family(tmp_path):
    rc, _, err = py("-m", "hpcdist.sample", str(tmp_path), "--prompt", "a", "--ids", "1")
    assert rc == 2
    one_line(err, r"--prompt and --ids are both the prompt: give one")
    rc, out, _ = py("-m", "hpcdist.sample", "--help")
    from hpcdist import nn
    for f in nn.FAMILIES.values():
        for cls in f.hf.model_types.values():
            name = cls.replace("ForCausalLM", "").replace("LMHeadModel", "")
            assert name in " ".join(out.split()), (name, out[:1500])


def test_sample_streams_tokens_as_they_are_drawn_and_joins_to_the_whole_decoding(
        monkeypatch):
    """Each token's text is written when it is drawn (the first before the second is
    asked for), and the pieces join to the decoding of the whole output, for a byte-level
    BPE (characters cut across tokens) and a tokenizer that drops a leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from hpcdist import sample

    class Tok:                                         # (sample's interface: decode(ids))
        def __init__(self, hf):
            self.hf = hf

        def decode(self, ids):
            return self.hf.decode(ids)
    words = ["▁the", "▁cat", "▁sat", "\n", "▁on", "é"]
    sp = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="é"))
    sp.decoder = decoders.Metaspace()                 # "▁the" -> "the" at the start
    byte = Tokenizer(models.BPE())                    # bytes alone: é is two tokens
    byte.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte.decoder = decoders.ByteLevel()
    byte.train_from_iterator(["héllo wörld"], trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cut = byte.encode("héllo wörld").ids
    assert len(cut) == len("héllo wörld".encode())
    for hf, prompt, drawn in [(sp, [0], [1, 2, 3, 4, 1, 5]), (sp, [], [1, 2, 3, 0]),
                              (byte, cut[:1], cut[1:])]:
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        stream = sample.Stream(Tok(hf), prompt)
        stream.add(drawn[0])
        assert out.getvalue().strip(), "the first token waited for the end"
        for t in drawn[1:]:
            stream.add(t)
        stream.end()
        monkeypatch.undo()
        assert out.getvalue() == hf.decode(prompt + drawn) + "\n", (out.getvalue(),)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    stream = sample.Stream(None, [3, 1])
    for t in (4, 1, 5):
        stream.add(t)
    stream.end()
    monkeypatch.undo()
    assert out.getvalue() == "3,1,4,1,5\n"


def test_the_planner_prints_small_models_and_steps_in_their_units():
    from hpcdist.plan.table import count, seconds
    assert [count(n) for n in (8.03e9, 124.4e6, 120_600, 512)] == \
        ["8.0 B", "124.4 M", "120.6 k", "512"]
    assert [seconds(t) for t in (15.08, 0.8746, 13e-6, 4e-7, 0.0)] == \
        ["15.08 s", "874.6 ms", "13 us", "0.4 us", "0.00 s"]
    rc, out, err = py("-m", "hpcdist.plan", "--arch", "gpt", "--layers", "2", "--hidden", "64",
                      "--heads", "2", "--seq", "64", "--vocab", "256", "--gpus", "2",
                      "--global-batch", "8")
    assert rc == 0, err
    assert "0.0 B" not in out and " k parameters" in out and "0.00 s per step" not in out
    rc, _, err = py("-m", "hpcdist.plan", "--model", "gpt")
    assert rc == 2
    one_line(err, r"--model gpt: --model \(--preset\) names a published model .* a family "
                  r"is --arch gpt")


def test_a_missing_tokenizer_names_its_flag(tmp_path):
    from test_edges import corpus
    text = corpus(tmp_path / "a.txt", lines=50)
    rc, _, err = py(*TRAIN, "--data", text, "--tokenizer", str(tmp_path / "nosuch.json"))
    assert rc == 2
    one_line(err, r"error: --tokenizer .*nosuch.json: no such file$")


def test_resume_takes_the_model_from_the_checkpoint_and_a_contradiction_names_both(tmp_path):
    save, out = str(tmp_path / "ck"), str(tmp_path / "o")
    shape = ["--arch", "llama", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
             "--n-kv-head", "1", "--precision", "fp32", "--task", "reverse"]
    rc, _, err = py(*TRAIN, *shape, "--save-dir", save, "--out-dir", out)
    assert rc == 0, err
    rc, said, err = py("-m", "hpcdist.train", "--resume", "--save-dir", save, "--steps", "3",
                       "--batch-size", "8", "--out-dir", out)
    assert rc == 0, err
    assert f"note: --resume takes the run's settings from {save} (" in said and \
        "the command leaves open: --arch llama, its shape" in said
    assert "resuming from" in said and "Llama 2x32 (2 heads, 1 kv head)" in said, said[:800]
    assert "task reverse" in said
    for flag, value, theirs in (("--n-layer", "3", "2"), ("--arch", "gpt", "'llama'"),
                                ("--task", "sort", "'reverse'")):
        rc, _, err = py("-m", "hpcdist.train", "--resume", "--save-dir", save, "--steps", "4",
                        flag, value, "--out-dir", out)
        assert rc == 2
        one_line(err, rf"{flag} '?{value}'? contradicts --resume: .* holds a run with {flag} "
                      rf"{theirs}; drop {flag}")
    rc, _, err = py("-m", "hpcdist.train", "--resume", "--save-dir", save, "--steps", "4",
                    "--n-layer", "2", "--batch-size", "8", "--out-dir", out)
    assert rc == 0, err                                 # (one that agrees is fine)


def test_the_planner_plans_a_cluster_of_cpu_nodes():
    """--gpu cpu: a rank's peak measured on this machine's cores (fp32), the command on
    --device cpu (one node: mpirun; several: jobs/train-cpu.sbatch)."""
    base = ["-m", "hpcdist.plan", "--arch", "gpt", "--layers", "2", "--hidden", "64",
            "--heads", "2", "--seq", "64", "--vocab", "256", "--global-batch", "8", "--gpu",
            "cpu"]
    rc, out, err = py(*base, "--gpus", "2", "--gpus-per-node", "2")
    assert rc == 0, err
    assert "x CPU ranks (" in out and "TFLOP/s fp32 measured here" in out
    assert "mpirun -n 2 python -m hpcdist.train --device cpu" in out
    assert "--precision" not in out.split("run it")[1]          # (fp32: the CPU's)
    rc, out, err = py(*base, "--gpus", "4", "--gpus-per-node", "2")
    assert rc == 0 and "sbatch -N 2 --ntasks-per-node=2 jobs/train-cpu.sbatch" in out, err


@pytest.mark.parametrize("args,says", [
    (["--async-save"], r"--async-save needs --save-dir"),
    (["--async-save", "--save-dir", "ck", "--strategy", "ps"], r"a parameter server saves"),
    (["--async-save", "--save-dir", "ck", "--on-failure", "shrink"],
     r"--async-save with --on-failure shrink"),
])
def test_async_save_where_it_cannot_run_is_one_line(tmp_path, args, says):
    rc, _, err = py(*TRAIN, *args, cwd=str(tmp_path))
    assert rc == 2
    one_line(err, says)
