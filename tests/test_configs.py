"""Every TOML file of configs/ runs as its comment says (shortened to a few steps, on one
rank), and --model fills a published size: its family, and parameters as published."""
import glob
import os
import subprocess
import sys

import pytest

from hpcdist import nn, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


def test_there_are_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_each_config_runs(path, tmp_path):
    extra = []
    if 'task = "text"' in open(path).read():
        corpus = tmp_path / "c.txt"              # (the data a user passes with --data)
        corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
        extra = ["--data", str(corpus), "--block-size", "64"]
    r = subprocess.run([sys.executable, "-m", "hpcdist.train", "--config", path, "--steps", "3",
                        "--log-every", "1", "--batch-size", "8", "--out-dir", str(tmp_path / "o"),
                        *extra], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    cfg = train.parse_config(["--config", path, *extra])
    assert r.stdout.startswith(f"hpcdist | {nn.family(cfg.arch).title} "), r.stdout[:200]
    assert "step     3/3" in r.stdout


# the published parameter counts (their model cards), with the published vocabularies
PUBLISHED = {"gpt2": (50257, 124.4e6), "gpt2-xl": (50257, 1557.6e6),
             "llama3-8b": (128256, 8.03e9), "llama3.2-1b": (128256, 1.236e9),
             "mistral-7b": (32000, 7.24e9), "mixtral-8x7b": (32000, 46.7e9),
             "qwen2.5-0.5b": (151936, 0.494e9), "qwen2.5-7b": (152064, 7.62e9),
             "gemma-2b": (256000, 2.506e9), "gemma-7b": (256000, 8.538e9)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_model_fills_a_published_size(name):
    vocab, params = PUBLISHED[name]
    cfg = train.parse_config(["--model", name, "--task", "sort"])
    arch, shape = nn.size(name)
    assert cfg.arch == arch and all(getattr(cfg, k) == v for k, v in shape.items())
    declared = nn.config_of(cfg, vocab_size=vocab, vocab_multiple=1)
    assert abs(declared.parameters() / params - 1) < 0.005, declared.parameters()


def test_a_flag_given_beside_model_wins_and_a_bad_name_is_one_line():
    cfg = train.parse_config(["--model", "qwen2.5-0.5b", "--n-layer", "2"])
    assert cfg.arch == "qwen2" and cfg.n_layer == 2 and cfg.n_embd == 896
    with pytest.raises(train.ConfigError, match="unknown --model 'gpt5': one of gpt2, "):
        train.parse_config(["--model", "gpt5"])
    with pytest.raises(train.ConfigError, match="is a gemma model, not --arch llama"):
        train.parse_config(["--model", "gemma-2b", "--arch", "llama"])
