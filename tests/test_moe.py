"""The MoE layer in one process against its oracles: a loop over tokens (forward), finite
differences (backward, through the router and the experts), the Switch loss's defining
values, Megatron's capacity formula, the bias update, and one-line errors for bad settings."""
import math

import numpy as np
import pytest

from hpcdist import nn
from hpcdist.autograd.tensor import Tensor
from hpcdist.device import backend
from hpcdist.nn.moe import MoE, after_step


@pytest.fixture(autouse=True)
def fp64():
    backend.set_default_float("float64")
    yield
    backend.set_default_float("float32")


def _gelu(h):
    return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


def _mlp(mod, v):
    h = _gelu(v @ mod.layers[0].weight.data + mod.layers[0].bias.data)
    return h @ mod.layers[1].weight.data + mod.layers[1].bias.data


def _reference(m, x2, score, k):
    """Token by token: its k experts, gated, plus the shared ones."""
    logits = x2 @ m.router.weight.data
    if score == "softmax":
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    else:
        p = 1 / (1 + np.exp(-logits))
    out = np.zeros_like(x2)
    for n in range(len(x2)):
        chosen = np.argsort(-(p[n] + (m.expert_bias if score == "sigmoid" else 0)),
                            kind="stable")[:k]
        g = p[n, chosen]
        if k > 1 or score == "sigmoid":
            g = g / g.sum()
        for e, w in zip(chosen, g):
            out[n] += w * _mlp(m.experts[e], x2[n])
        for s in m.shared:
            out[n] += _mlp(s, x2[n])
    return out


@pytest.mark.parametrize("score,k,shared", [("softmax", 1, 0), ("softmax", 2, 1),
                                            ("sigmoid", 2, 0), ("sigmoid", 3, 1)])
