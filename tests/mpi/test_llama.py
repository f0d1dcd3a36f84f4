"""The Llama family cut by every dimension (nn/llama.py read through its declaration): in fp64
each layout — tensor parallelism with grouped-query heads split, sequence parallelism,
pipelines, ring and Ulysses context parallelism (rotary embeddings at global positions),
ZeRO-3, recompute, Mixtral's experts over EP — follows the one-process run to 1e-10; a GQA
that cannot split is refused in one line."""
import os

import numpy as np
import pytest

from hpcdist.device.backend import gpu_count
from hpcdist.run.config import ConfigError
from hpcdist.run.settings import CHOICES
from hpcdist import nn

from helpers import history, one_process, small

DEVICE = os.environ.get("HPCDIST_DEVICE", "cpu")
LLAMA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=32,
             rope_theta=500.0)


def _layouts(P):
    out = [dict(), dict(zero=3), dict(checkpoint_activations=True, zero=1)]
    if P % 2 == 0:
        out += [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(tp=2, n_kv_head=1, tp_ok=0),
                dict(pp=2), dict(pp=2, tie_weights=True), dict(cp=2),
                dict(cp=2, cp_impl="ulysses"), dict(ep=2, experts=4), dict(tp=2, zero=3)]
    if P % 3 == 0:
        out += [dict(tp=3, n_head=6, n_kv_head=3, n_embd=24, ffn_hidden=24), dict(cp=3, zero=2)]
    if P % 4 == 0:
        out += [dict(tp=2, cp=2), dict(tp=2, pp=2, n_layer=2), dict(pp=2, cp=2, cp_impl="ulysses"),
                dict(tp=2, ep=2, experts=4)]
    if P % 8 == 0:
        out += [dict(tp=2, pp=2, cp=2, sequence_parallel=True)]
    return out


@pytest.mark.parametrize("backend_name", ["mpi", "nccl"])
@pytest.mark.parametrize("index", range(20))
def test_every_llama_layout_follows_one_process(comm, tmp_path, index, backend_name):
    """... over MPI, and over NCCL where each rank has a device array (the NCCL stand-in
    where no GPU is; a GPU each on a GPU machine)."""
    layouts = _layouts(comm.size)
    assert len(layouts) <= 20, "more layouts than test indices: raise the range"
    if index >= len(layouts):
        pytest.skip(f"{len(layouts)} layouts at {comm.size} ranks")
    if backend_name == "nccl" and (DEVICE == "cpu" or (
            DEVICE == "gpu" and gpu_count() < comm.size)):
        pytest.skip("NCCL needs a device array per rank: --device standin, or a GPU per rank")
    kw = {**LLAMA, **layouts[index], "backend": backend_name}
    if kw.pop("tp_ok", 1) == 0:                       # MQA over TP 2: refused in one line
        with pytest.raises(ConfigError, match="must divide n_kv_head"):
            small(device=DEVICE, out_dir=str(tmp_path), **kw)
            from hpcdist.run.config import validate
            validate(small(device=DEVICE, out_dir=str(tmp_path), **kw))
        return
    replicas = comm.size // (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1))
    cfg = small(device=DEVICE, batch_size=4, grad_clip=1.0, out_dir=str(tmp_path), **kw)
    _, got = history(cfg, comm)
    _, want = one_process(cfg, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False,
                          cp_impl="ring", batch_size=4 * replicas, backend="mpi",
                          out_dir=str(tmp_path / "one"))
    np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=str(layouts[index]))


def test_the_families_the_settings_offer_are_the_registered_ones():
    assert set(CHOICES["arch"]) == set(nn.FAMILIES)
