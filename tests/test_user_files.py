"""Nothing that hpcdist did not create is ever removed or moved: every path flag of every
command, pointed at a user's file and at a user's non-empty folder, leaves each of their
bytes where it was; ``--overwrite`` moves an old run aside only once the new run has been
validated. Damaged Hugging Face files are one line naming the file and the fault."""
import json
import os
import re
import struct

import numpy as np
import pytest

from test_edges import corpus, one_line, prepare, py


def snapshot(root) -> dict:
    """path -> bytes of every file below ``root`` (a file: itself)."""
    root = str(root)
    if os.path.isfile(root):
        return {root: open(root, "rb").read()}
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            p = os.path.join(folder, n)
            out[p] = open(p, "rb").read()
    return out


def kept(before: dict) -> None:
    """Every file of ``before`` is still there with the same bytes."""
    for path, data in before.items():
        assert os.path.isfile(path), f"{path} was removed or moved"
        assert open(path, "rb").read() == data, f"{path} was changed"


@pytest.fixture
def user(tmp_path):
    """A user's file (their corpus) and a user's non-empty folder."""
    text = corpus(tmp_path / "corpus.txt", lines=400)
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.md").write_text("my notes\n")
    (folder / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return text, str(folder)


TRAIN = ("-m", "hpcdist.train", "--steps", "2", "--batch-size", "8", "--log-every", "1")


@pytest.mark.parametrize("flag", ["--save-dir", "--out-dir", "--data"])
def test_a_train_path_flag_on_a_users_file_or_folder_loses_nothing(user, tmp_path, flag):
    text, folder = user
    for target in (text, folder, os.path.join(text, "below")):
        before = {**snapshot(text), **snapshot(folder)}
        extra = ["--out-dir", str(tmp_path / "o")] if flag != "--out-dir" else []
        rc, out, err = py(*TRAIN, flag, target, *extra, cwd=str(tmp_path))
        kept(before)
        if flag != "--data" and (target == text or target.endswith("below")):
            assert rc == 2 and "is a file, not a folder" in err, (flag, target, err[-800:])
            one_line(err, r"hpcdist.train: error: ")
        if flag == "--data" and target != text:
            assert rc == 2, err                         # a folder of no shards: refused
            one_line(err, r"hpcdist.train: error: ")


def test_prepare_out_on_a_users_file_or_folder_loses_nothing(user, tmp_path):
    text, folder = user
    other = corpus(tmp_path / "b.txt", lines=200, seed=3)
    for target in (text, folder):
        before = {**snapshot(text), **snapshot(folder)}
        rc, _, err = prepare(other, "--vocab-size", 300, "--out", target)
        kept(before)
        assert rc == 2, (target, err)
        if target == folder:                          # refused, naming one of their files
            one_line(err, r"--out '.*mine' holds files hpcdist did not write there \(the "
                          r"file 'notes.md'\).*--allow-other-files")
    assert not os.path.exists(os.path.join(folder, "tokenizer.json"))
    rc, _, err = prepare(other, "--vocab-size", 300, "--out", folder, "--allow-other-files")
    assert rc == 0, err
    kept(before)
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))   # written beside theirs
    # a corpus beside its shards is the user's own choice: its folder may be --out
    side = tmp_path / "side"
    side.mkdir()
    corpus(side / "c.txt", lines=200)
    rc, _, err = prepare(side / "c.txt", "--vocab-size", 300, "--out", side)
    assert rc == 0 and (side / "tokenizer.json").is_file(), err
    rc, _, err = prepare(side, "--vocab-size", 300, "--out", side, "--replace")
    assert rc == 0, err


