"""LoRA against its oracle, Hugging Face PEFT (+ PyTorch), in fp64: from the same folder and
the same adapter weights (a PEFT folder saved with init_lora_weights=False) the logits agree,
and after one SGD step the adapters agree, for plain LoRA and rsLoRA; GPT-2 (no rotary, so
transformers' fp32 rotary tables do not enter) to 1e-10, a Llama with grouped-query attention
and a part of q | k | v adapted to its base's own agreement with transformers. The base is
frozen; an export loads in PEFT and its merge equals merge_and_unload; what PEFT folders hold
that hpcdist does not compute is one line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdist.device import backend

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}


def _base(kind, path):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=24, n_layer=2,
                                      n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)


def _peft(kind, base, out, rslora):
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], use_rslora=rslora,
                          init_lora_weights=False, fan_in_fan_out=kind == "gpt2")
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(out)


@pytest.fixture(scope="module", params=[("gpt2", False), ("gpt2", True), ("llama", False),
                                        ("llama", True)], ids=lambda p: f"{p[0]}-rs{p[1]}")
def folders(request, tmp_path_factory):
    kind, rslora = request.param
    root = tmp_path_factory.mktemp(f"{kind}{int(rslora)}")
    _base(kind, str(root / "base"))
    _peft(kind, str(root / "base"), str(root / "adapter"), rslora)
    return kind, str(root / "base"), str(root / "adapter")


def _ours(base, adapter):
    from hpcdist.checkpoint import peft as ours_peft
    backend.set_default_float("float64")
    spec, tensors = ours_peft.read(adapter)
    from hpcdist.checkpoint import adapters
    model, _ = adapters.adapted(base, spec, tensors=tensors, where=adapter)
    return model, spec


def _theirs(base, adapter):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)


def _tol(kind, base, ids):
    """GPT-2: 1e-10; a rotary family: its base's agreement with transformers (whose rotary
    tables are fp32 even in an fp64 model), x 10."""
    if kind == "gpt2":
        return 1e-10
    from hpcdist.checkpoint import hf
    backend.set_default_float("float64")
    ours, _ = hf.load(base)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    want = ref(torch.tensor(ids)).logits.detach().numpy()
    got = backend.to_numpy(ours.eval()(ids).data)
    return 10 * float(np.abs(got - want).max() / np.abs(want).max())


IDS = np.random.default_rng(3).integers(0, 61, (3, 16))


def test_logits_equal_peft(folders):
    kind, base, adapter = folders
    model, spec = _ours(base, adapter)
    got = backend.to_numpy(model.eval()(IDS).data)
    want = _theirs(base, adapter)(torch.tensor(IDS)).logits.detach().numpy()
    base_only = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float64)(torch.tensor(IDS)).logits.detach().numpy()
    assert np.abs(want - base_only).max() > 1e-2 * np.abs(want).max()   # (the adapters act)
    np.testing.assert_allclose(got, want, rtol=0, atol=_tol(kind, base, IDS) * np.abs(want).max())
    backend.set_default_float("float32")


def test_one_sgd_step_equals_peft_and_pytorch(folders):
    from hpcdist.nn import lora
    kind, base, adapter = folders
    lr = 0.5
    model, spec = _ours(base, adapter)
    model.train()
    targets = np.roll(IDS, -1, axis=1)
    _, loss = model(IDS, targets)
    loss.backward()
    for _, t in lora.frozen(model):                      # the base: no gradient at all
        assert t.grad is None and not t.requires_grad
    assert all(".lora." in n for n, _ in model.named_parameters())
    for p in model.parameters():
        p.data -= lr * p.grad
    got = lora.to_peft(model, {n: backend.to_numpy(p.data) for n, p in model.named_parameters()})
    pm = _theirs(base, adapter)
    logits = pm(torch.tensor(IDS)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(targets).reshape(-1))
    ref_loss.backward()
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=lr)
    opt.step()
    want = {("base_model.model." + n.replace(".default", "")): p.detach().numpy()
            for n, p in pm.base_model.model.named_parameters() if p.requires_grad}
    assert sorted(got) == sorted(want)
    tol = _tol(kind, base, IDS)
    np.testing.assert_allclose(float(loss.data), float(ref_loss), rtol=tol)
    before = _ours(base, adapter)[0]
    start = lora.to_peft(before, {n: backend.to_numpy(p.data)
                                  for n, p in before.named_parameters()})
    for n in want:
        moved = np.abs(want[n] - start[n]).max()
        assert moved > 0, n
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=max(tol, 1e-10) * moved,
                                   err_msg=n)
    backend.set_default_float("float32")


def test_export_loads_in_peft_and_merges_as_merge_and_unload(folders, tmp_path):
    """The adapters written as a PEFT folder load in PeftModel with the same logits; the
    merged base equals PEFT's merge_and_unload."""
    from hpcdist.checkpoint import peft as ours_peft
    from hpcdist.nn import lora
    kind, base, adapter = folders
    model, spec = _ours(base, adapter)
    values = {n: backend.to_numpy(p.data) for n, p in model.named_parameters()}
    from hpcdist.checkpoint import adapters
    adapters.write(str(tmp_path / "out"), spec, lora.to_peft(model, values), base)
    again = _theirs(base, str(tmp_path / "out"))
    want = _theirs(base, adapter)(torch.tensor(IDS)).logits.detach().numpy()
    np.testing.assert_allclose(again(torch.tensor(IDS)).logits.detach().numpy(), want,
                               rtol=0, atol=1e-12 * np.abs(want).max())
    merged = adapters.merged(model)
    ref = {n: p.detach().numpy() for n, p in
           _theirs(base, adapter).merge_and_unload().state_dict().items()}
    from hpcdist import nn
    theirs = nn.family(model.config.arch).hf.to_theirs(model.config, merged)
    for n, v in theirs.items():
        if n in ref:
            np.testing.assert_allclose(v, ref[n], rtol=0, atol=1e-6 * np.abs(ref[n]).max(),
                                       err_msg=n)      # (to_theirs writes float32)
    backend.set_default_float("float32")


