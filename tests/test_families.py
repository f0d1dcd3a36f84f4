"""The families a user fine-tunes today against transformers: tiny random Llama 3.1 (rotary
scaling ``llama3``, tied embeddings as at 1B/3B), Qwen2 (q, k, v biases, tied and untied)
and Gemma (GeGLU, (1 + w) RMSNorm, scaled embeddings, a head size of its own) made by
transformers itself, nothing downloaded. Each loads with transformers' logits, greedy text
equals ``generate`` token for token, a trained hpcdist checkpoint exports to a folder
transformers loads as that family with the same logits, and a bad setting is one line. The
layouts: tests/mpi/test_families.py."""
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
             initializer_range=0.2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# kind -> (transformers' config and model classes, settings beyond SHAPE, our arch)
KINDS = {
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 dict(rope_theta=500.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=True),
                 "llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e4), "qwen2"),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 16,
                                                      "beta_fast": 8.0, "beta_slow": 0.5}),
                   "qwen2"),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_theta=1e4, tie_word_embeddings=True), "qwen2"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=12, rope_theta=300.0),
              "gemma"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=12, rope_theta=300.0, num_hidden_layers=3, sliding_window=8,
                    query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                    final_logit_softcapping=4.0), "gemma2"),
    "mistral-window": ("MistralConfig", "MistralForCausalLM",
                       dict(sliding_window=8, rope_theta=1e4), "llama"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=12, rope_theta=1e4), "qwen3"),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=12, rope_theta=1e4, num_hidden_layers=3, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1]),
                  "qwen3"),
    "qwen3-moe-normed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         dict(head_dim=12, rope_theta=1e4, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=24,
                              decoder_sparse_step=2, norm_topk_prob=True), "qwen3"),
}


def made(kind):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config_cls, model_cls, extra, _ = KINDS[kind]
    cfg = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():                 # (Gemma starts its norms at 0: move them off it)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None         # (ours draws on past any token)
    return model


@pytest.fixture(scope="module", params=list(KINDS))
def folder(request, tmp_path_factory):
    kind = request.param
    model = made(kind)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, safe_serialization=True)
    return kind, model, path


def test_weights_in_give_transformers_logits(folder):
    import torch
    kind, model, path = folder
    from hpcdist.checkpoint import hf
    T = 8 if kind == "mistral-window" else 40     # (training's blocks: within the window)
    idx = np.random.default_rng(1).integers(0, 61, (3, T))
    ref = model(torch.tensor(idx)).logits.detach().numpy()
    for dtype, tol in (("float32", 1e-4), ("float64", 1e-5)):
        backend.set_default_float(dtype)
        ours, _ = hf.load(str(path))
        assert ours.config.arch == KINDS[kind][3] == hf.family(str(path)).arch
        got = backend.to_numpy(ours.eval()(backend.to_device(idx)).data)
        np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)
    backend.set_default_float("float32")


def test_the_declared_differences_are_what_the_folder_says(folder):
    kind, _, path = folder
    from hpcdist.checkpoint import hf
    cfg = hf.config(str(path))
    if kind == "llama3.1":
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_context, cfg.tie_weights) \
            == ("llama3", 8.0, 16, True)
    if kind.startswith("qwen2"):
        assert cfg.bias and not cfg.out_bias and cfg.tie_weights == kind.endswith("tied")
    if kind == "gemma":
        assert cfg.head_size() == 12 and cfg.head_size() * cfg.n_head != cfg.n_embd
        assert cfg.activation == "gelu_tanh" and cfg.norm_offset == 1 and cfg.tie_weights
    if kind == "mistral-window":
        assert cfg.sliding_window == cfg.block_size == 8
    if kind.startswith("qwen3"):
        assert cfg.head_norms and cfg.head_size() == 12 and not cfg.bias
    if kind == "qwen3-moe":
        assert (cfg.experts, cfg.top_k, cfg.expert_hidden, cfg.norm_topk) == (4, 2, 24, False)
        assert [cfg.is_moe(i) for i in range(3)] == [True, False, True]
    if kind == "qwen3-moe-normed":
        assert cfg.norm_topk and [cfg.is_moe(i) for i in range(2)] == [False, True]


