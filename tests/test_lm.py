"""Language-model work end to end: token shards (llm.c's format, raw uint16), the tokenizer
that prepares them, the vocabulary kept with checkpoints and guarded on resume, exact resume
of the data position at another world size, sampling against transformers, GPT-2 weights in,
and an export that transformers' text-generation pipeline runs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdist.device import backend
from hpcdist import data
from hpcdist.data import shards, vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else "mpiexec"


def train(tmp_path, n, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = ([mpiexec(), "-n", str(n)] if n else []) + [sys.executable, "-m", "hpcdist.train",
                                                       *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)


def test_llm_c_shards_and_raw_bin_read_by_memory_map(tmp_path):
    tokens = np.arange(5000) % 300
    shards.write_shard(str(tmp_path / "a_000000.bin"), tokens)
    head = np.fromfile(tmp_path / "a_000000.bin", dtype="<i4", count=256)
    assert list(head[:3]) == [20240520, 1, 5000]
    m = shards.open_shard(str(tmp_path / "a_000000.bin"))
    assert isinstance(m, np.memmap) and np.array_equal(m, tokens)
    tokens.astype("<u2").tofile(tmp_path / "raw.bin")             # nanoGPT's train.bin
    with pytest.raises(ValueError, match="--vocab-size"):
        shards.open_shard(str(tmp_path / "raw.bin"))
    assert np.array_equal(shards.open_shard(str(tmp_path / "raw.bin"), 300), tokens)
    (tmp_path / "bad_000000.bin").write_bytes((tmp_path / "a_000000.bin").read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        shards.open_shard(str(tmp_path / "bad_000000.bin"))
    train_set, test_set = data.make_task("text", data=str(tmp_path / "raw.bin"), block_size=8,
                                         vocab_size=300)
    x, y = train_set.batch([0, 3])
    assert np.array_equal(x[1], tokens[24:32]) and np.array_equal(y[1], tokens[25:33])
    assert len(train_set) + len(test_set) <= 5000 // 8
    with pytest.raises(ValueError, match="outside the vocabulary"):
        data.make_task("text", data=str(tmp_path / "raw.bin"), block_size=8,
                       vocab_size=100)[0].batch([20])


def test_a_vocabulary_past_65536_writes_uint32_shards_as_llm_c_does(tmp_path):
    tokens = np.array([0, 65535, 65536, 151_645, 7])
    shards.write_shard(str(tmp_path / "w_000000.bin"), tokens, vocab_size=151_646)
    head = np.fromfile(tmp_path / "w_000000.bin", dtype="<i4", count=256)
    assert list(head[:3]) == [20240520, 2, 5]             # llm.c's version 2: uint32 tokens
    assert (tmp_path / "w_000000.bin").stat().st_size == 1024 + 4 * 5
    assert np.array_equal(shards.open_shard(str(tmp_path / "w_000000.bin")), tokens)
    shards.write_shard(str(tmp_path / "n_000000.bin"), tokens[:2], vocab_size=65_536)
    assert np.fromfile(tmp_path / "n_000000.bin", dtype="<i4", count=2)[1] == 1   # uint16
    with pytest.raises(ValueError, match="outside the vocabulary of 65,536"):
        shards.write_shard(str(tmp_path / "x_000000.bin"), tokens, vocab_size=65_536)
    head[1] = 3
    (tmp_path / "v_000000.bin").write_bytes(head.tobytes())
    with pytest.raises(ValueError, match="version 3; this reader knows 1"):
        shards.open_shard(str(tmp_path / "v_000000.bin"))


def wide_tokenizer(corpus: str, out, size: int = 151_646) -> str:
    """A byte-level BPE trained on ``corpus`` whose merged tokens take the top ids of a
    ``size``-token vocabulary (Qwen2.5's by default), below them unreachable fillers."""
    import json
    from hpcdist.data.__main__ import train_tokenizer
    (out / "c.txt").write_text(corpus)
    spec = json.loads(train_tokenizer([str(out / "c.txt")], 400).to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    base = [t for t, i in learned if i < 257]
    merged = [t for t, i in learned if i >= 257]
    names = base + [f"<fill{i}>" for i in range(size - len(base) - len(merged))] + merged
    spec["model"]["vocab"] = {t: i for i, t in enumerate(names)}
    eot = spec["added_tokens"][0]["content"]
    for t in spec["added_tokens"]:
        t["id"] = spec["model"]["vocab"][eot]
    path = out / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_prepare_and_train_with_a_151646_token_vocabulary(tmp_path):
    pytest.importorskip("tokenizers")
    text = "\n".join(f"the {w} sat on the {v} by the river" for w in ("cat", "dog", "owl")
                     for v in ("mat", "log", "wall")) * 60
    tok = wide_tokenizer(text, tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "b.txt").write_text(text)
    (tmp_path / "corpus" / "a.md").write_text(text[:4000])
    (tmp_path / "corpus" / "photo.png").write_bytes(b"\x89PNG\0\0\1")
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp_path / "corpus"), "--tokenizer", tok, "--out",
                 str(tmp_path / "tok")]) == 0
    first = tmp_path / "tok" / "train_000000.bin"
    assert np.fromfile(first, dtype="<i4", count=2)[1] == 2
    ids = shards.open_shard(str(first))
    t = vocab.Tokenizer(vocab.tokenizer_file(tok))
    assert ids.max() >= 1 << 16 and t.size == 151_646
    assert list(ids[:30]) == t.encode(text[:4000])[:30]     # a.md first: sorted path order
    r = train(tmp_path, 0, "--task", "text", "--data", "tok", "--block-size", "16",
              "--batch-size", "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
              "--steps", "2", "--log-every", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    import re                            # 2 steps from a uniform start: about ln(151,646)
    held = float(re.search(r"held-out loss ([0-9.]+)", r.stdout).group(1))
    assert abs(held - np.log(151_646)) < 0.5, r.stdout[-1500:]


def test_an_impossible_vocab_size_and_a_folder_without_text_are_one_line(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from hpcdist.data.__main__ import main
    (tmp_path / "c.txt").write_text("a few words of text\n" * 5)
    assert main(["prepare", str(tmp_path / "c.txt"), "--vocab-size", "5000000000", "--out",
                 str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "token ids are at most uint32" in err[0], err
    assert main(["prepare", str(tmp_path / "c.txt"), "--vocab-size", "1000000000", "--out",
                 str(tmp_path / "t")]) == 0                # the corpus's own count, a note
    assert "the corpus gives" in capsys.readouterr().out
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.dat").write_bytes(b"\0\1\2")
    assert main(["prepare", str(tmp_path / "bin"), "--vocab-size", "300", "--out",
                 str(tmp_path / "u")]) == 2
    assert "no text file there" in capsys.readouterr().err
    assert not (tmp_path / "u").exists()


def test_the_sampler_needs_no_permutation_of_a_huge_corpus():
    n = 10 ** 9                                  # examples: a permutation would be 8 GB
    s = data.DistributedSampler(n, 4, rank=1, world=3, seed=5)
    a = s.next_batch()
    assert a.shape == (4,) and (0 <= a).all() and (a < n).all()
    whole = data.feistel(np.arange(1000), 1000, (5, 0))
    assert sorted(whole) == list(range(1000))            # a bijection


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    pytest.importorskip("tokenizers")
    tmp = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = "the of and to in is was he for it with as his on be at by had are but".split()
    text = "\n".join(" ".join(rng.choice(words, 10)) for _ in range(3000))
    (tmp / "corpus.txt").write_text(text)
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp / "corpus.txt"), "--vocab-size", "300", "--out",
                 str(tmp / "tok"), "--shard-tokens", "20000"]) == 0
    return tmp


def test_prepare_writes_a_tokenizer_and_shards_that_round_trip(prepared):
    tok = prepared / "tok"
    names = sorted(os.listdir(tok))
    assert "tokenizer.json" in names and "val_000000.bin" in names
    assert sum(n.startswith("train_") for n in names) >= 2
    v = vocab.tokenizer_file(str(tok / "tokenizer.json"))
    t = vocab.Tokenizer(v)
    first = shards.open_shard(str(tok / "train_000000.bin"))
    line = (prepared / "corpus.txt").read_text().splitlines()[0]
    assert t.decode(first[:40]).startswith(line[:20])
    train_set, test_set = data.make_task("text", data=str(tok), block_size=16)
    assert train_set.vocabulary == v and train_set.vocab_size == v["size"]


def test_resume_on_shards_is_exact_at_another_world_size(prepared, tmp_path):
    common = ["--task", "text", "--data", str(prepared / "tok"), "--block-size", "16",
              "--n-layer", "1", "--n-embd", "32", "--dtype", "fp64", "--log-every", "1000",
              "--lr", "1e-2", "--warmup", "0", "--min-lr", "1e-2"]
    whole = train(tmp_path, 2, *common, "--batch-size", "6", "--steps", "8", "--out-dir", "w")
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = train(tmp_path, 2, *common, "--batch-size", "6", "--steps", "4", "--out-dir", "a",
                  "--save-dir", "ck")
    assert first.returncode == 0, first.stderr[-2000:]
    second = train(tmp_path, 3, *common, "--batch-size", "4", "--steps", "8", "--out-dir", "b",
                   "--save-dir", "ck", "--resume")
    assert second.returncode == 0, second.stderr[-2000:]
    losses = lambda d: [r["loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl")  # noqa: E731
                        .read_text().splitlines()) if "step" in r and "loss" in r]
    np.testing.assert_allclose(losses("a") + losses("b"), losses("w"), rtol=1e-9)


