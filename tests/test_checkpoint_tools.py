"""python -m hpcdist.checkpoint: inspect, verify, export — the export checked against PyTorch."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdist import checkpoint, train
from hpcdist.nn.gpt import nanogpt_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*args):
    return subprocess.run([sys.executable, "-m", "hpcdist.checkpoint", *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ck")
    cfg = train.parse_config(["--steps", "3", "--save-dir", str(tmp / "ck"), "--out-dir",
                              str(tmp / "o"), "--dtype", "fp64", "--batch-size", "8",
                              "--tie-weights" if request.param else "--no-tie-weights"])
    final = train.train(cfg, log=lambda *a: None)
    return tmp, cfg, final


def test_inspect_and_verify(run):
    tmp, _, _ = run
    r = tool("inspect", str(tmp / "ck"))
    assert r.returncode == 0, r.stderr
    assert "step 3, written by 1 ranks" in r.stdout and "param/wte.weight" in r.stdout
    assert "verified" in r.stdout
    r = tool("verify", str(tmp / "ck"))
    assert r.returncode == 0 and "verified" in r.stdout
    path = tmp / "ck" / "step_00000003" / "rank_00000.npz"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    try:
        r = tool("verify", str(tmp / "ck" / "step_00000003"))
        assert r.returncode == 1 and "rank_00000.npz: checksum mismatch" in r.stderr
    finally:
        raw[100] ^= 1
        path.write_bytes(bytes(raw))


def test_export_loads_with_numpy_and_runs_in_pytorch_as_nanogpt(run):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    tmp, cfg, final = run
    out = tmp / "model.npz"
    r = tool("export", str(tmp / "ck"), str(out), "--names", "nanogpt")
    assert r.returncode == 0, r.stderr
    sd = {k: torch.tensor(v) for k, v in np.load(out).items()}    # NumPy alone reads it
    # nanoGPT's forward, written out: Linear weights are (out, in)
    idx = np.random.default_rng(0).integers(0, 10, size=(3, 11))
    B, T = idx.shape
    C, nh = cfg.n_embd, cfg.n_head
    x = sd["transformer.wte.weight"][torch.tensor(idx)] + sd["transformer.wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)

    def ln(x, p):
        return F.layer_norm(x, (C,), sd[p + ".weight"], sd[p + ".bias"], 1e-5)
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        q, k, v = F.linear(ln(x, h + "ln_1"), sd[h + "attn.c_attn.weight"],
                           sd[h + "attn.c_attn.bias"]).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (C // nh) ** 0.5
        y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, sd[h + "attn.c_proj.weight"], sd[h + "attn.c_proj.bias"])
        m = F.gelu(F.linear(ln(x, h + "ln_2"), sd[h + "mlp.c_fc.weight"], sd[h + "mlp.c_fc.bias"]),
                   approximate="tanh")
        x = x + F.linear(m, sd[h + "mlp.c_proj.weight"], sd[h + "mlp.c_proj.bias"])
    logits_torch = F.linear(ln(x, "transformer.ln_f"), sd["lm_head.weight"]).numpy()
    # ours, from the same checkpoint
    from hpcdist import nn
    model = nn.GPT(nn.GPTConfig(vocab_size=10, block_size=11, n_layer=cfg.n_layer,
                                n_head=nh, n_embd=C, tie_weights=cfg.tie_weights))
    reader = checkpoint.Reader(checkpoint.find_resume(str(tmp / "ck"))[0])
    model.load_state_dict({n: reader.tensor(f"param/{n}") for n, _ in model.named_parameters()})
    model.eval()
    np.testing.assert_allclose(model(idx).data, logits_torch, rtol=1e-10, atol=1e-12)


def test_nanogpt_names_cover_the_model():
    from hpcdist import nn
    model = nn.GPT(nn.GPTConfig(vocab_size=5, block_size=4, n_layer=2, n_head=2, n_embd=8))
    names = nanogpt_names({n: p.data for n, p in model.named_parameters()})
    assert names["transformer.h.1.mlp.c_fc.weight"].shape == (32, 8)
    assert names["lm_head.weight"] is names["transformer.wte.weight"]      # tied


def test_export_safetensors_loads_in_transformers_as_gpt2(run):
    """``export --format safetensors``: read back by the safetensors library (where installed)
    and run by transformers' GPT2LMHeadModel, whose logits match ours on the same tokens."""
    tmp, cfg, _ = run
    out = tmp / "hf"
    r = tool("export", str(tmp / "ck"), str(out), "--format", "safetensors")
    assert r.returncode == 0, r.stderr
    from hpcdist import nn
    model = nn.GPT(nn.GPTConfig(vocab_size=10, block_size=11, n_layer=cfg.n_layer,
                                n_head=cfg.n_head, n_embd=cfg.n_embd,
                                tie_weights=cfg.tie_weights))
    reader = checkpoint.Reader(checkpoint.find_resume(str(tmp / "ck"))[0])
    model.load_state_dict({n: reader.tensor(f"param/{n}") for n, _ in model.named_parameters()})
    model.eval()
    # the file by hand: header length, JSON header, data — the format's definition
    raw = (out / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = __import__("json").loads(raw[8:8 + n])
    a, b = header["transformer.h.0.mlp.c_fc.weight"]["data_offsets"]
    c_fc = np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4").reshape(cfg.n_embd, 4 * cfg.n_embd)
    np.testing.assert_array_equal(c_fc, model.blocks[0].mlp.layers[0].weight.data.astype(np.float32))
    assert ("lm_head.weight" in header) != cfg.tie_weights
    st = pytest.importorskip("safetensors.numpy")
    loaded = st.load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(loaded["transformer.wpe.weight"],
                                  model.wpe.weight.data.astype(np.float32))
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    idx = np.random.default_rng(1).integers(0, 10, size=(2, 11))
    with torch.no_grad():
        theirs = hf(torch.tensor(idx)).logits.numpy()
    np.testing.assert_allclose(theirs, model(idx).data, rtol=1e-4, atol=1e-4)