def test_greedy_text_with_the_kv_cache_equals_transformers_generate(folder):
    """... past the sliding window too (the window's prompt of 20 fed a row a call past 8)."""
    kind, model, path = folder
    ours, _ = sample.load(str(path))
    assert_greedy_equals_generate(ours, model, kind)


@pytest.mark.parametrize("rope", [dict(factor=8.0), dict(factor=32.0, beta_fast=16.0),
                                  dict(factor=4.0, attention_factor=1.3),
                                  dict(factor=40.0, mscale=1.0, mscale_all_dim=0.5)], ids=str)
def test_yarn_scaling_changes_frequencies_and_magnitude_as_transformers_computes_them(rope):
    """YaRN's frequencies and attention factor from config.json's settings equal
    transformers' own computation (its rope_init function) and are neither the plain
    frequencies nor all slowed."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from hpcdist.nn.attention import Rotary, rotary_of
    from hpcdist.nn.hf_adapter import rope_fields
    scaling = {"rope_type": "yarn", "original_max_position_embeddings": 64, **rope}
    c = {**SHAPE, "hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 512,
         "rope_theta": 150000.0, "rope_scaling": scaling}
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**c), "cpu")
    ours = rotary_of(nn.LlamaConfig(**rope_fields(c, "test")))
    got = ours.frequencies(64, np)
    np.testing.assert_allclose(got, theirs.double().numpy(), rtol=1e-6)
    assert abs(ours.magnitude() - factor) < 1e-12
    plain = Rotary(150000.0).frequencies(64, np)
    assert (got == plain).any() and np.isclose(got, plain / rope["factor"]).any()


def test_llama3_scaling_changes_the_frequencies_as_transformers_computes_them():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from hpcdist.nn.attention import Llama3Rotary, Rotary
    cfg = transformers.LlamaConfig(**{**SHAPE, "hidden_size": 128, "num_attention_heads": 2,
                                      "max_position_embeddings": 256,
                                      "rope_theta": 500000.0, "rope_scaling": dict(
                                          LLAMA3, original_max_position_embeddings=64)})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = Llama3Rotary(500000.0, 8.0, 1.0, 4.0, 64).frequencies(64, np)
    plain = Rotary(500000.0).frequencies(64, np)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6)
    slowed, kept = np.isclose(ours, plain / 8, rtol=1e-12), ours == plain
    assert slowed.any() and kept.any() and (~slowed & ~kept).any()   # and blended between
    del torch


@pytest.fixture(scope="module", params=["llama3.1", "qwen2", "gemma", "gemma2", "qwen3",
                                               "qwen3-moe"])
def trained(request, tmp_path_factory):
    kind = request.param
    tmp = tmp_path_factory.mktemp("run-" + kind)
    extra = {"llama3.1": ["--arch", "llama", "--rope-type", "llama3", "--rope-original-context",
                          "8", "--tie-weights"],
             "qwen2": ["--arch", "qwen2", "--n-kv-head", "2"],
             "gemma": ["--arch", "gemma", "--n-embd", "48", "--n-head", "4",
                       "--head-dim", "16"],
             "gemma2": ["--arch", "gemma2", "--n-embd", "48", "--n-head", "4",
                        "--head-dim", "16", "--n-layer", "3", "--local-window", "4",
                        "--attn-cap", "5", "--final-cap", "6", "--query-scalar", "20"],
             "qwen3": ["--arch", "qwen3", "--n-kv-head", "2", "--head-dim", "8"],
             "qwen3-moe": ["--arch", "qwen3", "--n-kv-head", "2", "--head-dim", "8",
                           "--experts", "4", "--top-k", "2", "--expert-hidden", "16",
                           "--n-layer", "2", "--sparse-step", "2"]}[kind]
    cfg = train.parse_config([*extra, "--steps", "3", "--dtype", "fp64", "--batch-size", "8",
                              "--save-dir", str(tmp / "ck"), "--out-dir", str(tmp / "o")])
    final = train.train(cfg, log=lambda *a: None)
    return kind, tmp, cfg, final


def test_rotary_families_sample_past_the_block_as_transformers_does(trained):
    """A checkpoint trained at 11 positions (the sort task) continues with its cache past
    them, token for token as transformers' generate on the export (rotary: no table ends)."""
    import torch
    transformers = pytest.importorskip("transformers")
    kind, tmp, cfg, _ = trained
    out = tmp / "hf-long"
    export(tmp / "ck", out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), experts_implementation="eager").eval().double()   # (grouped GEMMs: no fp64)
    theirs.generation_config.eos_token_id = None
    backend.set_default_float("float64")
    ours, _ = sample.load(str(tmp / "ck"))
    block = ours.config.block_size
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3][:block + 2]       # longer than the block
    x = torch.tensor([prompt])
    ref = theirs.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0,
                          max_new_tokens=3 * block, do_sample=False)[0].tolist()
    said = []
    assert sample.generate(ours, prompt, 3 * block, say=said.append) == ref
    assert not said                                       # (nothing cropped: nothing said)
    backend.set_default_float("float32")


