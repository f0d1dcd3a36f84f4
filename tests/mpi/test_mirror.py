"""The mirror of in-job recovery (run/mirror.py) without a real failure: every rank hands its
committed state to its buddy, some ranks then drop out, and the others assemble the whole
state from what they hold. Oracle: the checkpoint the same run wrote at that step (every
tensor equal, exactly). ULFM's part (a real SIGKILL) is tests/ulfm."""
from types import SimpleNamespace

import numpy as np
import pytest

from hpcdist import checkpoint
from hpcdist.run import mirror
from hpcdist.run.mirror import Mirror, buddy_offset
from hpcdist.train import train

from helpers import small

pytestmark = pytest.mark.mpi


def layouts(P):
    out = [dict(zero=1), dict(zero=3)]
    if P % 2 == 0:
        out += [dict(tp=2), dict(pp=2), dict(tp=2, zero=2), dict(cp=2, zero=1)]
    return out


def _trained(comm, layout, folder):
    """(the strategy after 2 steps, the step-2 checkpoint's reader) of ``layout``."""
    cfg = small(**layout, steps=2, batch_size=4, save_dir=folder, out_dir=folder + "_o")
    held = []
    train(cfg, comm, log=lambda *a: None, on_build=held.append)
    return cfg, held[0], checkpoint.Reader(checkpoint.latest(folder))


def _sampler():
    return SimpleNamespace(epoch=0, position=2, batch_size=3, world=1)


def _survivors(comm, lost):
    """The ranks not in ``lost``, as a communicator; None on a lost rank (it is gone)."""
    sub = comm.split(1 if comm.rank in lost else 0)
    if comm.rank in lost:
        sub.close()
        return None
    return sub


def test_the_survivors_assemble_every_tensor_of_the_committed_step(comm, shared_dir):
    if comm.size < 2:
        pytest.skip("a mirror needs a buddy")
    for i, layout in enumerate(layouts(comm.size)):
        cfg, strategy, reader = _trained(comm, layout, f"{shared_dir}/l{i}")
        m = Mirror(1, comm)
        for step in (1, 2):                            # two generations (the same state)
            m.take(step, cfg, comm, strategy, _sampler())
        for lost in ([comm.size - 1], [0]):
            sub = _survivors(comm, lost)
            if sub is None:
                continue
            held = mirror.restore(sub, m, lost)
            sub.close()
            assert held is not None and held[0] == 2, (layout, lost)
            _, scalars, arrays = held
            assert scalars["layout"]["after_failure"] is True
            assert sorted(arrays) == sorted(reader.tensors), layout
            for name in arrays:
                np.testing.assert_array_equal(arrays[name], reader.tensor(name),
                                              err_msg=f"{layout} {name} lost {lost}")


def test_a_death_mid_exchange_restores_the_generation_before(comm, shared_dir):
    if comm.size < 2:
        pytest.skip("a mirror needs a buddy")
    cfg, strategy, reader = _trained(comm, dict(zero=3), f"{shared_dir}/z")
    m = Mirror(1, comm)
    for step in (1, 2):
        m.take(step, cfg, comm, strategy, _sampler())
    lost = comm.size - 1
    if comm.rank == (lost + m.offset) % comm.size:     # the buddy never got step 2's copy
        m.generations[-1].ward = None
    sub = _survivors(comm, [lost])
    if sub is None:
        return
    held = mirror.restore(sub, m, [lost])
    sub.close()
    assert held is not None and held[0] == 1
    for name, arr in held[2].items():
        np.testing.assert_array_equal(arr, reader.tensor(name), err_msg=name)


def test_a_rank_lost_with_its_buddy_leaves_it_to_the_checkpoint(comm, shared_dir):
    if comm.size < 3:
        pytest.skip("two ranks lost need a third to say so")
    cfg, strategy, _ = _trained(comm, dict(zero=2), f"{shared_dir}/b")
    m = Mirror(1, comm)
    m.take(1, cfg, comm, strategy, _sampler())
    lost = [0, m.offset % comm.size]                   # rank 0 and the rank holding its copy
    sub = _survivors(comm, lost)
    if sub is not None:
        assert mirror.restore(sub, m, lost) is None
        sub.close()


def test_the_buddy_sits_on_another_node_where_one_exists():
    assert buddy_offset([0, 0, 0]) == 1                # one node: the next rank
    assert buddy_offset([0, 0, 1, 1]) == 2             # 2 x 2: the same place, next node
    assert buddy_offset([0, 1, 0, 1]) == 1             # round-robin placement
    assert buddy_offset([0, 0, 0, 1, 1, 1, 2, 2, 2]) == 3
    assert buddy_offset([0, 0, 0, 1]) == 1             # none works for every rank: the next
