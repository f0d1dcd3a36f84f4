"""The edges a new user meets around the trainer (issue 47): prepare, the checkpoint tools,
resume, export, sampling, the out folder, MFU's probe and the planner's output. Each test
here failed on the main before it."""
import json
import os
import re
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from hpcdist import checkpoint, train
from hpcdist.data import shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the cat sat on a mat while dogs ran far away and then came back home".split()


def py(*args, cwd=None, limit_bytes=None, timeout=180):
    """``python -m ...`` in a child with hpcdist importable: (rc, stdout, stderr)."""
    def limit():
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=cwd or ROOT, preexec_fn=limit,
                       env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    return r.returncode, r.stdout, r.stderr


def corpus(path, lines=2000, seed=0, words=WORDS):
    rng = np.random.default_rng(seed)
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(lines)) + "\n")
    return str(path)


def prepare(*args):
    return py("-m", "hpcdist.data", "prepare", *map(str, args))


def one_line(err: str, pattern: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.search(pattern, lines[0]), err[-2000:]
    assert "Traceback" not in err


# ---- 1, 5: data prepare ------------------------------------------------------------------------

def test_prepare_into_a_prepared_folder_is_refused_and_replace_replaces_every_shard(tmp_path):
    out = tmp_path / "tok"
    rc, _, err = prepare(corpus(tmp_path / "a.txt"), "--vocab-size", 300, "--out", out,
                         "--shard-tokens", 5000)
    assert rc == 0, err
    first = sorted(os.listdir(out))
    assert len(first) > 3 and first[0] == "tokenizer.json"
    before = {n: (out / n).read_bytes() for n in first}
    b = corpus(tmp_path / "b.txt", lines=300, seed=1, words=[w.upper() for w in WORDS])
    rc, _, err = prepare(b, "--vocab-size", 280, "--out", out)
    assert rc == 2
    one_line(err, r"holds an earlier prepare's files .*--replace")
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before   # untouched
    rc, outp, err = prepare(b, "--vocab-size", 280, "--out", out, "--replace")
    assert rc == 0 and "replaced" in outp, err
    now = sorted(os.listdir(out))
    assert now == ["tokenizer.json", "train_000000.bin", "val_000000.bin"]   # none left over
    from hpcdist.data import vocab
    tag = shards.tokenizer_tag(vocab.tokenizer_file(str(out / "tokenizer.json")))
    assert all(shards.shard_tag(str(out / n)) == tag for n in now[1:])


def test_a_shard_of_another_tokenizer_is_refused_naming_it(tmp_path):
    from hpcdist import data
    out, other = tmp_path / "tok", tmp_path / "other"
    assert prepare(corpus(tmp_path / "a.txt"), "--vocab-size", 300, "--out", out)[0] == 0
    assert prepare(corpus(tmp_path / "b.txt", seed=3, words=[w[::-1] for w in WORDS]),
                   "--vocab-size", 290, "--out", other)[0] == 0
    data.make_task("text", data=str(out), block_size=16)                     # its own: fine
    os.replace(other / "train_000000.bin", out / "train_000001.bin")         # a stray shard
    with pytest.raises(ValueError, match=r"train_000001.bin was written with another "
                                         r"tokenizer than .*tokenizer.json"):
        data.make_task("text", data=str(out), block_size=16)


def test_prepare_errors_are_one_line_naming_the_file_and_leave_nothing(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n" * 50 + b"caf\xe9 au lait\n")
    rc, _, err = prepare(bad, "--vocab-size", 300, "--out", tmp_path / "o1")
    assert rc == 2
    one_line(err, r"bad.txt: not UTF-8 at byte 503 \(0xe9\).*--encoding-errors replace")
    assert not (tmp_path / "o1").exists()
    rc, _, err = prepare(bad, "--vocab-size", 300, "--out", tmp_path / "o1",
                         "--encoding-errors", "replace")
    assert rc == 0, err
    rc, _, err = prepare(bad, "--tokenizer", tmp_path / "none.json", "--out", tmp_path / "o2")
    assert rc == 2
    one_line(err, r"--tokenizer .*none.json: no such file")
    (tmp_path / "empty.txt").write_text("")
    rc, _, err = prepare(tmp_path / "empty.txt", "--vocab-size", 300, "--out", tmp_path / "o3")
    assert rc == 2
    one_line(err, r"the corpus is empty .*empty.txt")
    assert not (tmp_path / "o3").exists()
    (tmp_path / "one.txt").write_text("a single line, all of it held out\n")
    rc, _, err = prepare(tmp_path / "one.txt", "--vocab-size", 300, "--out", tmp_path / "o4",
                         "--val-fraction", "0.5")
    assert rc == 2
    one_line(err, r"the corpus gives no training tokens")
    assert not (tmp_path / "o4").exists()


def test_a_vocabulary_the_corpus_cannot_reach_is_said(tmp_path):
    rc, out, err = prepare(corpus(tmp_path / "a.txt"), "--vocab-size", 5000, "--out",
                           tmp_path / "o")
    assert rc == 0, err
    m = re.search(r"--vocab-size 5,000 asked, the corpus gives (\d+) tokens", out)
    assert m and f"tokenizer.json ({m.group(1)} tokens, uint16 shards)" in out


def test_a_full_disk_in_prepare_is_one_line_with_a_path_and_nothing_half_written(tmp_path):
    text = corpus(tmp_path / "a.txt", lines=20000)
    (tmp_path / "o").mkdir()
    rc, _, err = py("-m", "hpcdist.data", "prepare", text, "--vocab-size", "300", "--out",
                    str(tmp_path / "o"), limit_bytes=60_000)
    assert rc == 2
    one_line(err, r"error: .*o/\.prepare-\w+/\w+.*(File too large|No space).*nothing was "
                  r"written to")
    assert os.listdir(tmp_path / "o") == []


def test_only_a_short_held_out_shard_is_named_as_such(tmp_path):
    from hpcdist.data import vocab
    v = vocab.token_ids(100)
    shards.write_shard(str(tmp_path / "train_000000.bin"), np.arange(1000) % 100)
    shards.write_shard(str(tmp_path / "val_000000.bin"), np.arange(20) % 100)
    with pytest.raises(ValueError, match=r"the held-out token shards hold no window of "
                                         r"block_size \+ 1 = 51 tokens \(20 tokens"):
        shards.token_datasets(str(tmp_path), 50, 100, v)


# ---- 2, 4: the checkpoint tools, export, an interrupted save ---------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edges")
    cfg = train.parse_config(["--steps", "4", "--save-dir", str(tmp / "ck"), "--save-every", "2",
                              "--out-dir", str(tmp / "o"), "--batch-size", "8"])
    train.train(cfg, log=lambda *a: None)
    return tmp / "ck"


def damaged_copy(saved, tmp_path):
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    f = ck / "step_00000004" / "rank_00000.npz"
    raw = bytearray(f.read_bytes())
    raw[200] ^= 1
    f.write_bytes(bytes(raw))
    return ck


def test_verify_fails_naming_a_damaged_newest_step_and_the_tools_say_which_they_use(
        saved, tmp_path):
    rc, out, err = py("-m", "hpcdist.checkpoint", "verify", str(saved))
    assert rc == 0 and out.count("verified") == 2, err
    ck = damaged_copy(saved, tmp_path)
    (ck / "partial.step_00000006").mkdir()               # a save cut off: no checkpoint, noted
    rc, out, err = py("-m", "hpcdist.checkpoint", "verify", str(ck))
    assert "partial.step_00000006: an interrupted save, not a checkpoint" in err
    assert rc == 1 and "step_00000002: step 2" in out
    assert re.search(r"step_00000004: DAMAGED: .*checksum mismatch", err)
    assert "1 of 2 checkpoint(s) damaged: step_00000004" in err
    for args in (["-m", "hpcdist.checkpoint", "inspect", str(ck)],
                 ["-m", "hpcdist.checkpoint", "export", str(ck), str(tmp_path / "m.npz")],
                 ["-m", "hpcdist.sample", str(ck), "--tokens", "3"]):
        rc, out, err = py(*args)
        assert rc == 0, err
        assert re.search(r"note: using .*step_00000002, the newest checkpoint that verifies, "
                         r"not the newest: 'latest' -> step_00000004: .*checksum", err), args


def test_export_refuses_to_overwrite_and_says_replaced_with_overwrite(saved, tmp_path):
    target = tmp_path / "m.npz"
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(target))
    assert rc == 0, err
    first = target.read_bytes()
    target.write_bytes(b"somebody's model")
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(target))
    assert rc == 2 and target.read_bytes() == b"somebody's model"
    one_line(err, r"m.npz exists; pass --overwrite")
    rc, out, err = py("-m", "hpcdist.checkpoint", "export", str(saved), str(target),
                      "--overwrite")
    assert rc == 0 and "replacing" in out and target.read_bytes() == first
    assert os.listdir(tmp_path) == ["m.npz"]                     # no temporary left


