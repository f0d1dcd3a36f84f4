"""Every documented training mode runs past its first steps (--precision fp16 once crashed at
its second step on any number of ranks, and no test ran it that far)."""
import numpy as np
import pytest

from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi

MODES = [(p, z, "none") for p in ("fp32", "fp16", "bf16", "fp8") for z in (0, 1, 2, 3)] + \
        [(p, 0, c) for p in ("fp32", "fp16", "bf16") for c in ("fp16", "topk")]


@pytest.mark.parametrize("precision, zero, compress", MODES)
def test_mode_trains_several_steps(comm, tmp_path, precision, zero, compress):
    if compress == "topk" and comm.size == 1:
        pytest.skip("topk compresses nothing on one rank (refused by the configuration)")
    cfg = small(precision=precision, zero=zero, compress=compress, dtype="fp32", steps=4,
                log_every=1, loss_scale=1024.0, out_dir=str(tmp_path))
    final = train(cfg, comm, log=lambda *a: None)
    assert final["event"] == "final" and final["steps"] == 4
    assert np.isfinite(final["train_loss"]) and np.isfinite(final["test_loss"])
    p = np.ascontiguousarray(final["params"], dtype=np.float32)
    everyone = np.empty((comm.size, p.size), np.float32)
    comm.mpi.Allgather(p, everyone)
    assert (everyone == everyone[0]).all(), "replicas differ after training"


@pytest.mark.parametrize("layout", [dict(tp=2, n_head=4), dict(pp=2, n_layer=2, batch_size=4),
                                    dict(tp=2, sequence_parallel=True, n_head=4)])
def test_fp8_trains_in_the_model_parallel_layouts(comm, tmp_path, layout):
    """--precision fp8 under tensor and pipeline parallelism: each rank scales the tensors it
    holds (a shard's own amax), the run trains, and the ranks that hold the same weights agree
    (the replicas' check above, per layout)."""
    size = layout.get("tp", 1) * layout.get("pp", 1)
    if comm.size % size:
        pytest.skip(f"{size} ranks per model replica")
    cfg = small(precision="fp8", dtype="fp32", steps=4, out_dir=str(tmp_path), **layout)
    final = train(cfg, comm, log=lambda *a: None)
    assert final["steps"] == 4 and np.isfinite(final["train_loss"]), final
    assert np.isfinite(final["test_loss"])


@pytest.mark.parametrize("layout", [{}, dict(tp=2), dict(pp=2, n_layer=2, micro_batches=1)],
                         ids=["dp", "tp", "pp"])
def test_fp8_on_codes_follows_its_emulation(comm, tmp_path, monkeypatch, layout):
    """On the GPU stand-in a linear layer whose dimensions are multiples of 16 computes on fp8
    codes (kernels/fp8_gemm.py: cuBLASLt's FP8 matmul, run there as its twin; a tensor-
    parallel shard's codes scaled by the group's amax): the losses and norms follow the same
    run on fp8's values (HPCDIST_FP8_GEMM=emulated), and the codes did run."""
    from helpers import history
    from hpcdist.device import backend
    from hpcdist.device.kernels import fp8_gemm
    size = layout.get("tp", 1) * layout.get("pp", 1)
    if comm.size % size:
        pytest.skip(f"{size} ranks per model replica")
    made, products = fp8_gemm.product, []
    monkeypatch.setattr(fp8_gemm, "product", lambda *a, **k: products.append(1) or made(*a, **k))
    prev, runs = backend.device_label(), []
    try:
        for how in ("codes", "emulated"):
            monkeypatch.setenv("HPCDIST_FP8_GEMM", how)
            runs.append(history(small(device="standin", precision="fp8", dtype="fp32", steps=4,
                                      batch_size=16, n_embd=32, n_head=4,
                                      out_dir=str(tmp_path / how), **layout), comm)[1])
            if how == "codes":
                assert products, "no GEMM took fp8 codes"
                products.clear()
    finally:
        backend.init(prev)
    assert not products
    np.testing.assert_allclose(runs[0], runs[1], rtol=2e-3)


@pytest.mark.parametrize("extra", [{}, dict(precision="bf16", grad_accum=2, batch_size=4)])
def test_cuda_graphs_over_several_replicas_equal_the_eager_run(comm, tmp_path, extra):
    """--cuda-graph on the GPU stand-in (which replays what it recorded): one rank replays
    the whole step; several replay each micro-batch's forward and backward and average the
    gradients over MPI after it. Either way the losses and norms are the eager run's."""
    from helpers import history
    from hpcdist.device import backend
    prev = backend.device_label()
    try:
        runs = [history(small(device="standin", dtype="fp32", steps=6, cuda_graph=graph,
                              out_dir=str(tmp_path / graph), **extra), comm)[1]
                for graph in ("off", "on")]
    finally:
        backend.init(prev)
    np.testing.assert_allclose(runs[1], runs[0], rtol=2e-2 if extra else 1e-5)


@pytest.mark.parametrize("extra", [{}, dict(precision="bf16", grad_accum=2, batch_size=4)])
def test_the_whole_step_over_nccl_is_one_graph_equal_to_the_eager_run(comm, tmp_path, extra):
    """--cuda-graph --backend nccl on the GPU stand-in: at any number of replicas the whole
    step is one graph, the buckets' NCCL allreduces captured on its stream (the stand-in's
    NCCL records them; a replay runs them again on the same memory); the losses and norms are
    the eager run's, and each replayed step counts the bytes its capture sent."""
    from hpcdist.device import backend
    from hpcdist.train import train
    prev = backend.device_label()
    runs, said = [], []
    try:
        for graph in ("off", "on"):
            lines = []
            final = train(small(device="standin", dtype="fp32", steps=6, cuda_graph=graph,
                                backend="nccl", out_dir=str(tmp_path / graph), **extra),
                          comm, log=lambda *a: lines.append(" ".join(map(str, a))))
            runs.append(final["history"])
            said.append("\n".join(lines))
    finally:
        backend.init(prev)
    if comm.rank == 0:                           # (rank 0 writes the run's log)
        assert "the whole step replayed as one CUDA graph" in said[1], said[1][:2000]
    # (fp32: the graph's AdamW reads its learning rate from the device schedule, the eager
    # run's from the host, one rounding apart from the first step on; training grows that to
    # ~1e-4 by the sixth step at some world sizes, where a bucket left out is ~1e-1)
    eager, graphed = ([[r["loss"], r["grad_norm"]] for r in run] for run in runs)
    np.testing.assert_allclose(graphed, eager, rtol=2e-2 if extra else 1e-3)
    sent = [[r["bytes_sent"] for r in run] for run in runs]
    assert sent[1] == sent[0] and (comm.size == 1 or min(sent[0]) > 0), sent
