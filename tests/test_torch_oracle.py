"""Forward values and gradients against PyTorch on the same inputs (skipped without torch)."""
import numpy as np
import pytest

import hpcdist as hd
from hpcdist import nn, optim
from hpcdist.autograd import ops

torch = pytest.importorskip("torch")
F = torch.nn.functional
R = np.random.default_rng(3)


def compare(f_hd, f_torch, *arrays, atol=1e-10, rtol=1e-8):
    """Run f on hd and torch tensors; compare outputs and input gradients (float64)."""
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    xs = [hd.tensor(a.copy(), requires_grad=True) for a in arrays]
    ts = [torch.tensor(a.copy(), requires_grad=True) for a in arrays]
    out, ref = f_hd(*xs), f_torch(*ts)
    np.testing.assert_allclose(out.data, ref.detach().numpy(), atol=atol, rtol=rtol)
    w = R.standard_normal(ref.shape)
    (out * hd.tensor(w)).sum().backward()
    (ref * torch.tensor(w)).sum().backward()
    for i, (x, t) in enumerate(zip(xs, ts)):
        np.testing.assert_allclose(x.grad, t.grad.numpy(), atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {i}")


def sym(*s):
    return R.standard_normal(s)


CASES = {
    "gelu_tanh": (lambda a: a.gelu(), lambda a: F.gelu(a, approximate="tanh"), [sym(4, 5)]),
    "sigmoid": (lambda a: a.sigmoid(), torch.sigmoid, [sym(4, 5) * 10]),
    "softmax": (lambda a: a.softmax(-1), lambda a: a.softmax(-1), [sym(3, 7) * 5]),
    "log_softmax": (lambda a: a.log_softmax(1), lambda a: a.log_softmax(1), [sym(3, 7, 2) * 5]),
    "batched_matmul_broadcast": (lambda a, b: a @ b, lambda a, b: a @ b, [sym(2, 1, 3, 4), sym(5, 4, 2)]),
    "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
                   lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5), [sym(2, 3, 6), sym(6), sym(6)]),
    "max_axis": (lambda a: a.max(axis=0), lambda a: a.amax(dim=0), [sym(5, 3)]),
    "mean_keepdims": (lambda a: a.mean(axis=(0, 2), keepdims=True),
                      lambda a: a.mean(dim=(0, 2), keepdim=True), [sym(2, 3, 4)]),
    "getitem_advanced": (lambda a: a[np.array([2, 0, 2]), 1:], lambda a: a[[2, 0, 2], 1:], [sym(3, 4)]),
    "concat_permute": (lambda a, b: ops.concat([a, b], axis=0).permute(1, 0, 2),
                       lambda a, b: torch.cat([a, b], 0).permute(1, 0, 2), [sym(2, 3, 2), sym(1, 3, 2)]),
    "masked_softmax": (lambda a: a.masked_fill(np.triu(np.ones((4, 4), bool), 1), -np.inf).softmax(-1),
                       lambda a: a.masked_fill(torch.triu(torch.ones(4, 4, dtype=torch.bool), 1), float("-inf")).softmax(-1),
                       [sym(2, 4, 4)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_torch(name):
    f_hd, f_torch, inputs = CASES[name]
    compare(f_hd, f_torch, *inputs)


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_matches_torch(ignore):
    logits = sym(2, 5, 11) * 4
    targets = R.integers(0, 11, size=(2, 5))
    if ignore:
        targets[0, :3] = -100
    compare(lambda z: ops.cross_entropy(z, targets),
            lambda z: F.cross_entropy(z.reshape(-1, 11), torch.tensor(targets.reshape(-1)),
                                      ignore_index=-100), logits)


def test_embedding_matches_torch():
    idx = R.integers(0, 6, size=(3, 4))
    compare(lambda w: ops.embedding(w, idx), lambda w: F.embedding(torch.tensor(idx), w), sym(6, 5))


def _torch_gpt_forward(sd, cfg, idx):
    """A PyTorch transcription of nn.GPT using our parameter layout (weights stored in x out)."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in sd.items()}
    B, T = idx.shape
    C, nh = cfg.n_embd, cfg.n_head
    x = p["wte.weight"][torch.tensor(idx)] + p["wpe.weight"][:T]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(cfg.n_layer):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (C,), p[b + "ln_1.weight"], p[b + "ln_1.bias"])
        qkv = h @ p[b + "attn.c_attn.weight"] + p[b + "attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (C // nh) ** 0.5
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[b + "attn.c_proj.weight"] + p[b + "attn.c_proj.bias"]
        h = F.layer_norm(x, (C,), p[b + "ln_2.weight"], p[b + "ln_2.bias"])
        h = F.gelu(h @ p[b + "mlp.layers.0.weight"] + p[b + "mlp.layers.0.bias"], approximate="tanh")
        x = x + h @ p[b + "mlp.layers.1.weight"] + p[b + "mlp.layers.1.bias"]
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["wte.weight"].T, p


def test_gpt_forward_and_backward_match_torch(float64):
    nn.manual_seed(1)
    cfg = nn.GPTConfig(block_size=8, vocab_size=13, n_layer=2, n_head=2, n_embd=16)
    model = nn.GPT(cfg)
    idx = R.integers(0, 13, size=(3, 8))
    targets = R.integers(0, 13, size=(3, 8))
    logits, loss = model(idx, targets)
    loss.backward()
    ref_logits, p = _torch_gpt_forward(model.state_dict(), cfg, idx)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, 13), torch.tensor(targets.reshape(-1)))
    ref_loss.backward()
    np.testing.assert_allclose(logits.data, ref_logits.detach().numpy(), rtol=1e-9, atol=1e-10)
    assert abs(float(loss.data) - ref_loss.item()) < 1e-10
    for name, param in model.named_parameters():
        np.testing.assert_allclose(param.grad, p[name].grad.numpy(), rtol=1e-7, atol=1e-10,
                                   err_msg=name)


def test_llama_forward_and_backward_match_torch(float64):
    """The Llama family (GQA 4 / 2, rotary, RMSNorm, SwiGLU, untied head) against its PyTorch
    transcription (bench.autograd.torch_llama): the loss and every parameter's gradient."""
    from hpcdist.bench.autograd import torch_llama
    nn.manual_seed(2)
    cfg = nn.LlamaConfig(block_size=9, vocab_size=13, n_layer=2, n_head=4, n_kv_head=2,
                         n_embd=16, ffn_hidden=24, rope_theta=100.0)
    model = nn.Llama(cfg)
    idx = R.integers(0, 13, size=(3, 9))
    targets = R.integers(0, 13, size=(3, 9))
    _, loss = model(hd.backend.to_device(idx), hd.backend.to_device(targets))
    loss.backward()
    sd = {k: hd.backend.to_numpy(v) for k, v in model.state_dict().items()}
    p, forward = torch_llama(cfg, sd, 3)
    ref = forward(torch.tensor(idx), torch.tensor(targets))
    ref.backward()
    assert abs(float(loss.data) - ref.item()) < 1e-10
    for name, param in model.named_parameters():
        np.testing.assert_allclose(hd.backend.to_numpy(param.grad), p[name].grad.numpy(),
                                   rtol=1e-7, atol=1e-10, err_msg=name)


def _run_optimizer(make_hd, make_torch, steps=5):
    w0 = R.standard_normal((4, 3))
    b0 = R.standard_normal(3)
    grads = [(R.standard_normal((4, 3)), R.standard_normal(3)) for _ in range(steps)]
    w, b = nn.Parameter(w0.copy()), nn.Parameter(b0.copy())
    tw, tb = torch.tensor(w0.copy(), requires_grad=True), torch.tensor(b0.copy(), requires_grad=True)
    opt, topt = make_hd([w, b]), make_torch([tw, tb])
    for k, (gw, gb) in enumerate(grads):
        opt.zero_grad()
        w.grad[...] = hd.backend.to_device(gw)
        b.grad[...] = hd.backend.to_device(gb)
        opt.step(lr=0.1 / (k + 1))
        for group in topt.param_groups:
            group["lr"] = 0.1 / (k + 1)
        tw.grad, tb.grad = torch.tensor(gw), torch.tensor(gb)
        topt.step()
    np.testing.assert_allclose(w.data, tw.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b.data, tb.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_adamw_matches_torch():
    # torch applies weight decay to every tensor it is given; ours decays matrices only, so the
    # torch side gets two groups: the matrix with decay, the bias without.
    _run_optimizer(lambda ps: optim.AdamW(ps, lr=0.1, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3),
                   lambda ps: torch.optim.AdamW([{"params": [ps[0]], "weight_decay": 0.3},
                                                 {"params": [ps[1]], "weight_decay": 0.0}],
                                                lr=0.1, betas=(0.8, 0.95), eps=1e-6))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(nesterov):
    _run_optimizer(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01),
                   lambda ps: torch.optim.SGD([{"params": [ps[0]], "weight_decay": 0.01},
                                               {"params": [ps[1]], "weight_decay": 0.0}],
                                              lr=0.1, momentum=0.9, nesterov=nesterov))


def test_sgd_dampening_matches_torch():
    _run_optimizer(lambda ps: optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3),
                   lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3))


def test_clip_grad_norm_matches_torch():
    g = R.standard_normal(50) * 3
    t = torch.tensor(g.copy(), requires_grad=True)
    t.grad = torch.tensor(g.copy())
    ref = torch.nn.utils.clip_grad_norm_([t], 1.5)
    ours = g.copy()
    norm = optim.clip_grad_norm(ours, 1.5)
    assert abs(norm - ref.item()) < 1e-12
    np.testing.assert_allclose(ours, t.grad.numpy(), rtol=1e-12)


def test_cosine_schedule_matches_torch_lambda():
    base, warm, total, floor = 0.5, 10, 100, 0.05
    ours = [optim.lr_at(s, base, warm, total, floor) for s in range(1, total + 1)]
    import math
    ref = [base * s / warm if s <= warm else
           floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * (s - warm) / (total - warm)))
           for s in range(1, total + 1)]
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    assert ours[warm - 1] == base and abs(ours[-1] - floor) < 1e-12