def test_a_second_ctrl_c_stops_at_once_and_the_next_start_removes_a_partial_save(tmp_path):
    from hpcdist.host import signals
    from hpcdist.run import savedir
    old = signal.getsignal(signal.SIGINT)
    try:
        assert signals.checkpoint_on_signal()
        signals._handler(signal.SIGINT, None)                    # the first: a stop request
        assert signals.requested() == signal.SIGINT
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
            signals._handler(signal.SIGINT, None)
    finally:
        signals.exit_on_signal()
        signal.signal(signal.SIGINT, old)
    ck = tmp_path / "ck"
    (ck / "step_00000008").mkdir(parents=True)
    (ck / "step_00000008" / "rank_00000.npz.tmp.123").write_bytes(b"0" * 4096)
    (ck / "partial.step_00000009").mkdir()                     # cut off while being written
    (ck / "partial.step_00000009" / "rank_00001.npz").write_bytes(b"0" * 4096)
    (ck / "partial.replaced.step_00000007").mkdir()            # cut off mid-swap: kept
    (ck / "partial.replaced.step_00000007" / "manifest.json").write_text("{}")
    said = savedir.claim(str(ck), resume=True, overwrite=False)
    savedir.release()
    assert any("removed" in s and "step_00000008" in s and "interrupted save" in s
               for s in said), said
    assert any("removed" in s and "partial.step_00000009" in s for s in said), said
    assert any("restored" in s and "step_00000007" in s for s in said), said
    assert sorted(p.name for p in ck.iterdir() if "step" in p.name) == ["step_00000007"]
    assert (ck / "step_00000007" / "manifest.json").read_text() == "{}"