def test_a_save_dir_holding_other_files_is_refused_and_the_data_folder_always(user, tmp_path):
    text, folder = user
    before = snapshot(folder)
    rc, _, err = py(*TRAIN, "--save-dir", folder, "--out-dir", str(tmp_path / "o"))
    one_line(err, r"--save-dir '.*mine' holds files hpcdist did not write there \(the file "
                  r"'notes.md'\).*--allow-other-files")
    assert rc == 2 and sorted(os.listdir(folder)) == ["notes.md", "sub"]
    rc, _, err = py(*TRAIN, "--save-dir", folder, "--allow-other-files", "--out-dir",
                    str(tmp_path / "o"))
    assert rc == 0 and os.path.isfile(os.path.join(folder, "latest")), err
    kept(before)
    rc, _, err = py(*TRAIN, "--save-dir", folder, "--resume", "--steps", "3", "--out-dir",
                    str(tmp_path / "o"))                # (resuming it needs the flag again)
    assert rc == 2 and "'notes.md'" in err, err
    data = tmp_path / "tok"
    rc, _, err = prepare(text, "--vocab-size", 300, "--out", data)
    assert rc == 0, err
    before = snapshot(data)
    for save in (data, tmp_path):                       # the data's folder, and one above it
        rc, _, err = py(*TRAIN, "--data", str(data), "--save-dir", str(save),
                        "--allow-other-files", "--out-dir", str(tmp_path / "o"))
        one_line(err, r"holds the training data --data .*: checkpoints go in a folder of "
                      r"their own")
        assert rc == 2
    kept(before)
    assert sorted(os.listdir(data)) == sorted(os.path.basename(p) for p in before)
    # what a run writes itself (its out folder's files in the save folder) is no refusal
    both = tmp_path / "both"
    for extra in ((), ("--resume", "--steps", "3")):
        rc, _, err = py(*TRAIN, "--save-dir", str(both), "--out-dir", str(both), *extra)
        assert rc == 0, err


def test_export_on_a_users_file_or_folder_loses_nothing(user, tmp_path):
    text, folder = user
    save = tmp_path / "ck"
    rc, _, err = py(*TRAIN, "--save-dir", str(save), "--out-dir", str(tmp_path / "o"))
    assert rc == 0, err
    (tmp_path / "mine" / "config.json").write_text('{"theirs": 1}')
    for target in (text, folder):
        for fmt in ("safetensors", "npz"):
            before = {**snapshot(text), **snapshot(folder)}
            rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), target,
                            "--format", fmt)
            kept(before)
            if fmt == "npz":                # (written beside it: corpus.txt.npz, mine.npz)
                assert rc == 0 and os.path.isfile(target + ".npz"), err
                continue
            assert rc == 2, (target, fmt, err)
            one_line(err, "python -m hpcdist.checkpoint: error: ")
    (tmp_path / "mine" / "config.json").unlink()
    for fmt, extra in (("safetensors", ()), ("safetensors", ("--overwrite",))):
        before = snapshot(folder)                     # their notes: no export file in the way
        rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), folder, "--format",
                        fmt, *extra)
        one_line(err, r"OUT '.*mine' holds files hpcdist did not write there \(the file "
                      r"'notes.md'\)")
        assert rc == 2 and sorted(os.listdir(folder)) == ["notes.md", "sub"]
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), folder, "--format",
                    "safetensors", "--allow-other-files")
    assert rc == 0 and os.path.isfile(os.path.join(folder, "model.safetensors")), err
    kept(before)
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), folder, "--format",
                    "safetensors", "--overwrite", "--allow-other-files")
    assert rc == 0, err
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(tmp_path / "hf"),
                    "--format", "safetensors")
    assert rc == 0, err                               # its own export replaced without a flag
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(tmp_path / "hf"),
                    "--format", "safetensors", "--overwrite")
    assert rc == 0, err


def test_overwrite_moves_nothing_when_the_run_is_refused(tmp_path):
    save = tmp_path / "ck"
    rc, _, err = py(*TRAIN, "--save-dir", str(save), "--out-dir", str(tmp_path / "o"))
    assert rc == 0, err
    before = snapshot(save)
    # refused after the folders are claimed: the data cannot feed one step of 10^7 a replica
    rc, _, err = py(*TRAIN, "--save-dir", str(save), "--overwrite", "--batch-size", "10000000",
                    "--out-dir", str(tmp_path / "o"))
    assert rc == 2 and "fewer than one global step" in err, err
    kept(before)
    assert sorted(os.listdir(tmp_path)) == ["ck", "o"]           # no ck.old-1
    rc, out, err = py(*TRAIN, "--save-dir", str(save), "--overwrite",
                      "--out-dir", str(tmp_path / "o"))
    assert rc == 0 and "--overwrite: moved run" in out and "ck.old-1 (nothing deleted)" in out
    kept({p.replace(str(save), str(save) + ".old-1"): b for p, b in before.items()
          if not p.endswith(".lock")})
    assert os.path.isfile(save / "run.json") and not os.path.exists(save.parent / "ck.old-2")