def test_forward_and_backward_against_a_token_loop_and_finite_differences(score, k, shared):
    nn.manual_seed(3)
    m = MoE(8, 16, 5, top_k=k, score=score, shared=shared, aux_loss_coef=0.0,
            balance="bias" if score == "sigmoid" else "aux")
    m.expert_bias[:] = [0.0, 0.05, -0.05, 0.1, 0.0]        # steers the sigmoid router only
    rng = np.random.default_rng(1)
    x = Tensor(rng.normal(size=(2, 5, 8)), requires_grad=True)
    y = m(x)
    np.testing.assert_allclose(y.data.reshape(-1, 8), _reference(m, x.data.reshape(-1, 8),
                                                                  score, k), atol=1e-14)
    w = rng.normal(size=y.shape)
    (y * Tensor(w)).sum().backward()
    eps = 1e-6
    for t, grad in ((x, x.grad), (m.router.weight, m.router.weight.grad),
                    (m.experts[1].layers[0].weight, m.experts[1].layers[0].weight.grad)):
        got = grad.copy()
        num = np.zeros_like(t.data)
        for i in range(0, t.data.size, max(1, t.data.size // 40)):
            old = t.data.flat[i]
            t.data.flat[i] = old + eps
            a = float((m(Tensor(x.data)).data * w).sum())
            t.data.flat[i] = old - eps
            b = float((m(Tensor(x.data)).data * w).sum())
            t.data.flat[i] = old
            num.flat[i] = (a - b) / (2 * eps)
            assert abs(num.flat[i] - got.flat[i]) < 1e-8, (score, k, i)


def test_the_switch_loss_is_one_under_balanced_routing_and_e_when_collapsed():
    m = MoE(4, 8, 4, top_k=1)
    xp = np
    uniform = Tensor(xp.full((8, 4), 0.25))
    assert abs(float(m.aux_loss(uniform, np.full(4, 2.0)).data) - 1.0) < 1e-15
    collapsed = Tensor(xp.eye(4)[[0] * 8])
    assert abs(float(m.aux_loss(collapsed, np.array([8.0, 0, 0, 0])).data) - 4.0) < 1e-15


def test_the_auxiliary_loss_gradient_is_coef_times_its_own():
    """The gradient injected at the layer equals the gradient of coef x aux added to a loss."""
    nn.manual_seed(5)
    m = MoE(6, 8, 4, top_k=2, aux_loss_coef=0.3, z_loss_coef=0.02)
    x = Tensor(np.random.default_rng(0).normal(size=(7, 6)), requires_grad=True)
    m(x).sum().backward()
    got = m.router.weight.grad.copy()
    m.router.weight.grad = None
    m.aux_coef = m.z_coef = 0.0
    out = m(x).sum()
    logits, probs, chosen = m.route(x)
    counts = np.bincount(chosen.reshape(-1), minlength=4).astype(float)
    z = nn.moe.ops.log(nn.moe.ops.exp(logits).sum(axis=-1))
    (out + m.aux_loss(probs, counts) * 0.3 + (z * z).mean() * 0.02).backward()
    np.testing.assert_allclose(got, m.router.weight.grad, rtol=1e-12)


def test_capacity_is_megatrons_and_drops_the_latest_tokens():
    m = MoE(4, 8, 4, top_k=2, capacity_factor=1.25)
    assert m.capacity(100) == math.ceil(100 * 2 * 1.25 / 4) == 63
    assert MoE(4, 8, 4, top_k=2).capacity(100) == 200          # dropless: everything
    nn.manual_seed(0)
    m = MoE(4, 8, 2, top_k=1, capacity_factor=0.5, aux_loss_coef=0.0)
    m.router.weight.data[...] = 0.0                            # every token to expert 0
    x = Tensor(np.random.default_rng(2).normal(size=(1, 8, 4)))
    y = m(x).data.reshape(8, 4)
    keep = m.capacity(8)                                       # 2 of the 8
    assert keep == 2 and m.dropped == 6
    ref = 0.5 * np.array([_mlp(m.experts[0], v) for v in x.data.reshape(8, 4)])   # gate 1/2
    np.testing.assert_allclose(y[:keep], ref[:keep], atol=1e-14)
    assert not y[keep:].any()                                  # dropped: nothing added


def test_the_balancing_bias_moves_against_the_load():
    m = MoE(4, 8, 4, top_k=1, score="sigmoid", balance="bias", bias_rate=0.01)
    m.load[:] = [5, 1, 1, 1]
    model = nn.Sequential(m) if hasattr(nn, "Sequential") else m
    out = after_step(model, applied=True)
    np.testing.assert_allclose(m.expert_bias, [-0.01, 0.01, 0.01, 0.01])
    assert out["moe_load"] == 2.5 and out["moe_dropped"] == 0 and not m.load.any()
    m.load[:] = [5, 1, 1, 1]
    after_step(model, applied=False)                           # a skipped step moves nothing
    np.testing.assert_allclose(m.expert_bias, [-0.01, 0.01, 0.01, 0.01])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--top-k 5 must be between 1 and the 4 experts"):
        MoE(4, 8, 4, top_k=5)
    with pytest.raises(ValueError, match="unknown router score"):
        MoE(4, 8, 4, score="relu")


def test_an_moe_checkpoint_samples_and_refuses_the_gpt2_export(tmp_path):
    """Trained with the sigmoid router's bias, saved, sampled back (the model rebuilt from
    the checkpoint, biases included); the GPT-2 export names why it refuses."""
    import json
    import subprocess
    import sys
    run = dict(capture_output=True, text=True, timeout=600)
    py = [sys.executable, "-m"]
    r = subprocess.run(py + ["hpcdist.train", "--experts", "4", "--router", "sigmoid",
                             "--balance", "bias", "--steps", "20", "--save-dir",
                             str(tmp_path / "ck"), "--out-dir", str(tmp_path)], **run)
    assert r.returncode == 0, r.stderr
    manifest = json.load(open(next((tmp_path / "ck").glob("*/manifest.json"))))
    assert manifest["meta"]["experts"] == 4 and any(any(b) for b in
                                                    manifest["scalars"]["moe_bias"])
    r = subprocess.run(py + ["hpcdist.sample", str(tmp_path / "ck"), "--ids", "3,1,2",
                             "--tokens", "4", "--temperature", "0"], **run)
    assert r.returncode == 0 and r.stdout.strip().startswith("3,1,2,"), r.stderr
    r = subprocess.run(py + ["hpcdist.checkpoint", "export", str(tmp_path / "ck"),
                             str(tmp_path / "hf"), "--format", "safetensors"], **run)
    assert r.returncode != 0 and "has no GPT-2 form" in r.stderr
