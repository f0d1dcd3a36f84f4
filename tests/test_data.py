"""Datasets and the DistributedSampler: pure logic, no MPI."""
import numpy as np
import pytest

from hpcdist import data


def test_sort_task_layout_and_targets():
    ds = data.DigitTask("sort", length=4, num_digits=5, split="train")
    x, y = ds.batch(np.arange(16))
    assert x.shape == (16, 7) and y.shape == (16, 7)
    for xi, yi in zip(x, y):
        inp = xi[:4]
        np.testing.assert_array_equal(yi[3:], np.sort(inp))
        assert (yi[:3] == data.IGNORE).all()
        np.testing.assert_array_equal(xi[4:], np.sort(inp)[:-1])


def test_reverse_task():
    ds = data.DigitTask("reverse", length=3, num_digits=4, split="test")
    x, y = ds.batch(np.arange(len(ds)))
    np.testing.assert_array_equal(y[:, 2:], x[:, 2::-1])


def test_train_and_test_splits_are_disjoint_and_cover_everything():
    tr = data.DigitTask("sort", length=3, num_digits=6, split="train")
    te = data.DigitTask("sort", length=3, num_digits=6, split="test")
    assert set(tr.ids).isdisjoint(te.ids)
    assert len(tr) + len(te) == 6 ** 3


def test_char_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("abcdefghij" * 10)
    tr = data.CharText(str(p), block_size=8)
    x, y = tr.batch(np.array([0, 5]))
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert tr.vocab_size == 10
    with pytest.raises(ValueError, match="empty"):
        (tmp_path / "e.txt").write_text("")
        data.CharText(str(tmp_path / "e.txt"))
    with pytest.raises(FileNotFoundError):
        data.CharText(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [True, False])
def test_distributed_sampler_partitions_each_epoch(world, drop_last):
    n, b = 47, 4
    samplers = [data.DistributedSampler(n, b, r, world, seed=9, drop_last=drop_last)
                for r in range(world)]
    per_epoch = samplers[0].batches_per_epoch
    batches = [[s.next_batch() for _ in range(per_epoch)] for s in samplers]
    seen = np.concatenate([np.concatenate(bs) for bs in batches])
    assert all(len(bb) == b for bs in batches for bb in bs)
    if drop_last:
        assert len(set(seen)) == len(seen) == per_epoch * b * world   # no example twice
    else:
        assert set(seen) == set(range(n))                             # every example, padded
    # next epoch reshuffles
    nxt = samplers[0].next_batch()
    assert samplers[0].epoch == 1
    assert not np.array_equal(nxt, batches[0][0]) or n < 2


def test_sampler_state_round_trip():
    a = data.DistributedSampler(100, 8, seed=1)
    for _ in range(15):
        a.next_batch()
    b = data.DistributedSampler(100, 8, seed=1)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.next_batch(), b.next_batch())


def test_sampler_rejects_bad_setups():
    with pytest.raises(ValueError, match="smaller than one global batch"):
        data.DistributedSampler(10, 4, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        data.DistributedSampler(10, 1, 3, 3)
