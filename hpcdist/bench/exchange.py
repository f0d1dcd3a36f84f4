"""Every gradient exchange on one task: ``python -m hpcdist.bench exchange``.

Dense DDP, fp16 on the wire, Top-K (DGC), PowerSGD at two ranks and the asynchronous
parameter server at three staleness bounds, each trained from the same start on the default
task with the same number of workers (``--workers``; the parameter server adds one server
rank, so the benchmark runs on workers + 1 ranks and the collective methods leave the last
rank idle). For each: held-out accuracy after ``--steps`` steps, bytes a worker sends per
step, and time per step (the slowest rank's training time over the steps) without and with a
straggler (rank 0 sleeps ``--straggler-ms`` in every step; ``--straggler-steps`` steps).
For the parameter server a "step" is one optimizer step on the servers (W gradients); its
workers each run as many steps as their speed allows. Writes a JSON and a PNG of accuracy
against bytes.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from hpcdist.bench.common import emit, pyplot, relaunch, table, write_json
from ..host.cli import Parser

METHODS = [  # label, TrainConfig settings
    ("dense", {}),
    ("fp16", {"compress": "fp16"}),
    ("topk 0.01", {"compress": "topk", "density": 0.01, "compress_momentum": 0.0}),
    ("powersgd r1", {"compress": "powersgd", "powersgd_rank": 1}),
    ("powersgd r4", {"compress": "powersgd", "powersgd_rank": 4}),
    ("ps s=0", {"strategy": "ps", "max_staleness": 0}),
    ("ps s=4", {"strategy": "ps", "max_staleness": 4}),
    ("ps s=inf", {"strategy": "ps", "max_staleness": -1}),
]


def worker(args) -> int:
    import numpy as np

    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.train import train
    world = Communicator()
    W = world.size - 1
    workers = world.split(color=0 if world.rank < W else 1)
    out = world.mpi.bcast(tempfile.mkdtemp() if world.rank == 0 else "", root=0)
    chosen = [m for m in METHODS if not args.only or m[0] in args.only]
    for label, settings in chosen:
        row = {"method": label}
        ps = settings.get("strategy") == "ps"
        comm = world if ps else (workers if world.rank < W else None)
        for tag, steps, straggler in (("", args.steps, ""),
                                      ("_slow", args.straggler_steps,
                                       f"0:{args.straggler_ms:g}")):
            if not steps:
                continue
            cfg = TrainConfig(steps=steps, straggler=straggler, log_every=10 ** 9,
                              out_dir=os.path.join(out, label.replace(" ", "_") + tag),
                              **settings)
            final = train(cfg, comm, log=lambda *a: None) if comm is not None else {}
            # over our communicator: the idle rank waits without spinning (MPI's would)
            took = float(world.allreduce(np.array([final.get("train_seconds", 0.0)]),
                                         op="max")[0])
            hist = final.get("history") or []
            per_step = float(world.bcast(np.array(
                [sum(h["bytes_sent"] for h in hist) / len(hist) if hist else 0.0]), root=1)[0])
            if world.rank == 0:
                row["ms_per_step" + tag] = took / steps * 1e3
                if not tag:
                    row.update(accuracy=final["accuracy"] * 100, bytes_per_step=per_step,
                               local_steps=len(hist))
                    for k in ("staleness_mean", "staleness_max", "clock_gap_max"):
                        row[k] = final.get(k)
                else:
                    row["straggler_steps_done"] = len(hist)
        if world.rank == 0:
            emit(row)
    return 0


def torch_worker(args) -> int:
    """``--torch``: our PowerSGD beside PyTorch DDP's PowerSGD communication hook (gloo), same
    model, start, data, optimizer and rank, both after ``--powersgd-start`` dense steps (PyTorch
    asks for at least 2). Bytes: ours measured; PyTorch counts none, so both sides' values
    allreduced per step come from the shapes, each with its own rule for what it compresses."""
    import re

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from hpcdist import data, nn, optim
    from hpcdist.host import threads
    from hpcdist.bench.peers import torch_adamw, torch_gpt
    from hpcdist.nn.gpt import _NANOGPT, nanogpt_names
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.run.evaluate import evaluate_run
    from hpcdist.train import train
    comm = Communicator()
    out = comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", root=0)
    port = comm.mpi.bcast(29700 + os.getpid() % 2000 if comm.rank == 0 else None, root=0)
    torch.set_num_threads(max(1, threads.threads))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)
    for r in args.ranks:
        cfg = TrainConfig(steps=args.steps, compress="powersgd", powersgd_rank=r,
                          powersgd_start=args.powersgd_start, log_every=10 ** 9,
                          out_dir=os.path.join(out, f"r{r}"))
        ours = train(cfg, comm, log=lambda *a: None)
        train_set, test_set = data.make_task(cfg.task, length=cfg.length,
                                             num_digits=cfg.num_digits)
        nn.manual_seed(cfg.seed)
        model = nn.GPT(nn.GPTConfig(block_size=train_set.block_size,
                                    vocab_size=train_set.vocab_size, n_layer=cfg.n_layer,
                                    n_head=cfg.n_head, n_embd=cfg.n_embd))
        named = dict(model.named_parameters())
        sd = nanogpt_names({n: p.data.astype("float32") for n, p in named.items()})
        tm = torch_gpt(torch, sd, cfg)
        ddp = torch.nn.parallel.DistributedDataParallel(tm)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                   start_powerSGD_iter=max(2, args.powersgd_start),
                                   min_compression_rate=2, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch_adamw(torch, tm, cfg)
        sampler = data.DistributedSampler(len(train_set), cfg.batch_size, comm.rank,
                                          comm.size, seed=cfg.seed)
        for step in range(1, cfg.steps + 1):
            x, y = train_set.batch(sampler.next_batch())
            for g in opt.param_groups:
                g["lr"] = optim.lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
            opt.zero_grad(set_to_none=False)
            logits = ddp(torch.from_numpy(x))
            torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                              torch.from_numpy(y).view(-1),
                                              ignore_index=-100).backward()
            torch.nn.utils.clip_grad_norm_(tm.parameters(), cfg.grad_clip)
            opt.step()
        for name, p in named.items():              # PyTorch's weights back into our model
            for pattern, target, transpose in _NANOGPT:
                if re.fullmatch(pattern, name):
                    w = tm.w(re.sub(pattern, target, name)).detach().numpy()
                    p.data[...] = w.T if transpose else w
                    break
        acc, _, _ = evaluate_run(cfg, model, test_set, comm)

        def values(rule):
            total = 0
            for p in tm.parameters():
                n, m = p.shape[0], p.numel() // p.shape[0]
                total += rule(n, m, min(r, n, m)) if p.ndim >= 2 else p.numel()
            return total
        # ours: r(n + m) where n m >= 2 r (n + m); PyTorch: where (n + m) r * 2 < n m
        ours_values = values(lambda n, m, k: k * (n + m) if n * m >= 2 * k * (n + m) else n * m)
        torch_values = values(lambda n, m, k: k * (n + m) if (n + m) * k * 2 < n * m else n * m)
        if comm.rank == 0:
            emit({"rank": r, "ours_accuracy": ours["accuracy"] * 100,
                  "torch_accuracy": acc * 100, "ours_values": ours_values,
                  "torch_values": torch_values, "dense_values": values(lambda n, m, k: n * m),
                  "ours_bytes_measured": ours["bytes_per_step"]})
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench exchange", description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--straggler-ms", type=float, default=50.0)
    ap.add_argument("--straggler-steps", type=int, default=100)
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help="comma-separated method labels to run (default: all)")
    ap.add_argument("--out", default="runs/bench_exchange.json")
    ap.add_argument("--plot", default="runs/bench_exchange.png")
    ap.add_argument("--torch", action="store_true",
                    help="our PowerSGD beside PyTorch's PowerSGD hook instead (needs torch)")
    ap.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="--torch: PowerSGD ranks")
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="--torch: dense steps first (PyTorch needs >= 2)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return torch_worker(args) if args.torch else worker(args)
    if args.torch:
        return main_torch(args, argv)
    rows = relaunch("exchange", args.workers + 1, argv)
    dense = next((r for r in rows if r["method"] == "dense"), rows[0])
    for r in rows:
        r["kib"] = r["bytes_per_step"] / 1024
        r["fewer"] = dense["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
        r["slowdown"] = r.get("ms_per_step_slow", 0) / r["ms_per_step"] if r.get(
            "ms_per_step_slow") else None
    print(f"gradient exchange | default task | {args.workers} workers (+1 server rank for ps) "
          f"| {args.steps} steps | straggler: rank 0 sleeps {args.straggler_ms:g} ms per step "
          f"({args.straggler_steps} steps)")
    print(table(rows, [("method", "method", "s"), ("held-out %", "accuracy", ".2f"),
                       ("KiB/step", "kib", ",.1f"), ("x fewer", "fewer", ".1f"),
                       ("ms/step", "ms_per_step", ".1f"),
                       ("ms/step slow", "ms_per_step_slow", ".1f"),
                       ("stale mean", "staleness_mean", ".2f"),
                       ("stale max", "staleness_max", "d"),
                       ("gap max", "clock_gap_max", "d")]))
    write_json(args.out, {"workers": args.workers, "steps": args.steps,
                          "straggler_ms": args.straggler_ms, "rows": rows})
    print(f"wrote {args.out}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ax.scatter(r["kib"], r["accuracy"])
        ax.annotate(r["method"], (r["kib"], r["accuracy"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KiB sent per step per worker")
    ax.set_ylabel("held-out accuracy %")
    ax.set_title(f"gradient exchanges, {args.workers} workers, {args.steps} steps")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")
    return 0


def main_torch(args, argv) -> int:
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("PyTorch is not installed: pip install torch to compare with its PowerSGD hook")
        return 1
    rows = relaunch("exchange", args.workers, argv)
    print(f"PowerSGD: hpcdist vs PyTorch DDP's powerSGD_hook | default task | {args.workers} "
          f"ranks | {args.steps} steps | {args.powersgd_start} dense steps first")
    print(table(rows, [("rank", "rank", "d"), ("ours %", "ours_accuracy", ".2f"),
                       ("PyTorch %", "torch_accuracy", ".2f"),
                       ("ours values", "ours_values", ",d"),
                       ("PyTorch values", "torch_values", ",d"),
                       ("dense values", "dense_values", ",d"),
                       ("ours bytes", "ours_bytes_measured", ",.0f")]))
    write_json(args.out.replace(".json", "_torch.json"), {"rows": rows})
    return 0