def test_what_peft_folders_hold_that_hpcdist_does_not_compute_is_one_line(folders, tmp_path):
    from hpcdist.checkpoint import peft as ours_peft
    _, base, adapter = folders
    for key, value, words in (("use_dora", True, "DoRA"), ("bias", "all", "trained biases"),
                              ("peft_type", "IA3", "only LORA"),
                              ("rank_pattern", {"q_proj": 8}, "ranks that differ")):
        bad = tmp_path / key
        bad.mkdir()
        c = json.load(open(os.path.join(adapter, "adapter_config.json")))
        c[key] = value
        json.dump(c, open(bad / "adapter_config.json", "w"))
        os.link(os.path.join(adapter, "adapter_model.safetensors"),
                bad / "adapter_model.safetensors")
        with pytest.raises(ValueError, match=words):
            ours_peft.read(str(bad))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        ours_peft.read(str(tmp_path))


def test_targets_by_role():
    from hpcdist.nn import lora
    assert lora.targets_of("all-linear") == lora.ROLES
    assert lora.roles_of("model.layers.0.self_attn.q_proj") == {"q"}
    assert lora.roles_of("transformer.h.0.attn.c_attn") == {"q", "k", "v"}
    assert lora.roles_of("transformer.h.0.mlp.c_proj") == {"down"}
    assert lora.roles_of("model.layers.0.block_sparse_moe.experts.3.w1") == {"experts"}
    assert lora.roles_of("model.layers.0.block_sparse_moe.gate") == frozenset()
    site = lora.Site("blocks.0.attn.c_attn", ("transformer.h.0.attn.c_attn",), (72,))
    with pytest.raises(ValueError, match="target them together"):
        lora.chosen(site, ("q", "v"))
    with pytest.raises(ValueError, match="roles are"):
        lora.LoraSpec(4, 8.0, targets=("qq",))


# ---- the command line: train, resume, export, sample -------------------------------------

