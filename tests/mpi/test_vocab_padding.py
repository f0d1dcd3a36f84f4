"""The vocabulary padded to an aligned width (--vocab-multiple) in every layout: in fp64 the
per-step loss and gradient norm equal the unpadded 1-rank run's (the padding is out of the
loss, its gradient zero, its rows outside the norm), and a checkpoint holds the logical
(V, C) tensors only: written padded in one layout, it resumes unpadded in another and the
run goes on as the uninterrupted one."""
import numpy as np
import pytest

from hpcdist import checkpoint
from hpcdist.train import train

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi

GLOBAL = 120           # divisible by every data-parallel size used here (1-5, 8)
MODEL = dict(n_head=4, n_embd=16, n_layer=2, grad_clip=1.0)


def layouts(P):
    out = [dict(), dict(zero=3)]
    if P % 2 == 0:
        out += [dict(tp=2), dict(tp=2, sequence_parallel=True, zero=1), dict(pp=2),
                dict(tp=2, arch="llama", n_kv_head=2)]
    return out


def _cfg(layout, world, **kw):
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    return small(**{**MODEL, **layout, **kw}, batch_size=GLOBAL // dp)


@pytest.mark.parametrize("multiple", [8, 64])
def test_every_layout_padded_equals_the_unpadded_run(comm, shared_dir, multiple):
    for i, layout in enumerate(layouts(comm.size)):
        cfg = _cfg(layout, comm.size, vocab_multiple=multiple,
                   out_dir=f"{shared_dir}/p{multiple}_{i}")
        _, got = history(cfg, comm)
        _, want = one_process(cfg, vocab_multiple=1, tp=1, pp=1, zero=0,
                              sequence_parallel=False, batch_size=GLOBAL,
                              out_dir=f"{shared_dir}/p{multiple}_{i}_solo{comm.rank}")
        np.testing.assert_allclose(got, want, rtol=1e-10,
                                   err_msg=f"{layout} with --vocab-multiple {multiple} on "
                                           f"{comm.size} ranks")


def test_a_padded_checkpoint_holds_the_logical_tensors_and_resumes_unpadded(comm, shared_dir):
    layout = layouts(comm.size)[-1]
    folder = f"{shared_dir}/ck"
    first = _cfg(layout, comm.size, steps=2, vocab_multiple=64, save_dir=folder,
                 out_dir=folder + "_o")
    train(first, comm, log=lambda *a: None)
    reader = checkpoint.Reader(folder + "/step_00000002")
    table = "param/wte.weight" if layout.get("arch", "gpt") == "gpt" else \
        "param/embed_tokens.weight"
    V = reader.tensor(table).shape[0]
    assert V < 64 and reader.tensor(table).shape == (V, MODEL["n_embd"])
    for name in reader.tensors:                  # every tensor at its logical shape
        if name.endswith(("wte.weight", "embed_tokens.weight")):
            assert reader.tensor(name).shape == (V, MODEL["n_embd"]), name
        if name.endswith("lm_head.weight"):
            assert reader.tensor(name).shape == (MODEL["n_embd"], V), name
    # resumed without padding on plain data parallelism: steps 3-4 as the uninterrupted run
    again = _cfg({k: v for k, v in layout.items() if k in ("arch", "n_kv_head")},
                 comm.size, steps=4, vocab_multiple=1, save_dir=folder, resume=True,
                 out_dir=folder + "_r")
    _, got = history(again, comm)
    _, want = one_process(again, steps=4, resume=False, save_dir="", batch_size=GLOBAL,
                          out_dir=f"{folder}_solo{comm.rank}")
    np.testing.assert_allclose(got, want[2:], rtol=1e-10)


def test_another_padding_is_another_layout_for_each_ranks_own_state(comm, shared_dir):
    """Top-K's error-feedback residuals span the flat gradient, padding included: a checkpoint
    of a padded run resumed unpadded (same ranks, same layout otherwise) must not take them
    as its own (it resumes as another layout: the residuals start over, said)."""
    if comm.size < 2:
        pytest.skip("compression needs 2 or more replicas")
    folder = f"{shared_dir}/own"
    train(_cfg({}, comm.size, steps=2, compress="topk", vocab_multiple=64, save_dir=folder,
               out_dir=folder + "_o"), comm, log=lambda *a: None)
    lines = []
    final = train(_cfg({}, comm.size, steps=4, compress="topk", vocab_multiple=1,
                       save_dir=folder, resume=True, out_dir=folder + "_r"), comm,
                  log=lines.append)
    assert len(final["history"]) == 2 and np.isfinite(final["history"][-1]["loss"])
    if comm.rank == 0:                                   # (rank 0 says it)
        said = " ".join(map(str, lines))
        assert "'vocab_multiple': 64" in said and "Top-K residuals dropped" in said, said
