"""hpcdist beside its peers: ``python -m hpcdist.bench peers``.

Allreduce time, 8 B to 64 MiB in 4x steps, at N = 2 and 4 ranks, of hpcdist, MPI's built-in
(``MPI_Allreduce`` of the library mpi4py runs on) and torch.distributed over gloo — in three
separate blocks, each timed between its own library's barriers (MPICH's busy-polling barrier
slows gloo 3x when mixed in), median of the iterations; the ratios hpcdist / MPI and hpcdist /
gloo; and a PNG. PyTorch is optional: without it the gloo column is skipped, saying so.

The rest of this design: docs/communication.md, "hpcdist/bench/peers.py"."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hpcdist.bench.common import emit, relaunch, table, write_json
from ..host.cli import Parser


def sizes(lo: int, hi: int):
    n = lo
    while n <= hi:
        yield n
        n *= 4


def _median_time(fn, barrier, iters: int) -> float:
    samples = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def worker(args) -> int:
    from mpi4py import MPI

    from hpcdist.comm import Communicator
    comm = Communicator()
    mpi = comm.mpi
    results = {}
    # block 1: hpcdist; block 2: MPI's built-in (each with MPI's barrier)
    for n in sizes(8, args.max_bytes):
        x = np.ones(max(1, n // 4), dtype=np.float32)
        iters = max(5, min(200, (1 << 22) // n))
        comm.allreduce(x)
        results.setdefault(n, {})["hpcdist"] = _median_time(lambda: comm.allreduce(x),
                                                            mpi.Barrier, iters)
    for n in sizes(8, args.max_bytes):
        x = np.ones(max(1, n // 4), dtype=np.float32)
        out = np.empty_like(x)
        iters = max(5, min(200, (1 << 22) // n))
        results[n]["mpi"] = _median_time(lambda: mpi.Allreduce(x, out, MPI.SUM), mpi.Barrier,
                                         iters)
    # block 3: gloo, with its own barrier
    try:
        import torch
        import torch.distributed as dist
        port = mpi.bcast(29500 + os.getpid() % 2000 if comm.rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=comm.rank, world_size=comm.size)
        for n in sizes(8, args.max_bytes):
            t = torch.ones(max(1, n // 4), dtype=torch.float32)
            iters = max(5, min(200, (1 << 22) // n))
            dist.all_reduce(t)
            results[n]["gloo"] = _median_time(lambda: dist.all_reduce(t), dist.barrier, iters)
        dist.destroy_process_group()
    except ImportError:
        pass
    if comm.rank == 0:
        for n, r in results.items():
            emit({"ranks": comm.size, "bytes": n, **{k: v * 1e6 for k, v in r.items()}})
    return 0


def torch_gpt(torch, sd: dict, cfg):
    """A nanoGPT-shaped PyTorch module over the nanoGPT-named arrays ``sd`` (our initial
    weights, from nn.gpt.nanogpt_names)."""
    F = torch.nn.functional
    C, nh = cfg.n_embd, cfg.n_head

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(
                torch.tensor(v)) for k, v in sd.items() if k != "lm_head.weight"})

        def w(self, name):
            return self.p[name.replace(".", "__")]

        def forward(self, idx):
            B, T = idx.shape
            x = self.w("transformer.wte.weight")[idx] + self.w("transformer.wpe.weight")[:T]
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)

            def ln(x, p):
                return F.layer_norm(x, (C,), self.w(p + ".weight"), self.w(p + ".bias"))
            for i in range(cfg.n_layer):
                h = f"transformer.h.{i}."
                q, k, v = F.linear(ln(x, h + "ln_1"), self.w(h + "attn.c_attn.weight"),
                                   self.w(h + "attn.c_attn.bias")).split(C, dim=2)
                q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
                att = (q @ k.transpose(-2, -1)) / (C // nh) ** 0.5
                y = (att.masked_fill(mask, float("-inf")).softmax(-1) @ v)
                y = y.transpose(1, 2).reshape(B, T, C)
                x = x + F.linear(y, self.w(h + "attn.c_proj.weight"),
                                 self.w(h + "attn.c_proj.bias"))
                m = F.gelu(F.linear(ln(x, h + "ln_2"), self.w(h + "mlp.c_fc.weight"),
                                    self.w(h + "mlp.c_fc.bias")), approximate="tanh")
                x = x + F.linear(m, self.w(h + "mlp.c_proj.weight"),
                                 self.w(h + "mlp.c_proj.bias"))
            return F.linear(ln(x, "transformer.ln_f"), self.w("transformer.wte.weight"))
    return GPT()


def torch_adamw(torch, tm, cfg):
    """PyTorch's AdamW set up as ours: decay on matrices only, the run's betas."""
    decay = [p for p in tm.parameters() if p.ndim >= 2]
    rest = [p for p in tm.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=1e-8)


ROUNDS = 2        # --train: each contender trains this many times, taking turns


def train_worker(args) -> int:
    """hpcdist's DDP training and PyTorch DDP's on the same model, data and optimizer, taking
    turns ``ROUNDS`` times (a process's first run pays warm-ups, and a shared machine
    drifts); each contender's time is its fastest run's median step. At 1 rank also what
    hpcdist's overlap path costs (``overlap_cost``)."""
    import tempfile
    import torch
    import torch.distributed as dist

    from hpcdist import data, nn, optim
    from hpcdist.host import threads
    from hpcdist.nn.gpt import nanogpt_names
    from hpcdist.comm import Communicator
    from hpcdist.run.config import TrainConfig
    from hpcdist.parallel.ddp import plan_buckets
    from hpcdist.train import train
    comm = Communicator()
    cap = args.bucket_mb                        # None: both libraries' defaults
    buckets = {} if cap is None else {"bucket_mb": cap, "first_bucket_mb": cap}
    size = {}
    if args.model:
        layers, width = (int(v) for v in args.model.lower().split("x"))
        size = {"n_layer": layers, "n_embd": width, "n_head": max(1, width // 64)}
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch, log_every=10 ** 9, **size,
                      out_dir=comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else "", 0),
                      **buckets)
    train_set, _ = data.make_task(cfg.task, length=cfg.length, num_digits=cfg.num_digits)
    nn.manual_seed(cfg.seed)                                   # train()'s initial weights
    model = nn.GPT(nn.GPTConfig(block_size=train_set.block_size, vocab_size=train_set.vocab_size,
                                n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))
    sd = nanogpt_names({n: p.data.astype("float32") for n, p in model.named_parameters()})
    torch.set_num_threads(max(1, threads.threads))
    port = comm.mpi.bcast(29500 + os.getpid() % 2000 if comm.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)

    def torch_run():
        tm = torch_gpt(torch, sd, cfg)
        # bucket_cap_mb given: PyTorch caps its first bucket the same (as hpcdist's is here)
        ddp = torch.nn.parallel.DistributedDataParallel(tm, bucket_cap_mb=cap)
        opt = torch_adamw(torch, tm, cfg)
        sampler = data.DistributedSampler(len(train_set), cfg.batch_size, comm.rank,
                                          comm.size, seed=cfg.seed)
        times, loss = [], None
        for step in range(1, cfg.steps + 1):
            x, y = train_set.batch(sampler.next_batch())
            lr = optim.lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            logits = ddp(torch.from_numpy(x))
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), torch.from_numpy(y).view(-1),
                ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tm.parameters(), cfg.grad_clip)
            opt.step()
            times.append(time.perf_counter() - t0)
        final = torch.tensor([loss.item()])
        dist.all_reduce(final)
        return float(np.median(times[len(times) // 5:])) * 1e3, float(final[0]) / comm.size

    def ours_run():
        r = train(cfg, comm, log=lambda *a: None)
        return r["step_ms_median"], r["train_loss"]

    def overlap_cost(steps=200):
        """Nothing to overlap at 1 rank: forward + backward + sync_gradients with overlap on
        and off, step by step in turns on one model (so drift cancels), median of each."""
        from hpcdist.parallel.ddp import DistributedDataParallel
        nn.manual_seed(cfg.seed)
        m = nn.GPT(nn.GPTConfig(block_size=train_set.block_size,
                                vocab_size=train_set.vocab_size, n_layer=cfg.n_layer,
                                n_head=cfg.n_head, n_embd=cfg.n_embd))
        ddp = DistributedDataParallel(m, comm, bucket_mb=cfg.bucket_mb,
                                      first_bucket_mb=cfg.first_bucket_mb)
        sampler = data.DistributedSampler(len(train_set), cfg.batch_size, 0, 1, seed=cfg.seed)
        x, y = train_set.batch(sampler.next_batch())
        t = {True: [], False: []}
        for i in range(2 * steps):
            ddp.overlap = i % 2 == 0
            t0 = time.perf_counter()
            ddp.flat.grad[...] = 0
            ddp(x, y)[1].backward()
            ddp.sync_gradients()
            t[ddp.overlap].append(time.perf_counter() - t0)
        return float(np.median(t[True])) * 1e3, float(np.median(t[False])) * 1e3

    ours, theirs = [], []
    for _ in range(ROUNDS):
        ours.append(ours_run())
        theirs.append(torch_run())
    on_off = overlap_cost() if comm.size == 1 else (None, None)
    dist.destroy_process_group()
    n_buckets = len(plan_buckets([p.size for p in model.parameters()], 4, cfg.bucket_mb,
                                 cfg.first_bucket_mb))
    if comm.rank == 0:
        emit({"ranks": comm.size, "buckets": n_buckets,
              "ours_ms": min(t for t, _ in ours), "torch_ms": min(t for t, _ in theirs),
              "overlap_ms": on_off[0], "no_overlap_ms": on_off[1],
              "ours_loss": ours[-1][1], "torch_loss": theirs[-1][1]})
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench peers", description=__doc__)
    ap.add_argument("--sizes", default="2,4", help="world sizes")
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--out", default="runs/bench_peers.json")
    ap.add_argument("--train", action="store_true",
                    help="the DDP training step beside PyTorch DDP (gloo) instead")
    ap.add_argument("--ranks", default="1,2,4,8", help="--train: world sizes")
    ap.add_argument("--steps", type=int, default=100, help="--train: steps")
    ap.add_argument("--batch", type=int, default=64, help="--train: batch per rank")
    ap.add_argument("--model", default=None,
                    help="--train: GPT layers x width, LxC (heads of 64; default: train.py's)")
    ap.add_argument("--many-mb", type=float, default=0.0005,
                    help="--train: the bucket cap (MB) of the many-bucket runs (0: skip them)")
    ap.add_argument("--bucket-mb", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return train_worker(args) if args.train else worker(args)
    if args.train:
        return main_train(args)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        rows += relaunch("peers", n, ["--max-bytes", str(args.max_bytes)])
    has_gloo = any("gloo" in r for r in rows)
    if not has_gloo:
        print("PyTorch is not installed: the gloo column is skipped "
              "(pip install torch==2.13.0 to add it)")
    for r in rows:
        r["x_mpi"] = r["hpcdist"] / r["mpi"]
        r["x_gloo"] = r["hpcdist"] / r["gloo"] if has_gloo else None
    print("allreduce, median us per call (float32), three separate blocks each timed between "
          "its own library's barriers")
    print(table(rows, [("ranks", "ranks", "d"), ("bytes", "bytes", ",d"),
                       ("hpcdist us", "hpcdist", ".1f"), ("MPI us", "mpi", ".1f"),
                       ("gloo us", "gloo", ".1f"), ("x MPI", "x_mpi", ".2f"),
                       ("x gloo", "x_gloo", ".2f")]))
    write_json(args.out, {"rows": rows})
    try:
        from hpcdist.bench.common import pyplot
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in sorted({r["ranks"] for r in rows}):
            mine = [r for r in rows if r["ranks"] == n]
            for key, style in (("hpcdist", "-o"), ("mpi", "--s"), ("gloo", ":^")):
                if key in mine[0]:
                    ax.loglog([r["bytes"] for r in mine], [r[key] for r in mine], style,
                              label=f"{key}, {n} ranks", markersize=3)
        ax.set_xlabel("bytes")
        ax.set_ylabel("us per allreduce (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        png = os.path.splitext(args.out)[0] + ".png"
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"wrote {args.out} and {png}")
    except SystemExit:
        print(f"wrote {args.out} (no PNG: matplotlib missing)")
    return 0


def main_train(args) -> int:
    """The DDP step table: both libraries' default buckets, then many small buckets (the
    same cap for both, first bucket included) — where per-bucket overheads show."""
    runs = [("default buckets (hpcdist 25 MB / first 1 MB; PyTorch the same)", None)]
    if args.many_mb > 0:
        runs.append((f"many buckets ({args.many_mb:g} MB each, both libraries)", args.many_mb))
    doc = {}
    for title, cap in runs:
        rows = []
        for n in (int(x) for x in args.ranks.split(",")):
            extra = [] if cap is None else ["--bucket-mb", str(cap)]
            model = ["--model", args.model] if args.model else []
            rows += relaunch("peers", n, ["--train", "--steps", str(args.steps), "--batch",
                                          str(args.batch), *model, *extra])
        for r in rows:
            r["ratio"] = r["ours_ms"] / r["torch_ms"]
            r["loss_diff"] = abs(r["ours_loss"] - r["torch_loss"])
            if r.get("no_overlap_ms"):
                r["overlap_cost"] = r["overlap_ms"] / r["no_overlap_ms"]
        what = f"GPT {args.model}" if args.model else "default GPT"
        print(f"\nDDP step, {what} on the default task, {title}, AdamW, batch {args.batch} "
              f"per rank, {args.steps} steps: hpcdist vs PyTorch DDP over gloo (median ms/step after the "
              f"first fifth; {ROUNDS} runs each, taking turns, the faster); at 1 rank also "
              "hpcdist's forward + backward + sync with overlap on and off, step by step in "
              "turns")
        print(table(rows, [("ranks", "ranks", "d"), ("buckets", "buckets", "d"),
                           ("hpcdist ms", "ours_ms", ".1f"), ("PyTorch ms", "torch_ms", ".1f"),
                           ("x PyTorch", "ratio", ".2f"), ("fwd+bwd overlap", "overlap_ms", ".2f"),
                           ("no overlap", "no_overlap_ms", ".2f"),
                           ("overlap/none", "overlap_cost", ".2f"),
                           ("hpcdist loss", "ours_loss", ".4f"),
                           ("PyTorch loss", "torch_loss", ".4f"), ("|diff|", "loss_diff", ".1e")]))
        doc["default" if cap is None else "many"] = rows
    out = os.path.splitext(args.out)[0] + "_train.json"
    write_json(out, doc)
    print(f"wrote {out}")
    return 0
