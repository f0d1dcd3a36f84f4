"""Check a training job's settings before it launches: ``python -m hpcdist.preflight``.

The job templates in ``jobs/`` run this in the batch shell, on one process and without MPI,
before ``srun`` starts any rank: a missing or contradictory setting then ends the job at once
with a message that says what to set, instead of failing inside every rank.

    python -m hpcdist.preflight --world 8 --tasks-per-node 4 --gpus-per-node 4 -- --device gpu ...

The rest of this design: docs/cluster.md, "hpcdist/preflight.py"."""
from __future__ import annotations

import sys

from .device import backend
from . import checkpoint, data
from .run.config import ConfigError, parse_config, validate_world
from .host.cli import Parser


def check(train_args: list, world: int, tasks_per_node: int | None = None,
          gpus_per_node: int | None = None, needs_gpu: bool = False,
          probe_device: bool = True) -> list:
    """Raise ConfigError for a setting that cannot work; return warnings for odd ones."""
    warnings = []
    if world < 1:
        raise ConfigError(f"the job has {world} tasks; ask for at least one (-n / --ntasks)")
    cfg = parse_config(train_args)
    tpn = tasks_per_node or world
    if needs_gpu and cfg.device == "cpu":
        raise ConfigError("this is a GPU template but the options say --device cpu; use "
                          "jobs/train-cpu.sbatch for CPU training")
    if cfg.device == "gpu":
        if not gpus_per_node:
            raise ConfigError("--device gpu, but the job has no GPUs: submit with "
                              "--gpus-per-task=1 (one rank per GPU) on a GPU partition "
                              "(-p NAME), or train on CPUs with jobs/train-cpu.sbatch")
        if tpn > gpus_per_node:
            raise ConfigError(f"{tpn} ranks per node but {gpus_per_node} GPUs per node: hpcdist "
                              f"runs one rank per GPU (NCCL refuses two ranks on one GPU); set "
                              f"--ntasks-per-node={gpus_per_node} or ask for "
                              f"--gpus-per-task=1")
        if tpn < gpus_per_node:
            warnings.append(f"{gpus_per_node} GPUs per node but only {tpn} ranks per node: "
                            f"{gpus_per_node - tpn} GPUs stay idle")
        if probe_device:
            try:
                backend.init("gpu", 0)
            except (backend.DeviceError, ImportError) as e:
                raise ConfigError(f"--device gpu on this node: {e}") from None
    elif gpus_per_node:
        warnings.append(f"{gpus_per_node} GPUs allocated per node, but --device {cfg.device}")
    train_set, _ = data.datasets_of(cfg)
    validate_world(cfg, world, len(train_set))
    if cfg.resume:
        try:
            folder, _ = checkpoint.find_resume(cfg.save_dir)
            if folder is not None:
                checkpoint.check_meta(checkpoint.read_manifest(folder),
                                      checkpoint.checkpoint_meta(cfg, train_set.vocabulary),
                                      folder, train_set.vocabulary)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
    return warnings


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    ap = Parser(prog="python -m hpcdist.preflight",
                description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, required=True, help="total ranks ($SLURM_NTASKS)")
    ap.add_argument("--tasks-per-node", type=int, default=None)
    ap.add_argument("--gpus-per-node", type=int, default=0)
    ap.add_argument("--needs-gpu", action="store_true", help="a GPU template: refuse CPU runs")
    ap.add_argument("--no-device-probe", dest="probe", action="store_false",
                    help="do not import CuPy here (the batch shell runs on another machine)")
    args = ap.parse_args(ours)
    try:
        warnings = check(train_args, args.world, args.tasks_per_node, args.gpus_per_node,
                         args.needs_gpu, args.probe)
    except (ConfigError, checkpoint.CheckpointError, OSError, ValueError) as e:
        print(f"hpcdist.preflight: error: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"hpcdist.preflight: warning: {w}", file=sys.stderr)
    print(f"hpcdist.preflight: ok ({args.world} ranks"
          + (f", {args.tasks_per_node} per node" if args.tasks_per_node else "")
          + (f", {args.gpus_per_node} GPUs per node" if args.gpus_per_node else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
