"""Qwen2, Qwen3, Qwen3-MoE, Gemma and Llama 3.1's scaled rotary embeddings cut by every
dimension, each read through its declaration only (nn/qwen2.py, nn/qwen3.py, nn/gemma.py;
nn/llama.py's rotary kinds): in fp64 tensor parallelism with and without sequence
parallelism (q|k|v biases, Gemma's own head size and Qwen3's per-head norms split with the
heads, the norms' partial gradients summed because they are declared over the heads),
pipelines, ring and Ulysses context parallelism (scaled frequencies at global positions),
expert parallelism (Qwen3-MoE), ZeRO-3 and recompute follow the one-process run to 1e-10.
Gemma 2 (capped attention and final logits, a local window shorter than the block): all
but context parallelism, which refuses its kinds."""
import os

import numpy as np
import pytest

from helpers import history, one_process, small

DEVICE = os.environ.get("HPCDIST_DEVICE", "cpu")
FAMILIES = {
    "qwen2": dict(arch="qwen2", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=32,
                  rope_theta=500.0),
    "gemma": dict(arch="gemma", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6,
                  ffn_hidden=32, rope_theta=500.0),
    "qwen3": dict(arch="qwen3", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6,
                  ffn_hidden=32, rope_theta=500.0),
    "qwen3-moe": dict(arch="qwen3", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6,
                      ffn_hidden=32, rope_theta=500.0, experts=4, top_k=2, expert_hidden=8,
                      sparse_step=2),
    "gemma2": dict(arch="gemma2", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=6,
                   ffn_hidden=32, rope_theta=500.0, local_window=3, attn_cap=2.0,
                   final_cap=3.0, query_scalar=5.0),
    "llama3.1": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=32,
                     rope_theta=500.0, rope_type="llama3", rope_factor=4.0,
                     rope_original_context=4, tie_weights=True),
}


def _layouts(P, family):
    out = [dict(zero=3, checkpoint_activations=True)]
    if P % 2 == 0:
        out += [dict(tp=2, sequence_parallel=True), dict(tp=2), dict(pp=2), dict(cp=2),
                dict(cp=2, cp_impl="ulysses", zero=1)]
        if FAMILIES[family].get("experts"):
            out += [dict(ep=2)]
    if P % 3 == 0:
        out += [dict(tp=3, n_head=6, n_kv_head=3, n_embd=24, ffn_hidden=24)]
    if P % 4 == 0:
        out += [dict(tp=2, pp=2), dict(tp=2, cp=2)]
    if family == "gemma2":                  # (ring attention and Ulysses carry no cap or
        out = [kw for kw in out if "cp" not in kw]              # window yet: refused)
    if FAMILIES[family].get("experts"):     # (the balancing loss is the whole batch's: one
        out = [dict(kw, micro_batches=1) if "pp" in kw else kw for kw in out]  # micro-batch)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("index", range(10))
def test_every_layout_of_each_family_follows_one_process(comm, tmp_path, family, index):
    layouts = _layouts(comm.size, family)
    assert len(layouts) <= 10, "more layouts than test indices: raise the range"
    if index >= len(layouts):
        pytest.skip(f"{len(layouts)} layouts at {comm.size} ranks")
    kw = {**FAMILIES[family], **layouts[index]}
    replicas = comm.size // (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1))
    cfg = small(device=DEVICE, batch_size=4, grad_clip=1.0, out_dir=str(tmp_path), **kw)
    _, got = history(cfg, comm)
    _, want = one_process(cfg, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False,
                          cp_impl="ring", batch_size=4 * replicas,
                          out_dir=str(tmp_path / "one"))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=f"{family} {layouts[index]}")