def test_a_refused_run_removes_only_the_folders_it_made(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    rc, _, err = py(*TRAIN, "--save-dir", str(deep), "--batch-size", "10000000",
                    "--out-dir", str(tmp_path / "o"))
    assert rc == 2, err
    assert not (tmp_path / "a").exists()                         # all three were made by it


# ---- the tokenizer: compared by meaning ---------------------------------------------------------

def test_the_same_tokenizer_written_three_ways_compares_equal_and_another_differs(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from hpcdist.data import vocab
    text = corpus(tmp_path / "c.txt", lines=300)
    rc, _, err = prepare(text, "--vocab-size", 300, "--out", tmp_path / "tok")
    assert rc == 0, err
    compact = (tmp_path / "tok" / "tokenizer.json").read_text()
    spec = json.loads(compact)
    indented = json.dumps(spec, indent=2, ensure_ascii=False)       # as transformers saves it
    reordered = json.dumps(dict(reversed(list(spec.items()))), indent=4)
    tok = tokenizers.Tokenizer.from_str(compact)
    again = tok.to_str(pretty=True)
    prints = {vocab.fingerprint(vocab.tokenizer_text(t)) for t in (compact, indented,
                                                                     reordered, again)}
    assert len(prints) == 1, prints
    spec["model"]["vocab"] = dict(reversed(list(spec["model"]["vocab"].items())))
    ids = sorted(spec["model"]["vocab"].values())
    swapped = dict(spec["model"]["vocab"])
    a, b = [k for k, v in swapped.items() if v in ids[-2:]]
    swapped[a], swapped[b] = swapped[b], swapped[a]                # two ids swapped: another
    spec["model"]["vocab"] = swapped
    other = vocab.fingerprint(vocab.tokenizer_text(json.dumps(spec)))
    assert other not in prints


def test_a_checkpoint_that_named_its_tokenizer_by_the_files_text_still_resumes():
    from hpcdist.checkpoint import check_meta
    from hpcdist.data import vocab
    v = vocab.tokenizer_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1},
                                                   "unk_token": "a"}}))
    old = vocab.fingerprint(v, vocab.written_digest)
    check_meta({"meta": {"vocab": old}}, {"vocab": vocab.fingerprint(v)}, "ck", v)
    with pytest.raises(Exception, match="another vocabulary"):
        check_meta({"meta": {"vocab": "x, sha256 0"}}, {"vocab": vocab.fingerprint(v)}, "ck", v)


# ---- damaged Hugging Face files -------------------------------------------------------------------

def _safetensors(path, tensors: dict, header_extra=None):
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [at, at + a.nbytes]}
        blobs.append(a.tobytes())
        at += a.nbytes
    header.update(header_extra or {})
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _damages(path):
    """(name, how to damage a good safetensors file, the words the message must hold)."""
    good = open(path, "rb").read()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    wrong_shape = dict(header)
    wrong_shape[name] = dict(header[name], shape=[s + 1 for s in header[name]["shape"]])
    raw = json.dumps(wrong_shape).encode()
    return [("truncated", good[:len(good) - 100], r"truncated\?\)"),
            ("header length", struct.pack("<Q", 1 << 40) + good[8:], r"header length says"),
            ("header JSON", good[:8] + b"{" * n + good[8 + n:], r"header is not JSON"),
            ("shape", struct.pack("<Q", len(raw)) + raw + good[8 + n:], r"needs .* bytes"),
            ("empty", b"", r"shorter than the 8-byte")]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    folder.mkdir()
    rng = np.random.default_rng(0)
    C, V, T = 16, 50, 32
    t = {"transformer.wte.weight": rng.normal(size=(V, C)) * .02,
         "transformer.wpe.weight": rng.normal(size=(T, C)) * .02,
         "transformer.ln_f.weight": np.ones(C), "transformer.ln_f.bias": np.zeros(C)}
    p = "transformer.h.0."
    t.update({p + "ln_1.weight": np.ones(C), p + "ln_1.bias": np.zeros(C),
              p + "ln_2.weight": np.ones(C), p + "ln_2.bias": np.zeros(C),
              p + "attn.c_attn.weight": rng.normal(size=(C, 3 * C)) * .02,
              p + "attn.c_attn.bias": np.zeros(3 * C),
              p + "attn.c_proj.weight": rng.normal(size=(C, C)) * .02,
              p + "attn.c_proj.bias": np.zeros(C),
              p + "mlp.c_fc.weight": rng.normal(size=(C, 4 * C)) * .02,
              p + "mlp.c_fc.bias": np.zeros(4 * C),
              p + "mlp.c_proj.weight": rng.normal(size=(4 * C, C)) * .02,
              p + "mlp.c_proj.bias": np.zeros(C)})
    _safetensors(folder / "model.safetensors", t)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": C, "vocab_size": V,
        "n_positions": T}))
    return folder


