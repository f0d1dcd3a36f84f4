"""Device arrays through every collective and every training layout.

The device is $HPCDIST_DEVICE when it names one (``gpu`` under ``make test-gpu``), else the
GPU stand-in (hpcdist/device/standin.py): arrays that act as device arrays but that MPI
refuses to read, so any path that hands an unstaged device array to MPI fails here, on a
machine without a GPU. Expectations: MPI's built-in collectives on host copies, and the
1-rank CPU run of the same training configuration (fp64, per-step loss and gradient norm).
"""
import functools
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpcdist.device import backend
from hpcdist.comm import Communicator, shard_bounds
from hpcdist.comm.select import ALLREDUCE_ALGORITHMS, BCAST_ALGORITHMS
from hpcdist.comm.wire import WireError
from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi

DEVICE = os.environ.get("HPCDIST_DEVICE", "standin")
DEVICE = DEVICE if DEVICE in ("gpu", "standin") else "standin"


@pytest.fixture(autouse=True)
def on_device(comm):
    backend.init(DEVICE, comm.local_rank)
    yield backend.xp()
    backend.init("cpu")


def dev(x):
    return backend.to_device(np.ascontiguousarray(x))


def host(x):
    assert backend.is_gpu_array(x), f"expected a device array, got {type(x).__name__}"
    return backend.to_numpy(x)


def rank_data(n, dtype, rank, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-20, 21, size=n).astype(dtype)


