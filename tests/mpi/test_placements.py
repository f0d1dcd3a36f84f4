"""Placements are declared, and a wrong or missing declaration is refused when the model is
built (nn/placement.py, parallel/tp/probe.py): a per-head norm declared over the hidden
vector (the Qwen3 bug: its partial gradient was never summed under TP without SP), a norm
over the hidden vector declared over the heads (its whole gradient would be summed), and a
parameter no module declares. The right declarations pass the same probe."""
import pytest

from hpcdist import nn
from hpcdist.device import backend
from hpcdist.nn import placement
from hpcdist.nn.module import Module, Parameter
from hpcdist.parallel.tp import apply_tensor_parallel
from hpcdist.parallel.tp.probe import check_placements

SHAPE = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6, ffn_hidden=32,
             vocab_size=23, block_size=16)


@pytest.fixture
def tp_comm(comm):
    if comm.size < 2:
        pytest.skip("tensor parallelism needs 2 ranks")
    group = comm.split(color=comm.rank // 2, key=comm.rank)    # pairs (an odd rank alone)
    yield group if group.size == 2 else None
    group.close()


def _qwen3(**kw):
    backend.set_default_float("float64")
    nn.manual_seed(3)
    return nn.build("qwen3", **SHAPE, **kw)


def _cut(model, tp_comm, sp):
    apply_tensor_parallel(model, tp_comm, sp)
    return model


@pytest.mark.parametrize("sp", [False, True])
def test_the_declared_placements_pass_the_probe(tp_comm, sp):
    if tp_comm is None:
        pytest.skip("the odd rank out")
    model = _cut(_qwen3(experts=4, top_k=2, expert_hidden=8), tp_comm, sp)
    check_placements(model, tp_comm, sp)              # (raises where a declaration is wrong)
    kinds = {n: placement.placement(k, placement.Layout(tp=2, sequence_parallel=sp))["tp"]
             for n, k in ((n, model.declared_kinds()[id(p)])
                          for n, p in model.named_parameters())}
    assert kinds["blocks.0.attn.core.q_norm.weight"].partial           # sp or not
    assert kinds["blocks.0.attn_norm.weight"].partial == sp
    assert kinds["blocks.0.attn.qkv.weight"].sharded


def test_a_per_head_norm_declared_over_the_hidden_vector_is_refused(tp_comm):
    if tp_comm is None:
        pytest.skip("the odd rank out")
    model = _qwen3()
    for block in model.blocks:                  # the newcomer's mistake: the default kind
        block.attn.core.q_norm.placements = {"weight": placement.HIDDEN}
    _cut(model, tp_comm, False)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.core\.q_norm\.weight is declared "
                                         r"replicated with a whole gradient.*heads"):
        check_placements(model, tp_comm, False)
    for p in model.parameters():
        assert p.grad is None                   # the probe leaves no gradient behind


def test_a_norm_over_the_hidden_vector_declared_partial_is_refused(tp_comm):
    if tp_comm is None:
        pytest.skip("the odd rank out")
    model = _qwen3()
    model.blocks[1].mlp_norm.placements = {"weight": placement.HEADS}
    _cut(model, tp_comm, False)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp_norm\.weight is declared with a "
                                         r"gradient partial.*multiply"):
        check_placements(model, tp_comm, False)


class _Scale(Module):
    """A newcomer's module: a parameter and no declaration."""

    def __init__(self, n):
        self.gain = Parameter(backend.xp().ones(n))

    def forward(self, x):
        return x * self.gain


def test_a_parameter_nobody_declares_is_refused_when_the_model_is_built(comm):
    model = _qwen3()
    model.blocks[0].extra = _Scale(SHAPE["n_embd"])
    with pytest.raises(ValueError, match=r"parameter blocks\.0\.extra\.gain declares no "
                                         r"placement"):
        placement.check_declared(model)
    assert placement.undeclared(model) == ["blocks.0.extra.gain"]
    del model.blocks[0].extra
    placement.check_declared(model)
