"""Sampling on several ranks: the tensor-parallel model with its KV caches draws exactly the
tokens the whole model draws on one rank (at every world size: 120 heads split any way)."""
import pytest

from hpcdist import nn, sample
from hpcdist.parallel.tp import apply_tensor_parallel

pytestmark = pytest.mark.mpi


def model(cfg):
    """A GPT whose greedy path wanders (GPT-2's 0.02 init repeats one token): weights x 30."""
    nn.manual_seed(4)
    m = nn.GPT(cfg)
    for p in m.parameters():
        p.data *= 30
    return m


@pytest.mark.parametrize("prompt", [[3], [7, 1, 4, 1, 5]])
def test_tensor_parallel_sampling_equals_the_whole_model(comm, prompt):
    cfg = nn.GPTConfig(block_size=24, vocab_size=53, n_layer=2, n_head=120, n_embd=120)
    whole = model(cfg).eval()
    ref = sample.generate(whole, prompt, 30)                # past the context: 24 < 35
    split = apply_tensor_parallel(model(cfg), comm).eval()
    assert sample.generate(split, prompt, 30) == ref
    drawn = sample.generate(split, prompt, 10, temperature=1.0, top_k=5, seed=9)
    assert drawn == sample.generate(whole, prompt, 10, temperature=1.0, top_k=5, seed=9)
    assert len(set(ref)) > 3