def oracle(comm, x, op="sum"):
    src = x.astype(np.float64) if x.dtype == np.float16 else x
    out = np.empty_like(src)
    comm.mpi.Allreduce(src, out, op={"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}[op])
    if op == "avg":
        out = out / comm.size
    return out.astype(x.dtype)


def sizes(P):
    # short (carried in the agreement) and long (ring, trees) calls alike
    return [0, 1, P + 1, 97, 5000, 70_001]


@pytest.mark.parametrize("algorithm", ["auto"] + sorted(ALLREDUCE_ALGORITHMS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32"])
def test_allreduce_on_device_arrays(comm, algorithm, dtype):
    for n in sizes(comm.size):
        x = rank_data(n, dtype, comm.rank, n)
        d = dev(x)
        for op in ("sum", "max", "avg") if dtype != "int32" else ("sum", "max"):
            got = comm.allreduce(d, op=op, algorithm=algorithm)
            np.testing.assert_allclose(host(got), oracle(comm, x, op), rtol=1e-3,
                                       err_msg=f"n={n} op={op}")
        np.testing.assert_array_equal(host(d), x)                     # left as it was
        out = dev(np.zeros_like(x))
        assert comm.allreduce(d, out=out, algorithm=algorithm) is out
        np.testing.assert_array_equal(host(out), oracle(comm, x))
        comm.allreduce(d, out=d, algorithm=algorithm)                  # in place
        np.testing.assert_array_equal(host(d), oracle(comm, x))


def test_nonblocking_and_wire_dtype_on_device(comm):
    for n in sizes(comm.size):
        x = rank_data(n, "float32", comm.rank, n)
        handles = [comm.iallreduce(dev(x)), comm.iallreduce(dev(x), wire_dtype="float16")]
        for h in handles:
            np.testing.assert_array_equal(host(h.wait()), oracle(comm, x))


def test_reduce_scatter_and_allgather_on_device(comm):
    P, r = comm.size, comm.rank
    for n in sizes(P):
        x = rank_data(n, "float64", r, n)
        lo, hi = shard_bounds(n, P, r)
        full = oracle(comm, x)
        np.testing.assert_array_equal(host(comm.reduce_scatter(dev(x))), full[lo:hi])
        np.testing.assert_array_equal(host(comm.ireduce_scatter(dev(x), "avg").wait()),
                                      full[lo:hi] / P)
        counts = [n // P + (1 if c < n % P else 0) for c in range(P)][::-1]   # uneven
        c0 = sum(counts[:r])
        np.testing.assert_array_equal(host(comm.reduce_scatter(dev(x), counts=counts)),
                                      full[c0:c0 + counts[r]])
        np.testing.assert_array_equal(host(comm.allgather(dev(full[lo:hi]), total=n)), full)
        np.testing.assert_array_equal(
            host(comm.iallgather(dev(full[c0:c0 + counts[r]]), counts=counts).wait()), full)
        out = dev(np.zeros(n))
        mine = out[c0:c0 + counts[r]]
        mine[...] = dev(full[c0:c0 + counts[r]])
        assert comm.allgather(mine, counts=counts, out=out) is out     # in place
        np.testing.assert_array_equal(host(out), full)


@pytest.mark.parametrize("algorithm", ["auto"] + sorted(BCAST_ALGORITHMS))
def test_bcast_and_reduce_on_device(comm, algorithm):
    for root in range(comm.size):
        for n in sizes(comm.size):
            ref = rank_data(n, "float32", root, n)
            d = dev(rank_data(n, "float32", comm.rank, n))
            assert comm.bcast(d, root=root, algorithm=algorithm) is d
            np.testing.assert_array_equal(host(d), ref)
        x = rank_data(33, "float64", comm.rank)
        got = comm.reduce(dev(x), root=root)
        if comm.rank == root:
            np.testing.assert_array_equal(host(got), oracle(comm, x))
        else:
            oracle(comm, x)
            assert got is None


@pytest.mark.parametrize("algorithm", ["pairwise", "bruck"])
def test_alltoall_on_device(comm, algorithm):
    """Equal and uneven pieces (zeros too) of device arrays against MPI's Alltoallv."""
    P, r = comm.size, comm.rank
    counts = [(j + r) % 3 for j in range(P)]
    for cts in (None, counts):
        x = rank_data(sum(cts) if cts else 5 * P, "float32", r, 9)
        c = cts or [5] * P
        incoming = np.empty(P, dtype=np.int64)
        comm.mpi.Alltoall(np.array(c, dtype=np.int64), incoming)
        want = np.empty(int(incoming.sum()), dtype=x.dtype)
        comm.mpi.Alltoallv([x, c], [want, incoming])
        got = comm.alltoall(dev(x), counts=cts, algorithm=algorithm)
        np.testing.assert_array_equal(np.concatenate([host(g) for g in got]), want)


def test_point_to_point_and_sparse_on_device(comm):
    P, r = comm.size, comm.rank
    right, left = (r + 1) % P, (r - 1) % P
    x = rank_data(1000, "float32", r).reshape(10, 100)
    got = comm.sendrecv(dev(x), right, left)
    np.testing.assert_array_equal(host(got), rank_data(1000, "float32", left).reshape(10, 100))
    h = comm.isend(dev(x), right, tag=3)
    np.testing.assert_array_equal(host(comm.irecv(left, tag=3).wait()).reshape(-1),
                                  rank_data(1000, "float32", left))
    h.wait()
    if P > 1:
        g = np.zeros(4000)
        g[np.arange(r, 4000, 97)] = np.arange(r, 4000, 97) + 1.0    # 42 of 4000 per rank
        dense = comm.sparse_allreduce(dev(g), k=42)
        np.testing.assert_array_equal(host(dense), oracle(comm, g))


def test_outstanding_sends_of_device_arrays_keep_their_values(comm):
    """Several non-blocking sends of device arrays at once (the pipeline's and the context-
    parallel ring's pattern), each past MPI's eager limit: every one arrives as it was sent,
    though each was staged to the host (a staging buffer reused by the next send would carry
    the last array's values in all of them)."""
    P, r = comm.size, comm.rank
    right, left = (r + 1) % P, (r - 1) % P
    n = 300_000                                        # 1.2 MB each: a rendezvous send
    sends = [comm.isend(dev(rank_data(n, "float32", r, seed=k)), right, tag=20 + k)
             for k in range(3)]
    got = [comm.irecv(left, tag=20 + k) for k in range(3)]
    for k, h in enumerate(got):
        np.testing.assert_array_equal(host(h.wait()), rank_data(n, "float32", left, seed=k))
    for h in sends:
        h.wait()


def test_an_unstaged_device_array_never_reaches_mpi(comm):
    """The wire refuses it (a real CuPy array would be read as a host pointer)."""
    if comm.cuda_aware:
        pytest.skip("MPI reads device memory here (CUDA-aware): handing it over is right")
    d = dev(np.ones(8))
    with pytest.raises(WireError, match="without staging"):
        comm._wire.Send(d, comm.rank, 0)
    if DEVICE == "standin":           # and MPI itself cannot read the GPU stand-in
        with pytest.raises(TypeError):
            comm.mpi.Send(d, comm.rank, 0)


# ---- training: every layout on the device follows the 1-rank CPU run ------------------------

def _history(cfg, comm):
    final = train(cfg, comm, log=lambda *a: None)
    return np.array([[h["loss"], h["grad_norm"]] for h in final["history"]])


@functools.lru_cache(maxsize=None)
def _cpu_reference(batch, n_layer, n_head, n_embd, tie, experts=0):
    solo = Communicator(MPI.COMM_SELF)
    try:
        cfg = small(device="cpu", batch_size=batch, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, tie_weights=tie, grad_clip=1.0, experts=experts,
                    out_dir=f"/tmp/hpcdist-dev-ref-{MPI.COMM_WORLD.Get_rank()}")
        return _history(cfg, solo)
    finally:
        solo.close()
        backend.init(DEVICE, 0)


def _layouts(P):
    out = [dict(), dict(zero=1), dict(zero=2), dict(zero=3)]
    if P % 2 == 0:
        out += [dict(tp=2, n_head=4), dict(tp=2, sequence_parallel=True, n_head=4),
                dict(tp=2, zero=1, n_head=4),
                dict(pp=2, schedule="1f1b"), dict(pp=2, schedule="gpipe", micro_batches=1),
                dict(pp=2, schedule="zb-h1"), dict(pp=2, tie_weights=False),
                dict(cp=2), dict(cp=2, cp_impl="ulysses"), dict(ep=2, experts=4, zero=2)]
    if P % 3 == 0:
        out += [dict(tp=3, n_head=3, n_embd=18), dict(cp=3, zero=2)]
    if P % 4 == 0:
        out += [dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=2, n_layer=4),
                dict(tp=2, cp=2, n_head=4), dict(pp=2, cp=2, zero=1),
                dict(tp=2, ep=2, experts=4, n_head=4)]
    if P % 8 == 0:
        out += [dict(tp=2, pp=2, n_head=4, n_layer=2),
                dict(tp=2, pp=2, cp=2, n_head=4, sequence_parallel=True)]
    return out


@pytest.mark.parametrize("backend_name", ["mpi", "nccl"])
@pytest.mark.parametrize("index", range(20))
def test_every_layout_on_device_follows_the_cpu_run(comm, tmp_path, index, backend_name):
    """fp64: each layout, with its collectives over MPI or over NCCL (the NCCL stand-in
    where no GPU is), equals the one-process CPU run to 1e-10."""
    layouts = _layouts(comm.size)
    assert len(layouts) <= 20, "more layouts than test indices: raise the range"
    if index >= len(layouts):
        pytest.skip(f"{len(layouts)} layouts at {comm.size} ranks")
    if backend_name == "nccl" and (DEVICE == "cpu" or (
            DEVICE == "gpu" and backend.gpu_count() < comm.size)):
        pytest.skip("NCCL needs a device array per rank: --device standin, or a GPU per rank")
    kw = {**dict(n_layer=2, n_head=2, n_embd=16), **layouts[index]}
    P = comm.size
    replicas = P // (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1))
    batch = 4
    cfg = small(device=DEVICE, batch_size=batch, grad_clip=1.0, out_dir=str(tmp_path),
                backend=backend_name, **kw)
    got = _history(cfg, comm)
    ref = _cpu_reference(batch * replicas, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.tie_weights,
                         cfg.experts)
    np.testing.assert_allclose(got, ref, rtol=1e-10, err_msg=f"{layouts[index]} {backend_name}")


LONG = [dict(), dict(cp=2), dict(cp=2, cp_impl="ulysses"), dict(tp=2, n_head=4)]


@pytest.mark.parametrize("layout", LONG, ids=["dp", "cp2-ring", "cp2-ulysses", "tp2"])
def test_a_long_context_on_device_follows_the_cpu_run(comm, tmp_path, layout):
    """fp64 at T 1024 (the tiled attention over many tiles; the ring's and Ulysses' blocks):
    each layout on the device equals the one-process CPU run to 1e-10 — on a GPU, the flash
    kernels' exact path against the CPU's."""
    if comm.size % layout.get("cp", layout.get("tp", 1)):
        pytest.skip(f"{layout} needs a world size it divides")
    text = tmp_path / "long.txt"
    text.write_text("".join(f"{i * 7919 % 1000:03d} long context, tile by tile. "
                            for i in range(400)))
    kw = {**dict(task="text", data=str(text), block_size=1024, n_layer=1, n_head=2, n_embd=16,
                 steps=2, batch_size=1, eval_tokens=1024, grad_clip=1.0), **layout}
    replicas = comm.size // (kw.get("tp", 1) * kw.get("cp", 1))
    got = _history(small(device=DEVICE, out_dir=str(tmp_path / "run"), **kw), comm)
    solo = Communicator(MPI.COMM_SELF)
    try:
        one = {**kw, "batch_size": replicas, "cp": 1, "tp": 1}
        one.pop("cp_impl", None)
        ref = _history(small(device="cpu", out_dir=str(tmp_path / "ref"), **one), solo)
    finally:
        solo.close()
        backend.init(DEVICE, comm.local_rank)
    assert got.shape == (2, 2)
    np.testing.assert_allclose(got, ref, rtol=1e-10, err_msg=str(layout))