def _run(*argv, ranks=1, ok=True, cwd=None):
    bin_ = os.path.dirname(sys.executable)
    cmd = ([os.path.join(bin_, "mpiexec"), "-n", str(ranks)] if ranks > 1 else []) + \
        [sys.executable, "-m", *argv]
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert (out.returncode == 0) == ok, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Qwen2 folder (tests/tiny_hf.py), chats prepared with its template, adapters
    trained on 2 ranks with TP 2 for 6 steps, saved."""
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tiny_hf.py"), "qwen2",
                    str(root / "base"), str(corpus)], check=True, capture_output=True)
    with open(root / "chats.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"where is the fox {i}?"},
                {"role": "assistant", "content": "over the lazy dog."}]}) + "\n")
    _run("hpcdist.data", "prepare", str(root / "chats.jsonl"), "--tokenizer",
         str(root / "base"), "--out", str(root / "tok"))
    said = _run("hpcdist.train", "--init-from", str(root / "base"), "--data",
                str(root / "tok"), "--block-size", "128", "--batch-size", "2", "--steps", "6",
                "--lr", "3e-2", "--lora-rank", "4", "--lora-alpha", "8", "--tp", "2",
                "--save-dir", str(root / "run"), "--out-dir", str(root / "out"), ranks=2)
    return root, said


def test_a_lora_run_trains_the_adapters_alone(trained):
    from hpcdist import checkpoint
    root, said = trained
    assert "parameters frozen" in said and "trained (LoRA rank 4, scale 2" in said
    reader = checkpoint.Reader(checkpoint.latest(str(root / "run")))
    kinds = {n.split("/", 1)[0] for n in reader.tensors}
    assert kinds == {"param", "opt.exp_avg", "opt.exp_avg_sq"}
    assert all(".lora." in n for n in reader.tensors)
    assert reader.manifest["meta"]["base"].startswith("sha256:")


def test_resume_in_another_layout_and_refused_on_another_base(trained, tmp_path):
    import shutil
    root, _ = trained
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    said = _run("hpcdist.train", "--init-from", str(root / "base"), "--data", str(root / "tok"),
                "--block-size", "128", "--batch-size", "4", "--steps", "8", "--lr", "3e-2",
                "--lora-rank", "4", "--lora-alpha", "8", "--save-dir", str(run), "--resume",
                "--out-dir", str(tmp_path / "out"))
    assert "resumed" in said.lower() and "step     8/8" in said
    other = tmp_path / "other"                       # the same shape, other weights
    shutil.copytree(root / "base", other)
    from hpcdist.checkpoint.hf_files import read_safetensors
    from hpcdist.checkpoint.tools import write_safetensors
    path = str(other / "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.float32(0.01)
    write_safetensors(path, tensors, {"format": "pt"})
    said = _run("hpcdist.train", "--init-from", str(other), "--data", str(root / "tok"),
                "--block-size", "128", "--batch-size", "4", "--steps", "10", "--lora-rank", "4",
                "--lora-alpha", "8", "--save-dir", str(run), "--resume",
                "--out-dir", str(tmp_path / "out2"), ok=False)
    assert "LoRA adapters of the base sha256:" in said and "Traceback" not in said


def test_exported_adapters_generate_as_peft_and_sample(trained, tmp_path):
    """export --format peft: PeftModel.from_pretrained loads it, and its greedy text equals
    python -m hpcdist.sample's, with the adapter folder and from the checkpoint, token for
    token; --merge: a folder of the family whose logits are PEFT's merge_and_unload()'s."""
    root, _ = trained
    base, out = str(root / "base"), str(tmp_path / "adapter")
    _run("hpcdist.checkpoint", "export", str(root / "run"), out, "--format", "peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, out).eval()
    prompt = [5, 17, 42, 9]
    ref = pm.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    from hpcdist.checkpoint.hf_files import folder_vocabulary
    from hpcdist.data.vocab import Tokenizer
    text = Tokenizer(folder_vocabulary(base)).decode(prompt + ref)
    ids = ",".join(map(str, prompt))
    for source in ((base, "--adapter", out), (str(root / "run"),)):
        said = subprocess.run([sys.executable, "-m", "hpcdist.sample", *source, "--ids", ids,
                               "--tokens", "10"], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        assert said.returncode == 0, said.stderr
        assert said.stdout.rstrip("\n") == text, (source, said.stdout, text)
    _run("hpcdist.checkpoint", "export", str(root / "run"), str(tmp_path / "merged"),
         "--format", "safetensors", "--merge")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                               dtype=torch.float32)
    x = torch.tensor([prompt * 4])
    want = pm.merge_and_unload()(x).logits.detach().numpy()
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert np.abs(plain(x).logits.detach().numpy() - want).max() > 1e-3 * np.abs(want).max()
    np.testing.assert_allclose(merged(x).logits.detach().numpy(), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
