"""The Llama family against transformers: tiny random Llama, Mistral and Mixtral models made by
transformers itself (nothing downloaded) load into ours with the same logits (fp32 to 1e-4,
fp64 to 1e-6: transformers makes its rotary tables in fp32), greedy text equals theirs token
for token through our KV cache (which holds only the kv heads), an hpcdist checkpoint exports
to a folder transformers loads as Llama / Mixtral with the same logits, and every bad setting
is one line before step 1. The layouts: tests/mpi/test_llama.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdist import nn, sample, train
from hpcdist.device import backend

from hf_oracle import assert_greedy_equals_generate, assert_same_logits, export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
             rope_theta=300.0, initializer_range=0.2)


def _made(kind, **extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "mixtral": ("MixtralConfig", "MixtralForCausalLM")}[kind]
    cfg = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    model.generation_config.eos_token_id = None         # (ours draws on past any token)
    return model


@pytest.fixture(scope="module", params=["llama", "mistral", "mixtral", "llama-mqa-bias"])
def folder(request, tmp_path_factory):
    kind = request.param
    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "llama-mqa-bias": dict(num_key_value_heads=1, attention_bias=True,
                                    tie_word_embeddings=True)}.get(kind, {})
    model = _made(kind.split("-")[0], **extra)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, safe_serialization=True)
    return kind, model, path


def test_weights_in_give_transformers_logits(folder):
    import torch
    kind, model, path = folder
    from hpcdist.checkpoint import hf
    idx = np.random.default_rng(1).integers(0, 61, (3, 40))
    ref = model(torch.tensor(idx)).logits.detach().numpy()
    for dtype, tol in (("float32", 1e-4), ("float64", 1e-5)):
        backend.set_default_float(dtype)
        ours, _ = hf.load(str(path))
        assert isinstance(ours, nn.Llama) and hf.family(str(path)).arch == "llama"
        got = backend.to_numpy(ours.eval()(backend.to_device(idx)).data)
        np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)
    backend.set_default_float("float32")


def test_greedy_text_with_the_kv_cache_equals_transformers_generate(folder):
    kind, model, path = folder
    ours, _ = sample.load(str(path))
    assert_greedy_equals_generate(ours, model, kind)
    cache = [{} for _ in ours.blocks]
    ours(backend.to_device(np.array([[1, 2, 3]])), cache=cache)
    kv = ours.config.attention_shape().pieces[1]                        # only the kv heads
    assert cache[0]["k"].shape == cache[0]["v"].shape == (1, 3, kv)


@pytest.fixture(scope="module", params=[0, 4], ids=["llama", "mixtral"])
def trained(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    args = ["--arch", "llama", "--n-kv-head", "2", "--steps", "3", "--dtype", "fp64",
            "--batch-size", "8", "--save-dir", str(tmp / "ck"), "--out-dir", str(tmp / "o")]
    if request.param:
        args += ["--experts", str(request.param)]
    cfg = train.parse_config(args)
    final = train.train(cfg, log=lambda *a: None)
    return tmp, cfg, final


def test_a_checkpoint_exports_to_a_folder_transformers_loads(trained):
    transformers = pytest.importorskip("transformers")
    tmp, cfg, _ = trained
    out = tmp / "hf"
    config = export(tmp / "ck", out)
    assert config["model_type"] == ("mixtral" if cfg.experts else "llama")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(theirs).__name__ == ("MixtralForCausalLM" if cfg.experts else
                                     "LlamaForCausalLM")
    backend.set_default_float("float64")
    ours, _ = sample.load(str(tmp / "ck"))
    idx = np.array([[1, 2, 3, 0, 4, 5, 6, 7]])
    got, ref = assert_same_logits(ours, theirs, idx)
    again, _ = sample.load(str(out))                        # and back in from the folder
    np.testing.assert_allclose(backend.to_numpy(again(backend.to_device(idx)).data), got,
                               atol=1e-5 * np.abs(ref).max(), rtol=0)
    backend.set_default_float("float32")


@pytest.mark.parametrize("args,says", [
    (["--arch", "llama", "--n-head", "4", "--n-kv-head", "3"],
     "must be divisible by --n-kv-head (3)"),
    (["--n-kv-head", "2"], "--n-kv-head is a setting of llama, qwen2, qwen3, gemma, gemma2, not of --arch gpt"),
    (["--arch", "llama", "--n-kv-head", "1", "--tp", "2"], "must divide n_kv_head (1)"),
    (["--arch", "llama", "--n-embd", "36", "--n-head", "4"], "must be even"),
    (["--arch", "llama", "--n-kv-head", "2", "--n-head", "4", "--cp", "4",
      "--cp-impl", "ulysses"], "cp must divide them"),
    (["--arch", "mamba"], "unknown --arch 'mamba'"),
    # Qwen2's, Gemma's and the rotary settings (tests/test_families.py has the rest of them)
    (["--arch", "gemma", "--n-embd", "48", "--n-head", "4", "--head-dim", "9"],
     "--arch gemma: the head size 9 must be even"),
    (["--arch", "gemma", "--no-tie-weights"], "Gemma's head is the token table"),
    (["--arch", "qwen2", "--rope-type", "dynamic"], "unknown --rope-type 'dynamic'"),
    (["--arch", "qwen2", "--rope-type", "yarn", "--rope-beta-slow", "40"],
     "yarn rotary scaling needs 0 < --rope-beta-slow < --rope-beta-fast"),
    (["--arch", "llama", "--rope-theta", "-1"], "--rope-theta must be positive, got -1.0"),
    (["--arch", "llama", "--norm-eps", "-1"], "--norm-eps must be positive, got -1.0"),
    (["--arch", "llama", "--ffn-hidden", "-5"], "--ffn-hidden must be 0 or more, got -5"),
    (["--rope-type", "llama3"], "--rope-type is a setting of llama, qwen2, qwen3, gemma, "
                                "gemma2, not of --arch gpt"),
])
def test_bad_settings_are_one_line_before_step_one(args, says):
    r = subprocess.run([sys.executable, "-m", "hpcdist.train", "--steps", "1", *args],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_an_unknown_architecture_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    r = subprocess.run([sys.executable, "-m", "hpcdist.sample", str(tmp_path), "--ids", "1"],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode != 0 and "model_type 'falcon' is not a family hpcdist reads" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
