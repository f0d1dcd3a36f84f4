"""An export can replace the folder it started from (issue 91, part 2): a transformers folder
through ``--init-from`` with no change (``--lr 1e-30``: below every ulp) and back out by ``export --format
safetensors`` has the source's config.json, generation_config.json, tokenizer_config.json
and chat template, its tensors' dtype and bytes; a sliding-window model keeps its context;
``--dtype`` chooses another; a model trained from scratch takes its ids from its tokenizer."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_edges import ROOT, corpus, py

pytest.importorskip("transformers")


def _folder(tmp_path, family, dtype):
    text = corpus(tmp_path / "corpus.txt", lines=400)
    src = tmp_path / f"{family}-{dtype}"
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tiny_hf.py"), family,
                    str(src), text, dtype], check=True, capture_output=True, timeout=300)
    rc, _, err = py("-m", "hpcdist.data", "prepare", text, "--tokenizer", str(src), "--out",
                    str(tmp_path / f"tok-{family}"))
    assert rc == 0, err
    return src, tmp_path / f"tok-{family}"


def _header(path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}


def _tensor_bytes(path) -> dict:
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    head = _header(path)
    return {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in head.items()}


def _json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("family,dtype", [("qwen2", "bfloat16"), ("mistral", "float32")])
def test_an_unchanged_model_exports_as_its_source(tmp_path, family, dtype):
    src, tok = _folder(tmp_path, family, dtype)
    save = tmp_path / "ck"
    rc, _, err = py("-m", "hpcdist.train", "--init-from", str(src), "--data", str(tok),
                    "--steps", "1", "--lr", "1e-30", "--min-lr", "0", "--batch-size", "2", "--block-size", "16",
                    "--save-dir", str(save), "--out-dir", str(tmp_path / "o"), timeout=300)
    assert rc == 0, err
    out = tmp_path / "hf"
    rc, said, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(out), "--format",
                       "safetensors")
    assert rc == 0 and f"({dtype})" in said, err
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert _json(out / name) == _json(src / name), name
    if (src / "chat_template.jinja").exists():
        assert (out / "chat_template.jinja").read_text() == \
            (src / "chat_template.jinja").read_text()
    ours, theirs = _header(out / "model.safetensors"), _header(src / "model.safetensors")
    assert {k: v["dtype"] for k, v in ours.items()} == \
        {k: v["dtype"] for k, v in theirs.items() if k in ours}
    assert set(theirs) - set(ours) <= {"lm_head.weight"}       # (a tied head: the table)
    a, b = _tensor_bytes(out / "model.safetensors"), _tensor_bytes(src / "model.safetensors")
    zero = {k for k in b if not any(b[k])}           # (a zero bias moves by 1e-30: no ulp)
    assert all(a[k] == b[k] for k in a if k not in zero), [k for k in a if a[k] != b[k]][:3]
    assert zero <= set(a)
    cfg = _json(out / "config.json")
    assert cfg["max_position_embeddings"] == 256            # (trained at a block of 16)
    import transformers                              # it loads and generates as the source
    m = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    s = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    import torch
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(m.generate(ids, max_new_tokens=40, do_sample=False),
                       s.generate(ids, max_new_tokens=40, do_sample=False))
    rc, said, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(tmp_path / "h16"),
                       "--format", "safetensors", "--dtype", "fp16")
    assert rc == 0 and "(float16)" in said, err
    assert {v["dtype"] for v in _header(tmp_path / "h16" / "model.safetensors").values()} \
        == {"F16"}
    assert "float16" in (_json(tmp_path / "h16" / "config.json").get("dtype"),
                         _json(tmp_path / "h16" / "config.json").get("torch_dtype"))
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(tmp_path / "x.npz"),
                    "--dtype", "bf16")
    assert rc == 2 and "--dtype is for --format safetensors" in err


def test_a_model_trained_from_scratch_takes_its_ids_from_its_tokenizer(tmp_path):
    text = corpus(tmp_path / "corpus.txt", lines=400)
    rc, _, err = py("-m", "hpcdist.data", "prepare", text, "--vocab-size", "300", "--out",
                    str(tmp_path / "tok"))
    assert rc == 0, err
    save = tmp_path / "ck"
    rc, _, err = py("-m", "hpcdist.train", "--data", str(tmp_path / "tok"), "--steps", "1",
                    "--batch-size", "2", "--block-size", "16", "--n-layer", "1", "--save-dir",
                    str(save), "--out-dir", str(tmp_path / "o"))
    assert rc == 0, err
    rc, _, err = py("-m", "hpcdist.checkpoint", "export", str(save), str(tmp_path / "hf"),
                    "--format", "safetensors", "--dtype", "bf16")
    assert rc == 0, err
    cfg = _json(tmp_path / "hf" / "config.json")
    gen = _json(tmp_path / "hf" / "generation_config.json")
    assert cfg["eos_token_id"] == gen["eos_token_id"] == 0    # <|endoftext|>, prepare's first
    assert cfg["torch_dtype"] == "bfloat16"
    import torch
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert m.dtype == torch.bfloat16
    from hpcdist.checkpoint import Reader
    from hpcdist.checkpoint.tools import choose
    reader = Reader(choose(str(save)))
    wte = reader.tensor("param/wte.weight")
    got = m.transformer.wte.weight.detach().float().numpy()
    assert np.abs(got - wte).max() <= np.abs(wte).max() * 2 ** -8   # bf16's rounding


def test_a_fine_tune_resumes_from_its_save_folder_alone(tmp_path):
    """A Gemma run from a folder, resumed with --resume --save-dir (and its data) only: the
    family, the shape and --init-from come from the checkpoint (issue 91, part 3)."""
    src, tok = _folder(tmp_path, "gemma", "float32")
    save, out = str(tmp_path / "ck"), str(tmp_path / "o")
    rc, _, err = py("-m", "hpcdist.train", "--init-from", str(src), "--data", str(tok),
                    "--steps", "1", "--batch-size", "2", "--block-size", "16", "--save-dir",
                    save, "--out-dir", out, timeout=300)
    assert rc == 0, err
    rc, said, err = py("-m", "hpcdist.train", "--resume", "--save-dir", save, "--data",
                       str(tok), "--steps", "2", "--batch-size", "2", "--out-dir", out,
                       timeout=300)
    assert rc == 0, err
    assert f"--arch gemma, --init-from {src}, its shape" in said and "Gemma" in said, \
        said[:600]