def test_resume_with_another_vocabulary_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefgh " * 500)
    (tmp_path / "b.txt").write_text("ijklmnop " * 500)          # the same size, other chars
    (tmp_path / "c.txt").write_text("abcdefghz " * 500)         # another size
    common = ["--task", "text", "--block-size", "8", "--batch-size", "4", "--save-dir", "ck",
              "--n-layer", "1", "--n-embd", "16"]
    r = train(tmp_path, 2, *common, "--data", "a.txt", "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    before = (tmp_path / "ck" / "latest").read_text()
    for other, says in (("b.txt", "9 characters ' ijklmnop'"),
                        ("c.txt", "10 characters ' abcdefghz'")):
        r = train(tmp_path, 2, *common, "--data", other, "--steps", "6", "--resume")
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "trained on another vocabulary: 9 characters ' abcdefgh'" in lines[0]
        assert f"this run's data gives {says}" in lines[0]
    assert (tmp_path / "ck" / "latest").read_text() == before


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A small GPT-2 made by transformers itself (nothing downloaded), saved as a folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=48, n_embd=48, n_layer=2,
                                  n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                  initializer_range=0.3)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def test_gpt2_weights_in_give_transformers_logits(tiny_gpt2):
    import torch
    model, folder = tiny_gpt2
    from hpcdist.checkpoint import hf
    backend.set_default_float("float32")
    ours, _ = hf.load(str(folder))
    idx = np.random.default_rng(1).integers(0, 101, (3, 40))
    ref = model(torch.tensor(idx)).logits.detach().numpy()
    got = backend.to_numpy(ours.eval()(backend.to_device(idx)).data)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_greedy_sampling_with_the_kv_cache_equals_transformers_generate(tiny_gpt2):
    import torch
    model, folder = tiny_gpt2
    from hpcdist import sample
    ours, _ = sample.load(str(folder))
    for prompt in ([5, 17, 3], [1], list(range(20))):
        x = torch.tensor([prompt])
        ref = model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=100,
                             max_new_tokens=48 - len(prompt), do_sample=False)[0].tolist()
        assert sample.generate(ours, prompt, 48 - len(prompt)) == ref
        assert len(set(ref[len(prompt):])) > 3, "a sequence worth comparing"
    long = sample.generate(ours, [5], 100)                 # past the context: window slides
    assert len(long) == 101


