"""Zeroing gradients by their next write (``zero_grad(lazy=True)``, the training loop's): the
same gradients as a pass of zeros, whatever backward reaches or not."""
import numpy as np
import pytest

from hpcdist import nn, optim
from hpcdist.autograd import ops
from hpcdist.autograd import lazy_zero


class Branchy(nn.Module):
    """Tied weights (``emb`` read twice), a linear + GELU, and ``extra`` used only when asked."""

    def __init__(self, V=37, C=24, H=40):
        super().__init__()
        self.emb = nn.Parameter(np.random.default_rng(1).standard_normal((V, C)) * 0.3)
        self.fc = nn.Linear(C, H)
        self.proj = nn.Linear(H, C)
        self.extra = nn.Parameter(np.random.default_rng(2).standard_normal((C, C)) * 0.3)

    def __call__(self, idx, tgt, use_extra):
        h = ops.embedding(self.emb, idx)
        h = h + self.proj(ops.linear_gelu(h, self.fc.weight, self.fc.bias))
        if use_extra:
            h = h @ self.extra
        logits = h @ ops.transpose(self.emb, (1, 0))
        return ops.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _run(lazy, steps, monkeypatch, min_size):
    from hpcdist.device.kernels import cpu
    monkeypatch.setattr(cpu, "MIN_SIZE", min_size)
    nn.manual_seed(0)
    model = Branchy()
    opt = optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(3)
    seen = []
    for step in range(steps):
        opt.zero_grad(lazy=lazy)
        for micro in range(2):                       # gradients accumulate over micro-batches
            idx = rng.integers(0, 37, (3, 5))
            model(idx, rng.integers(0, 37, (3, 5)), use_extra=(step == 0 and micro == 1)
                  ).backward()
        seen.append(opt.flat.grad.copy())
        opt.step()
    assert not any(lazy_zero.stale(p) for p in opt.flat.params)      # all written or zeroed
    return seen


@pytest.mark.parametrize("min_size", [0, 1 << 30])      # the CPU kernels (GEMM beta 0) / twins
def test_lazy_zero_grad_gives_the_gradients_of_a_zeroing_pass(float64, monkeypatch, min_size):
    eager = _run(False, 3, monkeypatch, min_size)
    lazy = _run(True, 3, monkeypatch, min_size)
    for a, b in zip(eager, lazy):
        np.testing.assert_array_equal(a, b)
    assert np.abs(eager[0]).sum() > 0
    # `extra` was used on step 0 only: its gradient after the later steps is zeros, not step 0's
    extra = slice(-24 * 24, None)      # the last parameter in the flat buffer
    assert np.abs(lazy[0][extra]).sum() > 0 and not lazy[1][extra].any()


def test_lazy_zero_then_step_without_backward_sees_zeros(float64):
    w = nn.Parameter(np.ones((3, 2)))
    opt = optim.SGD([w], lr=1.0, momentum=0.0)
    (w * w).sum().backward()
    opt.zero_grad(lazy=True)
    assert w.grad.any()              # the last step's values until backward or step ends
    opt.step()
    assert not w.grad.any() and np.array_equal(w.data, np.ones((3, 2)))


def test_an_unused_parameter_reads_zero_after_backward(float64):
    used, unused = nn.Parameter(np.ones(4)), nn.Parameter(np.ones(4))
    opt = optim.SGD([used, unused], lr=0.1)
    ((used * unused).sum()).backward()
    assert unused.grad.any()
    opt.zero_grad(lazy=True)
    (used * 2.0).sum().backward()
    np.testing.assert_array_equal(used.grad, np.full(4, 2.0))
    np.testing.assert_array_equal(unused.grad, np.zeros(4))


def test_zero_grad_is_a_pass_by_default(float64):
    w = nn.Parameter(np.ones(3))
    opt = optim.SGD([w], lr=0.1)
    (w * 3.0).sum().backward()
    opt.zero_grad()
    assert not w.grad.any() and not any(lazy_zero.stale(p) for p in opt.flat.params)
    w.grad[...] = 5.0                # a user's own gradient, then the step: kept
    opt.step()
    np.testing.assert_allclose(w.data, np.full(3, 0.5))


def test_a_zeroed_gradient_may_be_overwritten_only_where_its_zeroing_is_replayed():
    """``fresh``: a gradient the device's zero_grad zeroed may be written instead of added
    into (a GEMM's epilogue writes a bias's gradient) until anything writes it, until the
    backward ends, and never inside a CUDA graph capture that began after the zeroing (its
    replays, a later micro-batch's, would overwrite the earlier one's gradient)."""
    from hpcdist.device import graphs
    p = nn.Parameter(np.ones(3))
    p.grad = np.zeros(3)
    opt = optim.AdamW([p], lr=0.1)
    assert not lazy_zero.fresh(p)
    opt.zero_grad()                          # (a pass of zeros: then marked)
    assert lazy_zero.fresh(p)
    graphs._capturing.append(-1)             # a capture begins after the zeroing
    try:
        assert not lazy_zero.fresh(p)
        opt.zero_grad()                      # zeroed inside it: every replay zeroes it too
        assert lazy_zero.fresh(p)
    finally:
        graphs._capturing.pop()
    assert not lazy_zero.fresh(p)
    opt.zero_grad()
    lazy_zero.written(p)
    assert not lazy_zero.fresh(p)
    opt.zero_grad()
    lazy_zero.settle_grads()
    assert not lazy_zero.fresh(p) and not p.grad.any()
