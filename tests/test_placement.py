"""The placement rule without MPI (nn/placement.py): what a declared kind becomes on each
mesh axis for a layout, and the refusal of a parameter nobody declares."""
import pytest

from hpcdist import nn
from hpcdist.nn import placement as P
from hpcdist.nn.module import Shard as Cut


@pytest.mark.parametrize("kind,sp,want", [
    (P.HIDDEN, False, "replicate"), (P.HIDDEN, True, "partial"),
    (P.HEADS, False, "partial"), (P.HEADS, True, "partial"),
    (P.SHARDED, False, "shard"), (P.SHARDED, True, "shard")])
def test_a_kind_becomes_its_tensor_parallel_placement(kind, sp, want):
    where = P.placement(kind, P.Layout(tp=2, sequence_parallel=sp), Cut(1, 3, (4, 6)))
    assert where["tp"].kind == want
    assert where["tp"].dim == (1 if want == "shard" else None)
    alone = P.placement(kind, P.Layout(sequence_parallel=sp), Cut(1, 3, (4, 6)))
    assert alone["tp"].kind == ("shard" if kind == P.SHARDED else "replicate")


def test_the_other_axes_follow_the_layout():
    where = P.placement(P.HIDDEN, P.Layout(dp=2, cp=2, ep=2, pp=2))
    assert [where[a].kind for a in ("dp", "cp", "ep", "pp")] == ["partial"] * 3 + ["shard"]
    assert P.placement(P.HIDDEN, P.Layout(ep=2), expert=True)["ep"].sharded
    assert str(P.placement(P.HIDDEN, P.Layout())["tp"]) == "Replicate()"
    with pytest.raises(ValueError, match="unknown placement kind 'rows'"):
        P.placement("rows", P.Layout())


def test_every_family_declares_every_parameter():
    for arch in nn.FAMILIES:
        kw = dict(experts=4, expert_hidden=8) if arch != "gpt" else dict(experts=2)
        model = nn.build(arch, n_layer=2, n_head=4, n_embd=16, vocab_size=11, block_size=8,
                         **kw)
        assert P.undeclared(model) == [], arch
        placed = P.resolve(model, P.Layout(tp=2))
        assert len(placed) == len(model.parameters())
