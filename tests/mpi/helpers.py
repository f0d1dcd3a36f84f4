"""What the MPI tests share: a tiny, fast, exact (fp64) training configuration."""
import os

from hpcdist.train import TrainConfig


def small(**kw) -> TrainConfig:
    """A 1-layer GPT on 4-digit sorting, 4 steps of batch 3 per rank, fp64; ``kw`` overrides.
    The device is $HPCDIST_DEVICE (cpu unless set: make test-gpu sets gpu)."""
    base = dict(device=os.environ.get("HPCDIST_DEVICE", "cpu"), task="sort", length=4, num_digits=4, n_layer=1, n_head=2, n_embd=16,
                steps=4, batch_size=3, lr=3e-2, warmup=0, min_lr=3e-2, dtype="fp64",
                log_every=1000, eval_batch=64, seed=7, grad_clip=0.0)
    base.update(kw)
    return TrainConfig(**base)


def history(cfg, comm, **kw):
    """(final report, per-step [loss, grad norm]) of ``train(cfg, comm)``, quietly."""
    import numpy as np
    from hpcdist.train import train
    final = train(cfg, comm, log=lambda *a: None, **kw)
    return final, np.array([[r["loss"], r["grad_norm"]] for r in final["history"]])


_ORACLES: dict = {}        # the one-process runs made so far, by their settings


def one_process(cfg, **changes):
    """``history`` of the same run on this rank alone (every rank computes it), with
    ``changes`` to its settings: the oracle the parallel layouts are held to. A run that
    writes no checkpoint is made once per settings (its output folder aside) and handed out
    again to every layout it is the oracle of: the runs are deterministic in fp64."""
    import copy
    from mpi4py import MPI
    from hpcdist.comm import Communicator
    settings = {**vars(cfg), **changes}
    key = None if settings.get("save_dir") else repr(sorted(
        (k, v) for k, v in settings.items() if k != "out_dir"))
    if key in _ORACLES:
        return copy.deepcopy(_ORACLES[key])
    solo = Communicator(MPI.COMM_SELF)
    try:
        out = history(cfg.__class__(**settings), solo)
    finally:
        solo.close()
    if key is not None:
        _ORACLES[key] = copy.deepcopy(out)
    return out
