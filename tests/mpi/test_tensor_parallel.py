"""Tensor parallelism against its oracles: MPI's built-ins for each mapping (forward and the
dual collective in backward), the dense loss for the vocab-parallel one, and — in fp64 — the
1-rank run's per-step loss and gradient norm for every layout."""
import numpy as np
import pytest

import hpcdist as hd
from hpcdist.device import backend
from hpcdist.comm.mesh import ProcessMesh
from hpcdist.parallel import tp
from hpcdist.parallel.tp.layers import column_pieces
from hpcdist.train import train

from helpers import history, one_process, small

pytestmark = pytest.mark.mpi

# 12 heads of 2: n_head, n_embd and 4 x n_embd divide by 2, 3 and 4; vocabulary 4 pads to 6
# under tp 3; sequence length 7 splits unevenly along the sequence for every tp.
TP_MODEL = dict(n_head=12, n_embd=24, n_layer=2)


def _tp_sizes(world):
    return [t for t in (2, 3, 4) if world % t == 0]


def _reference(cfg, replicas):
    """The same run on one rank with the global batch (every rank computes it)."""
    return one_process(cfg, tp=1, zero=0, sequence_parallel=False,
                       batch_size=cfg.batch_size * replicas)[1]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tie", [True, False])
def test_tp_follows_the_one_rank_run(comm, tmp_path, sp, tie):
    sizes = _tp_sizes(comm.size)
    if not sizes:
        pytest.skip(f"no tensor-parallel size in 2, 3, 4 divides {comm.size} ranks")
    for t in sizes:
        cfg = small(**TP_MODEL, tp=t, sequence_parallel=sp, tie_weights=tie, grad_clip=1.0,
                    out_dir=str(tmp_path / f"tp{t}"))
        final, got = history(cfg, comm)
        ref = _reference(cfg, comm.size // t)
        np.testing.assert_allclose(got, ref, rtol=1e-10, err_msg=f"tp {t} sp {sp} tie {tie}")


def test_tp_with_every_zero_level_follows_the_one_rank_run(comm, tmp_path):
    sizes = _tp_sizes(comm.size)
    if not sizes:
        pytest.skip(f"no tensor-parallel size in 2, 3, 4 divides {comm.size} ranks")
    for t in sizes:
        for zero in (1, 2, 3):
            cfg = small(**TP_MODEL, tp=t, zero=zero, sequence_parallel=True, grad_clip=1.0,
                        out_dir=str(tmp_path / f"z{zero}tp{t}"))
            final, got = history(cfg, comm)
            np.testing.assert_allclose(got, _reference(cfg, comm.size // t), rtol=1e-10,
                                       err_msg=f"tp {t} zero {zero}")


def test_data_parallel_replicas_hold_identical_shards(comm, tmp_path):
    if comm.size < 4 or comm.size % 2:
        pytest.skip("needs DP x TP with both at least 2")
    cfg = small(**TP_MODEL, tp=2, sequence_parallel=True, dtype="fp32", dropout=0.1,
                out_dir=str(tmp_path))
    p = np.ascontiguousarray(train(cfg, comm, log=lambda *a: None)["params"])
    mesh = ProcessMesh(comm, dp=comm.size // 2, tp=2)
    everyone = np.empty((mesh.dp, p.size), p.dtype)
    mesh.dp_comm.mpi.Allgather(p, everyone)
    assert (everyone == everyone[0]).all()
    mesh.close()


# ---- each mapping: forward against MPI, backward against its dual collective -------------

def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def _run_mapping(fn, x, g):
    t = hd.tensor(x.copy(), requires_grad=True)
    out = fn(t)
    (out * hd.tensor(g)).sum().backward()
    return backend.to_numpy(out.data), backend.to_numpy(t.grad)


def test_mappings_forward_and_backward(comm):
    P, r, mpi = comm.size, comm.rank, comm.mpi
    B, T, c = 2, 7, 3
    x = _random((B, T, c), r)                                   # differs per rank
    allsum = np.empty_like(x)
    mpi.Allreduce(x, allsum)
    # copy: forward identity, backward allreduce
    g = _random(x.shape, 100 + r)
    gsum = np.empty_like(g)
    mpi.Allreduce(g, gsum)
    out, dx = _run_mapping(lambda t: tp.copy_to_tp(t, comm), x, g)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_allclose(dx, gsum, rtol=1e-13)
    # reduce: forward allreduce, backward identity
    out, dx = _run_mapping(lambda t: tp.reduce_from_tp(t, comm), x, g)
    np.testing.assert_allclose(out, allsum, rtol=1e-13)
    np.testing.assert_array_equal(dx, g)
    # gather along the last axis: forward allgather, backward this rank's slice
    parts = np.empty((P,) + x.shape)
    mpi.Allgather(x, parts)
    gathered = np.concatenate(list(parts), axis=-1)
    g2 = _random(gathered.shape, 7)                              # the same on every rank
    out, dx = _run_mapping(lambda t: tp.gather_from_tp(t, comm), x, g2)
    np.testing.assert_array_equal(out, gathered)
    np.testing.assert_array_equal(dx, g2[..., r * c:(r + 1) * c])
    # scatter: forward this rank's slice, backward allgather
    full = _random((B, T, c * P), 8)
    gs = _random((B, T, c), 200 + r)
    gparts = np.empty((P, B, T, c))
    mpi.Allgather(gs, gparts)
    out, dx = _run_mapping(lambda t: tp.scatter_to_tp(t, comm), full, gs)
    np.testing.assert_array_equal(out, full[..., r * c:(r + 1) * c])
    np.testing.assert_array_equal(dx, np.concatenate(list(gparts), axis=-1))
    # sequence parallelism: reduce-scatter along the sequence <-> allgather along it
    lo, hi = tp.sequence_bounds(T, P, r)
    grows = _random((B, hi - lo, c), 300 + r)
    counts = [(b - a) * B * c for a, b in (tp.sequence_bounds(T, P, q) for q in range(P))]
    flat = np.empty(sum(counts))
    mpi.Allgatherv(grows.transpose(1, 0, 2).copy().reshape(-1), [flat, counts])
    gfull = flat.reshape(T, B, c).transpose(1, 0, 2)
    out, dx = _run_mapping(lambda t: tp.reduce_scatter_to_sp(t, comm), x, grows)
    np.testing.assert_allclose(out, allsum[:, lo:hi], rtol=1e-13)
    np.testing.assert_array_equal(dx, gfull)
    xrows = np.ascontiguousarray(x[:, lo:hi])
    flat = np.empty(sum(counts))
    mpi.Allgatherv(xrows.transpose(1, 0, 2).copy().reshape(-1), [flat, counts])
    out, dx = _run_mapping(lambda t: tp.gather_from_sp(t, T, comm), xrows, g)
    np.testing.assert_array_equal(out, flat.reshape(T, B, c).transpose(1, 0, 2))
    np.testing.assert_allclose(dx, gsum[:, lo:hi], rtol=1e-13)


def test_vocab_parallel_cross_entropy_matches_the_dense_loss(comm, float64):
    P, r = comm.size, comm.rank
    V = 5 * P + (P > 1)                              # not a multiple of P: padded columns
    Vp = tp.padded_vocab(V, P)
    per = Vp // P
    logits = _random((3, 4, V), 1)                   # the same full logits on every rank
    targets = np.random.default_rng(2).integers(0, V, size=(3, 4))
    targets[0, :2] = -100                            # ignored positions
    full = hd.tensor(logits.copy(), requires_grad=True)
    ref = hd.ops.cross_entropy(full, targets)
    ref.backward()
    padded = np.zeros((3, 4, Vp))
    padded[..., :V] = logits
    padded[..., V:] = 1e3                            # padding must never count, whatever it holds
    local = hd.tensor(padded[..., r * per:(r + 1) * per].copy(), requires_grad=True)
    loss = tp.vocab_parallel_cross_entropy(local, targets, comm, r * per, V)
    loss.backward()
    np.testing.assert_allclose(float(loss.data), float(ref.data), rtol=1e-13)
    want = np.zeros((3, 4, Vp))
    want[..., :V] = full.grad
    np.testing.assert_allclose(local.grad, want[..., r * per:(r + 1) * per], rtol=1e-12,
                               atol=1e-15)


def test_shards_are_slices_of_the_one_model(comm):
    from hpcdist import nn
    if comm.size == 1 or 12 % comm.size:
        pytest.skip("needs a tensor-parallel size dividing 12 heads")
    backend.set_default_float("float64")
    try:
        nn.manual_seed(3)
        full = nn.GPT(nn.GPTConfig(vocab_size=7, block_size=8, **TP_MODEL))
        ref = {n: backend.to_numpy(p.data).copy() for n, p in full.named_parameters()}
        model = tp.apply_tensor_parallel(full, comm)
        C = TP_MODEL["n_embd"]
        for name, p, spec in model.named_specs():
            if spec is None:
                np.testing.assert_array_equal(p.data, ref[name], err_msg=name)
                continue
            axis, pieces, shape = spec.axis, spec.pieces, spec.shape
            assert shape == ref[name].shape, name
            whole = ref[name]
            if name == "wte.weight":
                whole = np.concatenate([whole, np.zeros((tp.padded_vocab(7, comm.size) - 7, C))])
            gathered = np.empty((comm.size,) + p.shape)
            comm.mpi.Allgather(np.ascontiguousarray(backend.to_numpy(p.data)), gathered)
            blocks = [np.split(g, pieces, axis=axis) for g in gathered]   # per rank, per piece
            rebuilt = np.concatenate([np.concatenate([b[j] for b in blocks], axis=axis)
                                      for j in range(pieces)], axis=axis)
            np.testing.assert_array_equal(rebuilt, whole, err_msg=name)
    finally:
        backend.set_default_float("float32")


def _fp8_layer_run(layer, x, g):
    """(output, input gradient, weight gradient, bias gradient) of ``layer`` on ``x`` with
    output gradient ``g``, under --precision fp8's quantization."""
    t = hd.tensor(x.copy(), requires_grad=True)
    out = layer(t)
    (out * hd.tensor(g)).sum().backward()
    bias = None if layer.bias is None else backend.to_numpy(layer.bias.grad)
    return (backend.to_numpy(out.data), backend.to_numpy(t.grad),
            backend.to_numpy(layer.weight.grad), bias)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_an_fp8_shard_is_scaled_by_the_whole_tensors_amax(comm, kind):
    """--precision fp8 under tensor parallelism: a sharded operand (a column-parallel layer's
    weight and output gradient, a row-parallel layer's input and weight) is scaled by the
    whole tensor's amax, so the layer's output and gradients equal the one-rank layer's
    (fp64 storage: fp8's codes exact, the sums in another order); scaled by each shard's own
    amax, they do not (the shards' magnitudes differ by orders)."""
    from hpcdist.device import fp8
    from hpcdist.nn.layers import Linear
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(11)                       # the same tensors on every rank
    k, m = 4 * n, 6 * n
    x = rng.standard_normal((5, k)) * 10.0 ** np.linspace(-1.5, 1.5, k)
    w = rng.standard_normal((k, m)) * 10.0 ** np.add.outer(np.linspace(-1, 1, k),
                                                             np.linspace(-2, 2, m))
    b = rng.standard_normal(m)
    g = rng.standard_normal((5, m)) * 10.0 ** np.linspace(-2, 2, m)
    dense = Linear(k, m)
    dense.weight.data, dense.bias.data = backend.to_device(w), backend.to_device(b)  # (fp64)
    fp8.set_linears(True)
    try:
        want = _fp8_layer_run(dense, x, g)
        if kind == "column":
            layer = tp.ColumnParallelLinear(backend.to_device(w), backend.to_device(b), comm)
            lo, hi = column_pieces(m, 1, r, n)[0]
            mine = (want[0][:, lo:hi], want[1], want[2][:, lo:hi], want[3][lo:hi])
            args = (x, g[:, lo:hi])
        else:
            layer = tp.RowParallelLinear(backend.to_device(w), backend.to_device(b), comm)
            lo, hi = column_pieces(k, 1, r, n)[0]
            mine = (want[0], want[1][:, lo:hi], want[2][lo:hi], want[3])
            args = (x[:, lo:hi], g)
        got = _fp8_layer_run(layer, *args)
        for name, a, e in zip(("output", "input gradient", "weight gradient",
                               "bias gradient"), got, mine):
            np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12 * np.abs(e).max(),
                                       err_msg=f"{kind}-parallel, {name}, {n} ranks")
        layer.weight.grad = None
        layer.bias.grad = None
        layer.split = fp8.Split(comm, frozenset())        # each shard by its own amax
        alone = _fp8_layer_run(layer, *args)
    finally:
        fp8.set_linears(False)
    if n > 1:             # (fp8 is a floating format: a shard's own power-of-two scale
                          # differs where the whole tensor's pushes its values to subnormals)
        differs = not all(np.allclose(a, e, rtol=1e-6) for a, e in zip(alone, mine))
        assert comm.mpi.allreduce(int(differs)), "each shard's own scale gave the same numbers"
