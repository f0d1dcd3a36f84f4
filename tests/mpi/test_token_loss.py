"""The token-level loss: a step's loss and gradient are the sum over the global batch's
trained tokens divided by their count, whatever the split. On document rows whose trained
tokens differ row to row, in fp64: W ranks x 1 micro-batch, 1 rank x W micro-batches and one
batch of W times the rows take the same steps (1e-10), in every layout (TP, PP, ZeRO-1/3,
recompute, micro-batches), packed rows and padded ones. (A packed row = its documents one by
one: tests/test_packing.py.)"""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.data import documents

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi

VOCAB, ROWS = 64, 2          # rows per rank


def _shards(folder):
    """Documents of 3..40 tokens, each training a random share (none to all) of them."""
    rng = np.random.default_rng(5)
    for prefix, n in (("train", 96), ("val", 8)):
        w = documents.DocumentWriter(str(folder), prefix, 10 ** 6, 0, VOCAB)
        for _ in range(n):
            size = int(rng.integers(3, 41))
            w.add(rng.integers(0, VOCAB, size), rng.random(size) < rng.random())
        w.flush()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") if MPI.COMM_WORLD.rank == 0 else None
    path = MPI.COMM_WORLD.bcast(str(path) if path else None)
    if MPI.COMM_WORLD.rank == 0:
        _shards(path)
    MPI.COMM_WORLD.Barrier()
    return path


def _cfg(folder, tmp_path, **kw):
    return small(task="text", data=folder, vocab_size=VOCAB, block_size=32, n_layer=2,
                 n_embd=16, n_head=2, steps=3, grad_clip=1.0, out_dir=str(tmp_path), **kw)


def _layouts(W):
    yield {}
    if W % 2 == 0:
        yield {"tp": 2}
        yield {"pp": 2, "micro_batches": 2}
        yield {"zero": 3, "checkpoint_activations": True}
    if W >= 2:
        yield {"grad_accum": 2}
        yield {"zero": 1}


@pytest.mark.parametrize("packing", ["bfd", "off"])
def test_the_loss_is_per_trained_token_of_the_global_batch(comm, folder, tmp_path, packing):
    """Packed rows (several documents a row, each attending to itself) and padded ones."""
    W = comm.size
    for layout in _layouts(W):
        layout = {**layout, "packing": packing}
        model = W // (layout.get("tp", 1) * layout.get("pp", 1))     # replicas
        accum = layout.get("grad_accum", 1)
        cfg = _cfg(folder, tmp_path / "-".join(map(str, layout)), batch_size=ROWS * W // model,
                   **layout)
        final, got = history(cfg, comm)
        G = ROWS * W * accum                         # rows per step
        for ref_kw in ({"batch_size": G, "grad_accum": 1},
                       {"batch_size": ROWS, "grad_accum": G // ROWS}):
            ref_final, ref = one_process(cfg, tp=1, pp=1, zero=0, micro_batches=1, **ref_kw)
            np.testing.assert_allclose(got, ref, rtol=1e-10, err_msg=f"{layout} {ref_kw}")
            if "tp" not in layout and "pp" not in layout:   # (those hold a part of them)
                np.testing.assert_allclose(final["params"], ref_final["params"], rtol=1e-9,
                                           atol=1e-12, err_msg=f"{layout} {ref_kw}")


def test_a_mean_of_micro_batch_means_would_differ(comm, folder, tmp_path):
    """The check has teeth: these rows' trained counts differ, so the old mean of means
    (each micro-batch weighed alike) takes other steps than the token-level loss."""
    if comm.rank:
        return
    from hpcdist import data
    cfg = _cfg(folder, tmp_path)
    train, _ = data.datasets_of(cfg)
    counts = [int((train.batch(np.arange(i, i + ROWS))[1] != -100).sum())
              for i in range(0, 16, ROWS)]
    assert len(set(counts)) > 2, counts