def test_a_learned_position_table_crops_and_says_so_once():
    backend.set_default_float("float32")
    nn.manual_seed(0)
    model = nn.build("gpt", n_layer=1, n_head=2, n_embd=16, vocab_size=20, block_size=8).eval()
    said = []
    out = sample.generate(model, list(range(12)), 20, say=said.append)
    assert len(out) == 32 and len(said) == 2, said
    assert "prompt's 12 tokens are more than the model's 8 positions" in said[0]
    assert "each new token sees the last 7" in said[1]


def test_a_checkpoint_exports_to_a_folder_transformers_loads_as_its_family(trained):
    transformers = pytest.importorskip("transformers")
    kind, tmp, cfg, final = trained
    assert np.isfinite(final["test_loss"])
    out = tmp / "hf"
    config = export(tmp / "ck", out)
    want = {"llama3.1": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
            "gemma": ("gemma", "GemmaForCausalLM"),
            "gemma2": ("gemma2", "Gemma2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
            "qwen3-moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}[kind]
    assert config["model_type"] == want[0]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(theirs).__name__ == want[1]
    backend.set_default_float("float64")
    ours, _ = sample.load(str(tmp / "ck"))
    idx = np.array([[1, 2, 3, 0, 4, 5, 6, 7]])
    got, ref = assert_same_logits(ours, theirs, idx)
    again, _ = sample.load(str(out))                        # and back in from the folder
    assert again.config.arch == cfg.arch
    np.testing.assert_allclose(backend.to_numpy(again(backend.to_device(idx)).data), got,
                               atol=1e-5 * np.abs(ref).max(), rtol=0)
    backend.set_default_float("float32")


def test_a_folder_with_an_unknown_rotary_scaling_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 48, "num_attention_heads": 6,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 61,
        "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 8 + b"")
    for args in (["-m", "hpcdist.sample", str(tmp_path), "--ids", "1"],
                 ["-m", "hpcdist.train", "--init-from", str(tmp_path), "--steps", "1"]):
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "rotary scaling 'dynamic' is not one hpcdist computes" in lines[0], r.stderr


def test_help_lists_a_familys_settings_under_it():
    r = subprocess.run([sys.executable, "-m", "hpcdist.train", "--help"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    groups = r.stdout.split("\n\n")
    rotary = next(g for g in groups if g.startswith("model: llama, qwen2, qwen3, gemma, gemma2:"))
    for flag in ("--n-kv-head", "--head-dim", "--rope-theta", "--rope-type", "--ffn-hidden"):
        assert flag in rotary
    model = next(g for g in groups if g.startswith("model:\n"))
    assert "--n-kv-head" not in model and "--rope-theta" not in model
    assert "qwen2 1000000.0" in rotary                # each family's default where they differ
    gemma2 = next(g for g in groups if g.startswith("model: gemma2:"))
    for flag in ("--attn-cap", "--final-cap", "--query-scalar", "--local-window"):
        assert flag in gemma2


def test_every_family_is_registered_from_one_file():
    import inspect
    for arch, f in nn.FAMILIES.items():
        files = {inspect.getsourcefile(c) for c in (f.config, f.model, type(f.hf))}
        assert files == {inspect.getsourcefile(f.config)}, arch
        assert os.path.basename(files.pop()) == arch.replace("gpt", "gpt") + ".py", arch


# (n_kv_head and head_dim are AttentionShape's words, the declaration everything reads)
FAMILY_WORDS = r"\b(gpt2?|llama|mistral|mixtral|qwen2?|gemma|wte|wpe|embed_tokens|ln_f|" \
               r"lm_head|c_attn|ffn_hidden|rope_theta|norm_eps)\b"


def test_no_module_outside_nn_names_a_family():
    """run/, checkpoint/, plan/, parallel/, comm/, sample.py, train.py read declarations; the
    names below in code (not in comments or docstrings) are the families' alone."""
    import ast
    import re
    pkg = os.path.join(ROOT, "hpcdist")
    places = [os.path.join(pkg, d) for d in ("run", "checkpoint", "parallel", "comm", "plan")] + \
        [os.path.join(pkg, f) for f in ("sample.py", "train.py")]
    found = []
    for place in places:
        files = [place] if place.endswith(".py") else [
            os.path.join(d, n) for d, _, names in os.walk(place) for n in names
            if n.endswith(".py")]
        for path in files:
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                elif isinstance(node, ast.Attribute):
                    text = node.attr
                else:
                    continue
                if isinstance(node, ast.Constant) and len(text) > 40:
                    continue                 # (messages and docstrings: prose, not a branch)
                if re.search(FAMILY_WORDS, text, re.I):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {text!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("arch,kw", [
    ("gpt", {}), ("gpt", dict(bias=False, tie_weights=False)),
    ("gpt", dict(experts=4, shared_experts=1, moe_every=2, expert_hidden=40)),
    ("llama", dict(n_kv_head=2)), ("llama", dict(experts=4, tie_weights=True, bias=True)),
    ("qwen2", dict(n_kv_head=2)), ("qwen2", dict(tie_weights=True)),
    ("gemma", dict(head_dim=16, n_kv_head=1)),
    ("gemma2", dict(head_dim=16, n_kv_head=2, local_window=4)),
    ("qwen3", dict(n_kv_head=2, head_dim=8)),
    ("qwen3", dict(n_kv_head=2, experts=4, top_k=2, expert_hidden=16, sparse_step=2)),
    ("llama", dict(experts=3, shared_experts=2, expert_hidden=32, moe_every=2))])
def test_a_familys_parameter_count_is_its_models(arch, kw):
    m = nn.build(arch, n_layer=3, n_head=4, n_embd=32, vocab_size=50, block_size=16, **kw)
    assert m.config.parameters() == sum(p.data.size for p in m.parameters())


def test_a_gemma2_folders_layer_pattern_reaches_the_run_and_its_checkpoint(tmp_path):
    """config.json's layer_types (here full, sliding, sliding: not transformers' default
    alternation) is the run's --local-layers, so the training config, the checkpoint's meta
    and an export all keep it (a plain config field would be dropped on the way)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    kinds = ["full_attention", "sliding_attention", "sliding_attention"]
    cfg = transformers.Gemma2Config(**{**SHAPE, **KINDS["gemma2"][2], "layer_types": kinds})
    transformers.Gemma2ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    run = train.parse_config(["--init-from", str(tmp_path), "--steps", "1"])
    assert run.local_layers == "1,2"
    ours = nn.config_of(run)
    assert [ours.scores(i).window for i in range(3)] == [0, 8, 8]
    assert nn.family("gemma2").hf.config_json(ours)["layer_types"] == kinds
    with pytest.raises(ValueError, match="names a layer outside 0..2"):
        nn.family("gemma2").config(n_layer=3, local_layers="0,3").validate()
