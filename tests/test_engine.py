"""The backward engine: ordering, accumulation, hooks, graph freeing, no_grad, modules."""
import numpy as np
import pytest

import hpcdist as hd
from hpcdist import nn, optim


def test_deep_chain_needs_no_recursion(float64):
    x = hd.tensor(np.array([0.5]), requires_grad=True)
    y = x
    for _ in range(20000):          # far past Python's default recursion limit of 1000
        y = y * 1.0001
    y.sum().backward()
    assert abs(x.grad[0] - 1.0001 ** 20000) < 1e-6


def test_gradients_accumulate_across_backward_calls(float64):
    x = hd.tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * x).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * np.array([1.0, 2.0]) + 3)


def test_hook_fires_once_per_leaf_after_all_contributions(float64):
    w = nn.Parameter(np.array([1.0, -2.0]))
    seen = []
    w.register_grad_hook(lambda p: seen.append(p.grad.copy()))
    x = hd.tensor(np.array([3.0, 4.0]))
    loss = (w * x).sum() + (w * w).sum() + (w * x * w).sum()   # w used three times
    loss.backward()
    expected = x.data + 2 * w.data + 2 * x.data * w.data
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], expected)


def test_hooks_fire_last_layer_first():
    nn.manual_seed(0)
    model = nn.MLP([4, 5, 6, 3])
    order = []
    for name, p in model.named_parameters():
        p.register_grad_hook(lambda p, name=name: order.append(name))
    model(hd.tensor(np.ones((2, 4), np.float32))).sum().backward()
    assert order[0].startswith("layers.2") and order[-1].startswith("layers.0")
    assert sorted(order) == sorted(n for n, _ in model.named_parameters())


def test_hook_handle_removes():
    w = nn.Parameter(np.ones(2, np.float32))
    calls = []
    h = w.register_grad_hook(lambda p: calls.append(1))
    h.remove()
    (w * 2).sum().backward()
    assert calls == []