def test_a_prompt_as_long_as_the_context_is_read_in_linear_memory():
    """The KV cache's prefill runs the tiled kernels by position: a prompt of 8,191 tokens
    holds no (T, T) scores (1 GiB at fp32 over 2 heads, with its copies); the greedy tokens
    equal the full forward's argmax."""
    import tracemalloc
    from hpcdist import nn, sample
    prev = backend.default_float()
    backend.set_default_float("float32")
    try:
        nn.manual_seed(0)
        m = nn.GPT(nn.GPTConfig(block_size=8192, vocab_size=50, n_layer=2, n_head=2,
                                n_embd=64)).eval()
        ids = [int(i) for i in np.random.default_rng(0).integers(0, 50, 8190)]
        tracemalloc.start()
        try:
            out = sample.generate(m, ids, 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 300 * 2**20, f"{peak / 2**20:.0f} MiB"
        full = m(backend.to_device(np.array([out[:-1]]))).data
        assert out[-2:] == [int(a) for a in backend.to_numpy(full[0, -2:]).argmax(-1)]
    finally:
        backend.set_default_float(prev)


def test_init_from_trains_gpt2_weights_in_any_layout(tiny_gpt2, tmp_path):
    _, folder = tiny_gpt2
    ids = (np.arange(20000) * 7) % 101
    shards.write_shard(str(tmp_path / "t_000000.bin"), ids)
    common = ["--task", "text", "--data", str(tmp_path / "t_000000.bin"), "--vocab-size", "101",
              "--block-size", "32", "--batch-size", "4", "--steps", "2", "--init-from",
              str(folder), "--log-every", "1", "--lr", "1e-9", "--min-lr", "1e-9"]
    out = {}
    for name, n, extra in (("dp", 2, []), ("tp", 4, ["--tp", "2"]), ("zero3", 2, ["--zero", "3"])):
        r = train(tmp_path, n, *common, *extra, "--out-dir", name)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl")
                     .read_text().splitlines() if '"step"' in x]
        assert "GPT 2x48 (4 heads)" in r.stdout
    np.testing.assert_allclose(out["tp"], out["dp"], rtol=1e-5)
    np.testing.assert_allclose(out["zero3"], out["dp"], rtol=1e-5)
    # the first step's loss is GPT-2's own on the first global batch (the same sampler)
    from hpcdist.checkpoint import hf
    backend.set_default_float("float32")
    gpt2, _ = hf.load(str(folder))
    train_set, _ = data.make_task("text", data=str(tmp_path / "t_000000.bin"), block_size=32,
                                  vocab_size=101)
    losses = []
    for r in range(2):
        x, y = train_set.batch(data.DistributedSampler(len(train_set), 4, r, 2,
                                                       seed=1337).next_batch())
        losses.append(float(gpt2(backend.to_device(x), backend.to_device(y))[1].data))
    np.testing.assert_allclose(out["dp"][0], np.mean(losses), rtol=1e-5)


def test_the_export_generates_in_transformers_pipeline(prepared, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    r = train(tmp_path, 2, "--task", "text", "--data", str(prepared / "tok"), "--block-size",
              "16", "--batch-size", "8", "--steps", "30", "--n-layer", "1", "--n-embd", "32",
              "--save-dir", "ck")
    assert r.returncode == 0, r.stderr[-2000:]
    from hpcdist.checkpoint.cli import main as export
    assert export(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format",
                   "safetensors"]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    text = pipe("the of", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("the of") and len(text) > len("the of")
    from hpcdist import sample
    model, v = sample.load(str(tmp_path / "ck"))
    t = vocab.Tokenizer(v)
    ours = t.decode(sample.generate(model, t.encode("the of"), 8))
    assert ours == text
