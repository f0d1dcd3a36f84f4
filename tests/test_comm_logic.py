"""Pure logic of the communication layer, without MPI: the shard rule, trees, folding, top-k, costs."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcdist.comm import arith, sparse
from hpcdist.comm.select import choose_allreduce, choose_bcast
from hpcdist.comm.mesh import Grid, MeshCoord, mesh_coords, mesh_rank, validate_mesh


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shards_tile_the_array_in_rank_order(L, P):
    bounds = [arith.shard_bounds(L, P, r) for r in range(P)]
    assert bounds[0][0] == 0 and bounds[-1][1] == L
    for (lo, hi), (lo2, _) in zip(bounds, bounds[1:]):
        assert lo <= hi == lo2
    S = arith.shard_size(L, P)
    assert all(hi - lo <= S for lo, hi in bounds)
    assert sum(arith.shard_counts(L, P)) == L
    assert arith.padded_length(L, P) % P == 0 and arith.padded_length(L, P) - L < P


def test_shard_rule_examples():
    # 10 over 4: S = 3 -> [0,3) [3,6) [6,9) [9,10)
    assert [arith.shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # 2 over 4: S = 1 -> two empty shards at the end
    assert arith.shard_counts(2, 4) == [1, 1, 0, 0]


@given(st.integers(1, 100))
def test_fold_unfold_are_inverse(P):
    pof2 = 1 << (P.bit_length() - 1)
    survivors = []
    for r in range(P):
        p2, new = arith.fold_rank(r, P)
        assert p2 == pof2
        if new >= 0:
            assert arith.unfold_rank(new, P) == r
            survivors.append(new)
    assert sorted(survivors) == list(range(pof2))


@given(st.integers(1, 200))
def test_binomial_tree_reaches_every_rank_once(P):
    received = {0}
    frontier = [0]
    while frontier:
        v = frontier.pop()
        for c in arith.binomial_children(v, P):
            assert arith.binomial_parent(c) == v and c not in received and c < P
            received.add(c)
            frontier.append(c)
    assert received == set(range(P))


def test_ring_peers():
    assert arith.ring_peers(0, 5) == (4, 1) and arith.ring_peers(4, 5) == (3, 0)


def test_reduce_into_and_finish():
    a = np.array([1, 5, 3], dtype=np.int32)
    arith.reduce_into(a, np.array([4, 2, 3], np.int32), "max")
    assert a.tolist() == [4, 5, 3]
    arith.reduce_into(a, np.array([1, 1, 1], np.int32), "sum")
    arith.finish(a, "avg", 2)
    assert a.tolist() == [2, 3, 2]      # floor division for integers
    with pytest.raises(ValueError, match="op must be one of"):
        arith.check_op("prod")


@settings(max_examples=50)
@given(st.integers(1, 2000), st.floats(0.0005, 1.0))
def test_top_k_picks_the_largest_magnitudes(n, density):
    x = np.random.default_rng(n).permutation(n).astype(np.float64) - n / 2 + 0.25
    k = sparse.choose_k(n, density, None)
    idx, vals = sparse.top_k(x, k)
    assert len(set(idx.tolist())) == k
    np.testing.assert_array_equal(vals, x[idx])
    threshold = np.sort(np.abs(x))[n - k]
    assert (np.abs(vals) >= threshold).all()


def test_choose_k():
    assert sparse.choose_k(1000, 0.01, None) == 10
    assert sparse.choose_k(10, 0.001, None) == 1      # at least one value
    assert sparse.choose_k(10, None, 50) == 10        # at most n
    with pytest.raises(ValueError):
        sparse.choose_k(10, None, None)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_sparse_beats_dense_below_about_one_over_P(P):
    n = 1_000_000
    for k_over_n, sparse_wins in ((0.5 / P, True), (2.0 / P, False)):
        s, d = sparse.wire_bytes(n, int(k_over_n * n), 4, P)
        assert (s < d) == sparse_wins


def test_algorithm_choice_and_override(monkeypatch):
    assert choose_allreduce(8, 8) == "recursive_doubling"
    assert choose_allreduce(64 << 20, 8) == "ring"
    assert choose_allreduce(64 << 20, 8, "rabenseifner") == "rabenseifner"
    assert choose_bcast(4 << 20, 4) == "binomial" and choose_bcast(4 << 20, 8) == "scatter_allgather"
    monkeypatch.setenv("HPCDIST_ALLREDUCE", "ring")
    assert choose_allreduce(8, 8) == "ring"
    monkeypatch.setenv("HPCDIST_BCAST", "binomial")
    assert choose_bcast(64 << 20, 8) == "binomial"
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        choose_allreduce(8, 8, "nope")


def test_mesh_coordinates_round_trip():
    dp, tp, pp = 2, 3, 2
    seen = set()
    for r in range(dp * tp * pp):
        c = mesh_coords(r, dp, tp, pp)
        assert mesh_rank(c, dp, tp) == r
        seen.add((c.dp, c.tp, c.pp))
    assert len(seen) == 12
    assert mesh_coords(1, dp, tp, pp) == MeshCoord(dp=0, tp=1, pp=0)   # tp fastest


def test_mesh_validation():
    with pytest.raises(ValueError, match="does not match the world size 8"):
        validate_mesh(8, 3, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        validate_mesh(8, 0, 8, 1)
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        Grid(dp=2).groups(["xp"])
    validate_mesh(8, 2, 2, 2)


def _colour_groups(world, dp, tp, pp, cp):
    """The groups as the mesh made them before it had named axes: a colour and a key per
    axis, derived by hand (the oracle for ``Grid``)."""
    r = np.arange(world)
    c_tp, c_cp = r % tp, (r // tp) % cp
    c_dp, c_pp = (r // (tp * cp)) % dp, r // (tp * cp * dp)
    formulas = {
        ("dp", "cp"): (c_pp * tp + c_tp, c_dp * cp + c_cp),
        ("dp",): ((c_pp * cp + c_cp) * tp + c_tp, c_dp),
        ("cp",): ((c_pp * dp + c_dp) * tp + c_tp, c_cp),
        ("tp",): ((c_pp * dp + c_dp) * cp + c_cp, c_tp),
        ("pp",): ((c_dp * cp + c_cp) * tp + c_tp, c_pp)}
    out = {}
    for axes, (colour, key) in formulas.items():
        groups = {}
        for rank in r:
            groups.setdefault(int(colour[rank]), []).append((int(key[rank]), int(rank)))
        out[axes] = sorted([rk for _, rk in sorted(g)] for g in groups.values())
    return out


def _layouts(world):
    for tp in range(1, world + 1):
        for cp in range(1, world // tp + 1):
            for pp in range(1, world // (tp * cp) + 1):
                if world % (tp * cp * pp) == 0:
                    yield world // (tp * cp * pp), tp, pp, cp


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8, 12, 4096])
def test_named_axis_groups_equal_the_colour_formulas(world):
    """Every layout of up to 8 ranks (and 12), and a spread of layouts of 4,096: each named
    group of the grid is the group the per-axis colour formulas made."""
    layouts = list(_layouts(world))
    if world > 12:                        # 455 layouts of 4,096: every 23rd, and the edges
        layouts = layouts[::23] + [(4096, 1, 1, 1), (1, 4096, 1, 1), (8, 8, 16, 4)]
    for dp, tp, pp, cp in layouts:
        grid = Grid(dp=dp, tp=tp, pp=pp, cp=cp)
        old = _colour_groups(world, dp, tp, pp, cp)
        for axes, groups in old.items():
            assert sorted(grid.groups(axes)) == groups, (world, dp, tp, pp, cp, axes)
        for rank in (0, world - 1):
            assert grid.rank(grid.coords(rank)) == rank
            assert grid.group(rank, ("tp",)) == old[("tp",)][rank // tp]


def test_nccl_backend_without_cupy_is_a_clear_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed; this checks the message when it is missing")
    except ImportError:
        pass
    from hpcdist.device.backend import DeviceError, nccl_module
    with pytest.raises(DeviceError, match="CuPy"):
        nccl_module()


def test_the_nccl_backend_answers_every_call_of_the_protocol():
    """Every public call of the Communicator is in ``nccl.PROTOCOL``; the NCCL backend has
    each, and the ones it refuses raise NotImplementedError naming the call (no GPU needed:
    the refusals come before any NCCL call)."""
    import inspect

    from hpcdist.comm import Communicator
    from hpcdist.comm import nccl as N
    calls = {n for n, f in inspect.getmembers(Communicator, inspect.isfunction)
             if not n.startswith("_")}
    assert calls <= set(N.PROTOCOL), sorted(calls - set(N.PROTOCOL))
    for name in N.PROTOCOL:
        assert callable(getattr(N.NcclCommunicator, name, None)), name
    bare = N.NcclCommunicator.__new__(N.NcclCommunicator)
    for name in N.REFUSED:
        with pytest.raises(NotImplementedError, match=f"^{name} is not in the NCCL backend"):
            getattr(bare, name)(None, 0)


def test_a_layout_names_data_parallelism_with_and_without_experts_apart():
    from hpcdist.comm.mesh import Grid
    from hpcdist.host.layout import Layout
    for world, tp, pp, cp, ep in [(8, 2, 2, 1, 1), (16, 2, 1, 2, 2), (5, 1, 1, 1, 1),
                                  (24, 3, 2, 1, 2), (8, 1, 1, 1, 8)]:
        L = Layout(world, tp, pp, cp, ep)
        assert L.model * L.replicas == world and L.replicas == L.dp * ep
        assert Grid(dp=L.dp, tp=tp, pp=pp, cp=cp, ep=ep).size == world
        assert L.plain == (tp == pp == cp == ep == 1)