def test_graph_is_freed_unless_retained(float64):
    x = hd.tensor(np.array([2.0]), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad[0] == 8.0
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()


def test_no_grad_records_nothing(float64):
    x = hd.tensor(np.array([2.0]), requires_grad=True)
    with hd.no_grad():
        y = x * 3
    assert not y.requires_grad and y._parents == ()
    assert hd.is_grad_enabled()


def test_backward_needs_a_scalar_or_a_gradient(float64):
    x = hd.tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2).backward()
    (x * 2).backward(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(x.grad, [2.0, 4.0, 6.0])


def test_integer_tensors_cannot_require_grad():
    with pytest.raises(TypeError, match="floating"):
        hd.tensor(np.arange(3), requires_grad=True)


def test_float32_stays_float32_with_python_scalars():
    x = hd.tensor(np.ones(3, np.float32), requires_grad=True)
    y = (x * 2.5 + 1) / 3 - 0.5
    assert y.dtype == np.float32
    y.sum().backward()
    assert x.grad.dtype == np.float32


def test_tied_weights_appear_once_and_get_both_gradients(float64):
    nn.manual_seed(0)
    model = nn.GPT(nn.GPTConfig(block_size=4, vocab_size=5, n_layer=1, n_head=1, n_embd=4))
    names = [n for n, _ in model.named_parameters()]
    assert names.count("wte.weight") == 1 and len(names) == len(set(names))
    untied = nn.GPT(nn.GPTConfig(block_size=4, vocab_size=5, n_layer=1, n_head=1, n_embd=4,
                                 tie_weights=False))
    assert untied.num_parameters() == model.num_parameters() + 4 * 5


def test_state_dict_round_trip_keeps_flat_views(float64):
    nn.manual_seed(0)
    a = nn.MLP([3, 4, 2])
    opt = optim.SGD(a.parameters(), lr=0.1)
    sd = {k: v + 1.0 for k, v in a.state_dict().items()}
    a.load_state_dict(sd)
    for (name, p), off in zip(a.named_parameters(), opt.flat.offsets):
        np.testing.assert_array_equal(p.data, sd[name])
        np.testing.assert_array_equal(opt.flat.data[off:off + p.size], sd[name].ravel())
    with pytest.raises(KeyError, match="missing"):
        a.load_state_dict({})
    bad = dict(sd)
    bad["layers.0.weight"] = np.zeros((9, 9))
    with pytest.raises(ValueError, match="shape"):
        a.load_state_dict(bad)


def test_flat_params_decay_ranges_cover_matrices_only():
    nn.manual_seed(0)
    m = nn.MLP([3, 4, 2])
    flat = optim.FlatParams(m.parameters())
    # layout: w0 (12), b0 (4), w1 (8), b1 (2)
    assert flat.decay_ranges == [(0, 12), (16, 24)]
    assert optim.decay_ranges_in(flat.decay_ranges, 10, 20) == [(0, 2), (6, 10)]


def test_train_eval_mode_switches_dropout():
    nn.manual_seed(0)
    m = nn.MLP([4, 4], dropout=0.5)
    x = hd.tensor(np.ones((8, 4), np.float32))
    m.eval()
    a, b = m(x).data, m(x).data
    np.testing.assert_array_equal(a, b)
    m.train()
    assert not np.array_equal(m(x).data, m(x).data)


def test_path_without_gradient_still_releases_shared_leaf(float64):
    from hpcdist.autograd.tensor import Tensor
    w = nn.Parameter(np.array([1.0, 2.0]))
    blocked = Tensor._make((w * 2).data, (w * 2,), lambda g: (None,))   # passes no gradient on
    loss = (blocked * 1.0).sum() + (w * 5.0).sum()
    loss.backward()
    np.testing.assert_allclose(w.grad, [5.0, 5.0])


def test_backward_on_a_leaf(float64):
    w = nn.Parameter(np.array([1.0, 2.0]))
    w.backward(np.array([3.0, 4.0]))
    np.testing.assert_allclose(w.grad, [3.0, 4.0])


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_norm_adds_its_inputs_other_gradient_in_its_own_pass(monkeypatch, norm, dtype):
    """x feeds a norm and, as the residual stream does, another op whose backward runs first:
    the norm's backward takes x's gradient so far (``adds_first``) and adds it into its own,
    so the engine sums nothing for x; x's gradient equals the two paths' sum taken apart.
    bf16 on the CPU normalises in float32, so the norm adds it after its kernel there."""
    from hpcdist.autograd import ops, tensor
    from hpcdist.device import backend
    dt = np.float64 if dtype == "float64" else backend.bfloat16()
    rng = np.random.default_rng(5)
    x0, w0, a, b = (rng.standard_normal(s) for s in ((3, 4, 16), (16,), (3, 4, 16), (3, 4, 16)))
    sums = []
    engine_sum = tensor.summed
    monkeypatch.setattr(tensor, "summed", lambda p, q: sums.append(1) or engine_sum(p, q))

    def grads(together):
        x = hd.tensor(x0.astype(dt), requires_grad=True)
        w = hd.tensor(w0.astype(dt), requires_grad=True)
        normed = ops.layer_norm(x, w, None) if norm == "layer_norm" else ops.rms_norm(x, w)
        if together:        # the other path's op is made last: its backward runs first
            (normed * hd.tensor(a.astype(dt)) + x * hd.tensor(b.astype(dt))).sum().backward()
            return x.grad.astype(np.float64)
        (normed * hd.tensor(a.astype(dt))).sum().backward()
        apart = x.grad.astype(np.float64)
        x.grad = None
        (x * hd.tensor(b.astype(dt))).sum().backward()
        return apart + x.grad.astype(np.float64)
    both = grads(True)
    assert sums == [] or dtype == "bfloat16"
    np.testing.assert_allclose(both, grads(False), rtol=1e-12 if dtype == "float64" else 2e-2,
                               atol=0 if dtype == "float64" else 2e-2)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_a_projection_and_the_norm_after_it_in_one_pass_equal_them_apart(kind, device):
    """``linear_norm`` (the residual stream after a projection and its norm, the bias, the
    residual and the norm in one kernel after the GEMM) equals ``linear`` then the norm:
    both outputs and every gradient; on the GPU stand-in it is one launch fewer."""
    from hpcdist.autograd import ops
    from hpcdist.device import backend, standin
    prev = backend.device_label()
    backend.init(device)
    try:
        rng = np.random.default_rng(9)
        arrays = [rng.standard_normal(s) for s in ((2, 5, 24), (24, 16), (16,), (2, 5, 16),
                                                    (16,), (16,), (2, 5, 16), (2, 5, 16))]
        results = []
        for together in (False, True):
            x, w, b, r, nw, nb = (hd.tensor(backend.to_device(a), requires_grad=True)
                                  for a in arrays[:6])
            norm = (lambda t, fuse=None: ops.layer_norm(t, nw, nb, 1e-5, fuse=fuse)) \
                if kind == "layer" else (lambda t, fuse=None: ops.rms_norm(t, nw, 1e-6, fuse=fuse))
            standin.LAUNCHES.count = 0
            if together:
                y, h = ops.linear_norm(x, w, b, r, norm)
            else:
                y = ops.linear(x, w, b, r)
                h = norm(y)
            launches = standin.LAUNCHES.count
            (y * hd.tensor(backend.to_device(arrays[6])) +
             h * hd.tensor(backend.to_device(arrays[7]))).sum().backward()
            results.append(([backend.to_numpy(t.data) for t in (y, h)] +
                            [backend.to_numpy(t.grad) for t in (x, w, b, r, nw)
                             + ((nb,) if kind == "layer" else ())], launches))
        (apart, n_apart), (together, n_together) = results
        for a, t in zip(apart, together):
            np.testing.assert_allclose(t, a, rtol=1e-12, atol=1e-12)
        if device == "standin":
            assert n_together == n_apart - 1, (n_apart, n_together)
    finally:
        backend.init(prev)