# ---- 3, 10: resume, --init-from, --data ---------------------------------------------------------

def test_resume_with_other_steps_says_the_schedule_changed(saved, tmp_path):
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    rc, out, err = py("-m", "hpcdist.train", "--steps", "6", "--save-dir", str(ck), "--resume",
                      "--out-dir", str(tmp_path / "o"), "--batch-size", "8", "--warmup", "2")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if "schedule changed" in ln)
    assert "--steps 4 -> 6" in line and "--warmup 50 -> 2" in line and "step 5 runs at lr" in line


def test_init_from_refuses_a_shape_flag_that_contradicts_the_weights(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2,
                                                "n_head": 4, "n_embd": 64, "vocab_size": 50,
                                                "n_positions": 64}))
    with pytest.raises(train.ConfigError, match=r"--n-embd 256 contradicts --init-from .*hf, "
                                                r"whose n_embd is 64"):
        train.parse_config(["--init-from", str(hf), "--n-embd", "256"])
    cfg = train.parse_config(["--init-from", str(hf), "--n-embd", "64"])   # agreeing is fine
    assert cfg.n_embd == 64


def test_a_data_file_selects_the_text_task(tmp_path, capsys):
    text = corpus(tmp_path / "a.txt")
    cfg = train.parse_config(["--data", text])
    assert cfg.task == "text" and "--data selects --task text" in capsys.readouterr().out
    with pytest.raises(train.ConfigError, match="--data is for task 'text'"):
        train.parse_config(["--data", text, "--task", "sort"])      # said outright: refused


# ---- 6, 7, 8: the out folder, sampling, eval, keep-last, the log, MFU --------------------------