def test_damaged_weights_are_one_line_naming_the_file_in_sample_and_init_from(gpt2_folder,
                                                                             tmp_path):
    import shutil
    rc, out, err = py("-m", "hpcdist.sample", str(gpt2_folder), "--ids", "1,2", "--tokens", "2")
    assert rc == 0, err
    for what, raw, words in _damages(gpt2_folder / "model.safetensors"):
        bad = tmp_path / what.replace(" ", "-")
        shutil.copytree(gpt2_folder, bad)
        (bad / "model.safetensors").write_bytes(raw)
        where = str(bad / "model.safetensors")
        rc, _, err = py("-m", "hpcdist.sample", str(bad), "--ids", "1,2", "--tokens", "2")
        assert rc == 2, (what, err)
        one_line(err, re.escape(where) + ".*" + words)
        rc, _, err = py(*TRAIN, "--init-from", str(bad), "--task", "sort", "--out-dir",
                        str(tmp_path / "o"))
        assert rc == 2, (what, err)
        one_line(err, re.escape(where) + ".*" + words)


def test_a_config_json_that_does_not_parse_is_named_and_a_missing_one_said_alike(gpt2_folder,
                                                                                  tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(gpt2_folder, bad)
    (bad / "config.json").write_text('{"model_type": "gpt2",')
    for args in (("-m", "hpcdist.sample", str(bad), "--ids", "1"),
                 (*TRAIN, "--init-from", str(bad), "--out-dir", str(tmp_path / "o"))):
        rc, _, err = py(*args)
        assert rc == 2
        one_line(err, re.escape(str(bad / "config.json")) + r": not valid JSON")
    os.remove(bad / "config.json")
    for args in (("-m", "hpcdist.sample", str(bad), "--ids", "1"),
                 (*TRAIN, "--init-from", str(bad), "--out-dir", str(tmp_path / "o"))):
        rc, _, err = py(*args)
        assert rc == 2
        one_line(err, r"no config.json \(a Hugging Face model folder has")


def test_a_tokenizer_json_that_does_not_parse_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ')
    rc, _, err = prepare(corpus(tmp_path / "c.txt", lines=50), "--tokenizer", bad, "--out",
                         tmp_path / "tok")
    assert rc == 2
    one_line(err, re.escape(str(bad)) + r".*not a Hugging Face tokenizer.json")



# ---- the small ones -------------------------------------------------------------------------------

def test_init_from_a_mixtral_folder_takes_its_experts_for_ep(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hpcdist import train
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "mix")
    ours = train.parse_config(["--init-from", str(tmp_path / "mix"), "--ep", "2"])
    assert (ours.arch, ours.experts, ours.top_k) == ("llama", 4, 2)
    train.validate_world(ours, 2, 10_000)                 # EP 2 over 2 ranks: fine


def test_resuming_another_family_names_it():
    from hpcdist.checkpoint import CheckpointError, check_meta
    with pytest.raises(CheckpointError, match=r"holds a Llama model \(--arch llama\), this run "
                                              r"builds --arch gpt: resume with --arch llama"):
        check_meta({"meta": {"arch": "llama", "bias": False}}, {"bias": True}, "ck")


def test_a_new_run_keeps_the_five_newest_earlier_logs(tmp_path):
    from hpcdist.run import runtime
    said = []
    for run in range(8):
        f = runtime.open_run_file(str(tmp_path), "train.log", resumed=False, say=said.append)
        f.write(f"run {run}\n")
        f.close()
    names = sorted(os.listdir(tmp_path))
    assert names == ["train.log"] + [f"train.log.{n}" for n in range(1, 6)]
    assert (tmp_path / "train.log").read_text() == "run 7\n"
    assert (tmp_path / "train.log.1").read_text() == "run 6\n"
    assert (tmp_path / "train.log.5").read_text() == "run 2\n"
    assert said[-1].endswith("(the 5 newest earlier runs are kept)")
