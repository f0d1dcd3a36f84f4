"""LoRA in every layout: the adapters after 3 steps in fp64 equal the one-process run's
(1e-10), read back from each run's checkpoint (a layout-free one: the adapters' tensor-
parallel cuts put together), for a Llama with grouped-query attention and every linear
adapted: tensor parallelism with and without sequence parallelism (the partial gradients of
A on column-parallel layers and B on row-parallel ones summed), pipeline stages, ZeRO-1 and
ZeRO-3 with recompute, context parallelism (ring and Ulysses), and experts under expert
parallelism; QLoRA's 4-bit base under PP and ZeRO-3 (the ranks quantise the same whole
tensors; under TP each rank quantises its shard, in blocks of its own: not compared). The
base is frozen: the checkpoint holds the adapters and their optimizer state only."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcdist import checkpoint

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi


def _cfg(save, **kw):
    base = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, length=8,
                steps=3, batch_size=4, lr=1e-2, min_lr=1e-2, lora_rank=2, lora_alpha=4.0,
                lora_targets="all-linear", save_dir=save, optimizer="adamw", grad_clip=1.0)
    base.update(kw)
    return small(**base)


def _adapters(save):
    reader = checkpoint.Reader(checkpoint.latest(save))
    return {n: reader.tensor(n) for n in sorted(reader.tensors)}


def _layouts(W):
    if W % 2 == 0:
        yield {"tp": 2}
        yield {"tp": 2, "sequence_parallel": True}
        yield {"pp": 2, "micro_batches": 2}
        yield {"zero": 3, "checkpoint_activations": True}
        yield {"cp": 2}
        yield {"cp": 2, "cp_impl": "ulysses"}
        yield {"experts": 4, "top_k": 2, "ep": 2, "lora_targets": "q,v,experts"}
        yield {"pp": 2, "micro_batches": 2, "base_dtype": "nf4"}   # (each stage: its blocks)
    if W >= 2:
        yield {"zero": 1}
        yield {"zero": 3, "base_dtype": "nf4"}     # QLoRA: the same 4-bit base on every rank
    yield {}


def _shared(tmp_path):
    path = MPI.COMM_WORLD.bcast(str(tmp_path) if MPI.COMM_WORLD.rank == 0 else None)
    return path


def test_every_layout_trains_the_adapters_of_one_process(comm, tmp_path):
    W = comm.size
    root = _shared(tmp_path)
    for i, layout in enumerate(_layouts(W)):
        replicas = W // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
        cfg = _cfg(f"{root}/run{i}", batch_size=4 * W // replicas if replicas else 4,
                   out_dir=f"{root}/out{i}-{comm.rank}", **layout)
        history(cfg, comm)
        comm.barrier()
        got = _adapters(cfg.save_dir)
        if comm.rank == 0:
            one_process(cfg, tp=1, pp=1, zero=0, cp=1, ep=1, micro_batches=0,
                        sequence_parallel=False, checkpoint_activations=False,
                        batch_size=4 * W, save_dir=f"{root}/ref{i}", out_dir=f"{root}/o{i}")
            ref = _adapters(f"{root}/ref{i}")
            assert sorted(got) == sorted(ref), layout
            assert all(".lora." in n for n in got), [n for n in got if ".lora." not in n]
            for n in ref:
                np.testing.assert_allclose(got[n], ref[n], rtol=1e-10, atol=1e-13,
                                           err_msg=f"{layout} {n}")
            assert any(np.abs(ref[n]).max() > 0 for n in ref if n.endswith("lora.B"))
        comm.barrier()