def test_two_live_runs_cannot_share_an_out_dir(tmp_path):
    from hpcdist.run import savedir
    savedir.claim_out_dir(str(tmp_path / "runs"))
    try:
        with pytest.raises(savedir.SaveDirError, match=r"--out-dir .*runs' is in use by another "
                                                       r"job .*pass another --out-dir"):
            savedir.claim_out_dir(str(tmp_path / "runs"))
    finally:
        savedir.release()
    savedir.claim_out_dir(str(tmp_path / "runs"))                 # released: free again
    savedir.release()


def test_sample_refuses_a_negative_temperature(saved):
    for bad in ("-1", "nan", "inf"):
        rc, _, err = py("-m", "hpcdist.sample", str(saved), "--temperature", bad)
        assert rc == 2 and "--temperature must be a number >= 0" in err and \
            "Traceback" not in err, err


def test_eval_every_keep_last_and_a_log_file(tmp_path):
    cfg = train.parse_config(["--steps", "8", "--eval-every", "3", "--save-dir",
                              str(tmp_path / "ck"), "--save-every", "2", "--keep-last", "2",
                              "--out-dir", str(tmp_path / "o"), "--batch-size", "8"])
    lines = []
    train.train(cfg, log=lines.append)
    evals = [json.loads(ln) for ln in open(tmp_path / "o" / "metrics.jsonl")
             if '"eval"' in ln]
    assert [e["step"] for e in evals] == [3, 6]
    assert all(0 < e["test_loss"] < 10 and 0 <= e["accuracy"] <= 1 for e in evals)
    assert sum("held-out loss" in ln for ln in lines) == 3           # two evals + the final
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_00000006", "step_00000008"]
    log = (tmp_path / "o" / "train.log").read_text()
    assert log.splitlines() == [str(ln) for ln in lines]


def test_mfu_probes_again_past_90_percent_and_keeps_the_best(tmp_path, monkeypatch):
    from hpcdist.run import mfu
    monkeypatch.setattr(mfu, "CACHE", str(tmp_path / "peak.json"))
    key = f"{mfu._cpu_name()} | 1 cores | float32"
    (tmp_path / "peak.json").write_text(json.dumps({key: 1e6}))      # probed under load
    calls = []
    monkeypatch.setattr(mfu, "probe", lambda cores, dt: calls.append(cores) or 5e9)
    assert mfu.cpu_peak(1)[0] == 1e6 and calls == []                   # the cache
    meter = mfu.Meter.__new__(mfu.Meter)
    meter.per_token, meter.cpu, meter.per_peak, meter.peak = 1e6, (1, np.float32), 1, 1e6
    tflops, mfu_now = meter.rate(10.0)                                 # 10 MFLOP/s: 1000%
    assert calls == [1] and meter.peak == 5e9 and mfu_now == pytest.approx(1e7 / 5e9)
    assert json.load(open(tmp_path / "peak.json"))[key] == 5e9
    meter.rate(1e9)                                                    # once a run
    assert calls == [1]


def test_the_emulated_reports_no_mfu(tmp_path):
    rc, out, err = py("-m", "hpcdist.train", "--device", "standin", "--steps", "2",
                      "--log-every", "1", "--batch-size", "8", "--out-dir", str(tmp_path))
    assert rc == 0, err
    assert "MFU not reported: the GPU stand-in has no peak" in out
    assert "MFU" not in "".join(ln for ln in out.splitlines() if ln.startswith("step"))


# ---- 9: the planner's output ----------------------------------------------------------------------

PLAN = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--global-batch", "1536",
        "--gpus", "1024"]


def test_the_plan_table_is_narrow_and_wide_on_request(capsys):
    from hpcdist import plan
    assert plan.main(PLAN[:-2] + ["--gpus", "64", "--global-batch", "64"]) in (0, 1)
    plan.main(["--layers", "8", "--hidden", "512", "--heads", "8", "--global-batch", "32",
               "--gpus", "8"])
    out = capsys.readouterr().out.splitlines()
    table = out[out.index(next(ln for ln in out if ln.lstrip().startswith("TP"))):][:11]
    assert max(map(len, table)) <= 100 and "_" not in table[0]
    plan.main(["--layers", "8", "--hidden", "512", "--heads", "8", "--global-batch", "32",
               "--gpus", "8", "--wide"])
    wide = capsys.readouterr().out
    assert "TFLOP/s/GPU" in wide and "comm share" in wide


