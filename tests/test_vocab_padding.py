"""The vocabulary padded to an aligned width (``vocab_multiple``; train's --vocab-multiple,
64 on a GPU): the padding changes no value — in fp64 the loss and every logical gradient equal
the unpadded model's —, is never in the loss nor sampled (even where its weights are made
huge), gets a zero gradient, and is absent from state dicts, checkpoints and the parameter
count. The layouts (TP, PP, ZeRO-3) and checkpoints across paddings: tests/mpi/
test_vocab_padding.py."""
import numpy as np
import pytest

from hpcdist import nn
from hpcdist.device import backend
from hpcdist.sample import generate

V = 50


def _model(arch, tie, multiple, seed=0):
    nn.manual_seed(seed)
    return nn.build(arch, vocab_size=V, vocab_multiple=multiple, n_layer=2, n_head=2,
                    n_embd=32, block_size=16, tie_weights=tie)


def _batch():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, V, (3, 16)), rng.integers(0, V, (3, 16))
    y[0, :3] = -100
    return backend.xp().asarray(x), backend.xp().asarray(y)


CASES = [("gpt", True), ("gpt", False), ("llama", False), ("llama", True)]


@pytest.mark.parametrize("arch,tie", CASES)
def test_padding_changes_no_value(arch, tie, float64):
    x, y = _batch()
    runs = {}
    for m in (1, 64):
        model = _model(arch, tie, m)
        logits, loss = model(x, y)
        loss.backward()
        runs[m] = (model, float(loss.data))
    (plain, l1), (padded, l64) = runs[1], runs[64]
    assert l64 == pytest.approx(l1, rel=1e-13)
    assert padded.num_parameters() > plain.num_parameters()
    assert padded.logical_parameters() == plain.num_parameters()
    want = plain.state_dict()
    got = padded.state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)   # same init draws
    grads = {n: backend.to_numpy(p.grad) for n, p in plain.named_parameters()}
    for name, p in padded.named_parameters():
        g = backend.to_numpy(p.grad)
        logical = tuple(slice(0, n) for n in grads[name].shape)
        np.testing.assert_allclose(g[logical], grads[name], rtol=1e-11, atol=1e-15,
                                   err_msg=name)
        rest = g.copy()
        rest[logical] = 0
        assert not rest.any(), f"{name}: the padding got a gradient"
        data = backend.to_numpy(p.data).copy()
        data[logical] = 0
        assert not data.any(), f"{name}: the padding is not zero"


@pytest.mark.parametrize("arch,tie", CASES)
def test_padding_is_never_in_the_loss_nor_sampled(arch, tie, float64):
    """The padding's weights made huge: the loss and the greedy continuation are the unpadded
    model's, and the logits outside training are the vocabulary's alone."""
    x, y = _batch()
    plain, padded = _model(arch, tie, 1), _model(arch, tie, 64)
    for part in ("tokens", "head"):
        mod = padded.part(part)
        if mod is None:
            continue
        w = mod.weight.data
        if part == "tokens":
            w[V:] = 100.0
        else:
            w[:, V:] = 100.0
    assert float(padded(x, y)[1].data) == pytest.approx(float(plain(x, y)[1].data), rel=1e-13)
    plain.eval(), padded.eval()
    assert padded(x).shape == (3, 16, V)
    assert padded(x, y)[0].shape == (3, 16, V)
    prompt = [1, 2, 3]
    assert generate(padded, prompt, 12) == generate(plain, prompt, 12)
    drawn = generate(padded, prompt, 40, temperature=1.5, seed=3)
    assert max(drawn) < V


def test_a_logical_state_dict_loads_into_a_padded_model(float64):
    plain = _model("llama", False, 1)
    padded = _model("llama", False, 64, seed=5)
    padded.load_state_dict(plain.state_dict())
    for name, value in plain.state_dict().items():
        np.testing.assert_array_equal(padded.state_dict()[name], value)
    table = backend.to_numpy(padded.part("tokens").weight.data)
    assert table.shape == (64, 32) and not table[V:].any()


def test_the_vocab_multiple_is_validated():
    with pytest.raises(ValueError, match="vocab_multiple"):
        nn.build("gpt", vocab_size=V, vocab_multiple=0)