def test_plan_json_gives_every_layout(capsys):
    from hpcdist import plan
    args = ["--layers", "8", "--hidden", "512", "--heads", "8", "--global-batch", "32",
            "--gpus", "8", "--json"]
    assert plan.main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    head = capsys.readouterr()
    plan.main(args[:-1])
    fits = int(re.search(r"(\d+) layouts fit", capsys.readouterr().out).group(1))
    assert len(rows) == fits > 10, head


@pytest.mark.parametrize("features", ["all", "megatron-2021"])
def test_the_fastest_layout_of_the_175b_case_is_the_command_to_run(capsys, features):
    """bf16 pipelines run (issue 41): the planner's fastest layout is the one it prints to
    run, with every setting of its best row."""
    from hpcdist import plan
    assert plan.main(PLAN + ["--features", features]) == 0
    out = capsys.readouterr().out
    assert "does not take yet" not in out
    best = re.search(r"best: TP (\d+) x PP (\d+) x DP (\d+)", out).groups()
    command = out.split("run it (DATA: token shards, python -m hpcdist.data prepare):\n")[1]
    assert command.lstrip().startswith("sbatch -N 128") and "--precision bf16" in command
    assert f"--pp {best[1]} " in command and (best[0] == "1" or f"--tp {best[0]}" in command)


def test_bench_gpu_count_says_what_it_is_doing():
    rc, out, err = py("-m", "hpcdist.bench", "gpu", "--count", "--layers", "1", "--embd", "32",
                      "--seq", "8", "--batch", "1", "--vocab", "64")
    assert rc == 0, err
    assert err.count("counting the launches") == 3 and "launches per training step" in out
    assert "bf16 (native, fused)" in out and "the fp32 step's" in out


# ---- 11: what has run on a GPU, said plainly ----------------------------------------------------

def test_docs_gpu_opens_with_what_is_verified_on_which_card():
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read()
    head = text.split("\n## ", 2)
    assert head[1].startswith("What is verified on which card")
    rows = [ln for ln in head[1].splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) >= 5 and all(ln.count("|") == 4 for ln in rows)
    # each row says plainly where it ran: a card named, or "never" (executing on the CPU's
    # model of the device is not running on a GPU), or the GPU stand-in's own runs
    for row in rows:
        where = row.split("|")[2]
        assert "H100" in where or "H200" in where or "never" in where or "make test" in where
    # what is today, not when it was found: no dates or commits here; they are on results.md
    assert not re.search(r"20\d\d-\d\d-\d\d|\b[0-9a-f]{7}\b|\bsession\b(?!\.sh)", text), \
        re.findall(r".{30}(?:20\d\d-\d\d-\d\d|\b[0-9a-f]{7}\b|session).{30}", text)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "docs/gpu.md#what-is-verified-on-which-card" in readme
    results = open(os.path.join(ROOT, "docs", "results.md")).read()
    assert "### What ran where (date, card, commit)" in results


def test_the_supervisor_knows_a_run_that_recovers_from_its_flag_or_its_config(tmp_path,
                                                                               monkeypatch):
    """A killed rank's supervisor exits 0 and says the survivors recover when the run has
    --on-failure shrink, from the command line or from its --config file (the flag wins)."""
    from hpcdist.run import supervisor
    toml = tmp_path / "run.toml"
    toml.write_text('on_failure = "shrink"\n')
    for argv, want in [(["--on-failure", "shrink"], True), (["--on-failure=shrink"], True),
                       (["--on-failure", "abort"], False), ([], False),
                       (["--config", str(toml)], True), ([f"--config={toml}"], True),
                       (["--config", str(toml), "--on-failure", "abort"], False),
                       (["--config", str(tmp_path / "missing.toml")], False)]:
        monkeypatch.setattr("sys.argv", ["train.py", *argv])
        assert supervisor._shrinks() is want, argv
