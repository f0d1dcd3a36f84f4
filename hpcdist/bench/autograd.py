"""Autograd step time against PyTorch CPU eager (same threads) and a hand-written NumPy floor.

Each contender starts from the same weights and sees the same batches; they take turns in
rounds, and the table prints the median step time (forward + backward + update), the ratio
to PyTorch, and the loss after the same number of steps. The GPT's PyTorch twin is checked to
be the same model in float64 (``twin_agreement``). A last line measures Tensor overhead per
op: an hpcdist op on a tiny array minus the same NumPy call.
"""
from __future__ import annotations

import os
import time

import numpy as np

import hpcdist as hd
from hpcdist.device import backend
from hpcdist import nn, optim
from hpcdist.autograd import ops
from hpcdist.bench import shapes
from ..host.cli import Parser


# ---- MLP 784-128-10 ------------------------------------------------------------------------

def mlp_contenders(batch: int, lr: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=batch)
    nn.manual_seed(seed)
    model = nn.MLP([784, 128, 10])
    w1, b1, w2, b2 = (p.data.copy() for p in model.parameters())
    opt = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out = {}

    def hd_step():
        opt.zero_grad(lazy=True)                     # as the training loop zeroes
        loss = ops.cross_entropy(model(hd.tensor(x)), y)
        loss.backward()
        opt.step()
        return float(loss.data)
    out["hpcdist"] = hd_step

    # The floor: the same math written by hand in NumPy, one flat momentum buffer.
    params = [w1.copy(), b1.copy(), w2.copy(), b2.copy()]
    bufs = [None] * 4
    onehot = np.eye(10, dtype=np.float32)[y]

    def numpy_step():
        W1, B1, W2, B2 = params
        h_pre = x @ W1 + B1
        h = np.maximum(h_pre, 0)
        z = h @ W2 + B2
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        p = e / e.sum(axis=1, keepdims=True)
        loss = -np.log(p[np.arange(batch), y]).mean()
        dz = (p - onehot) / batch
        dW2, dB2 = h.T @ dz, dz.sum(0)
        dh = (dz @ W2.T) * (h_pre > 0)
        dW1, dB1 = x.T @ dh, dh.sum(0)
        for i, g in enumerate((dW1, dB1, dW2, dB2)):
            bufs[i] = g.copy() if bufs[i] is None else bufs[i] * 0.9 + g
            params[i] -= lr * bufs[i]
        return float(loss)
    out["numpy (floor)"] = numpy_step

    try:
        import torch
    except ImportError:
        return out
    tp = [torch.tensor(a.copy(), requires_grad=True) for a in (w1, b1, w2, b2)]
    topt = torch.optim.SGD(tp, lr=lr, momentum=0.9)
    tx, ty = torch.tensor(x), torch.tensor(y)

    def torch_step():
        topt.zero_grad()
        h = torch.relu(tx @ tp[0] + tp[1])
        loss = torch.nn.functional.cross_entropy(h @ tp[2] + tp[3], ty)
        loss.backward()
        topt.step()
        return loss.item()
    out["pytorch"] = torch_step
    return out


# ---- GPT -------------------------------------------------------------------------------------

def gpt_contenders(cfg, batch: int, lr: float, seed: int = 0, dtype: str = "float32"):
    """hpcdist's model (a GPTConfig's GPT, or a LlamaConfig's Llama) and its PyTorch twin (the
    same network written with torch ops on our parameter shapes), from the same weights, on
    the same batch, with AdamW."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, size=(batch, cfg.block_size))
    tgt = rng.integers(0, cfg.vocab_size, size=(batch, cfg.block_size))
    nn.manual_seed(seed)
    before = backend.default_float()
    backend.set_default_float(dtype)
    try:
        model = nn.FAMILIES[cfg.arch].model(cfg)
    finally:
        backend.set_default_float(before)
    sd = model.state_dict()
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = {}

    def hd_step():
        opt.zero_grad(lazy=True)                     # as the training loop zeroes
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        return float(loss.data)
    out["hpcdist"] = hd_step

    try:
        import torch
    except ImportError:
        return out
    # the peer a user picks: scaled_dot_product_attention, as nanoGPT (and torch_llama) has
    # it; GPT's twin with eager's math attention is an extra row
    twins = {"pytorch": lambda: torch_llama(cfg, sd, batch)} if cfg.arch == "llama" else \
        {"pytorch": lambda: torch_gpt(cfg, sd, batch, sdpa=True),
         "pytorch math": lambda: torch_gpt(cfg, sd, batch, sdpa=False)}
    tidx, ttgt = torch.tensor(idx), torch.tensor(tgt)
    for name, twin in twins.items():
        out[name] = _torch_step(torch, *twin(), tidx, ttgt, lr)
    return out


def _torch_step(torch, params: dict, forward_of, idx, tgt, lr: float):
    """One AdamW step of a PyTorch twin (its parameters, forward(idx, targets) -> loss)."""
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)

    def step():
        opt.zero_grad()
        loss = forward_of(idx, tgt)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def torch_gpt(cfg: nn.GPTConfig, sd: dict, batch: int, device: str = "cpu", sdpa=False,
              mm=None):
    """hpcdist's GPT written with torch ops on our parameter shapes (weights in x out):
    (parameters from the state dict ``sd``, forward(idx, targets) -> mean loss). Attention
    as eager's math path, or with ``sdpa`` as nanoGPT has it (the peer gpt_contenders times)
    (``scaled_dot_product_attention(is_causal=True)``). ``mm(x, w)``: the blocks' linear
    layers' product (default ``x @ w``; bench/float8_peer.py's for fp8), not the head's."""
    import torch
    mm = mm or torch.matmul
    F = torch.nn.functional
    p = {k: torch.tensor(v, requires_grad=True, device=device) for k, v in sd.items()}
    B, T, C, nh = batch, cfg.block_size, cfg.n_embd, cfg.n_head
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=device), 1)

    def forward(tidx, ttgt):
        x = p["wte.weight"][tidx] + p["wpe.weight"][:T]
        for i in range(cfg.n_layer):
            b = f"blocks.{i}."
            h = F.layer_norm(x, (C,), p[b + "ln_1.weight"], p[b + "ln_1.bias"])
            q, k, v = (mm(h, p[b + "attn.c_attn.weight"]) + p[b + "attn.c_attn.bias"]).split(C, 2)
            q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = ((q @ k.transpose(-2, -1)) / (C // nh) ** 0.5).masked_fill(
                    mask, float("-inf"))
                y = att.softmax(-1) @ v
            y = y.transpose(1, 2).reshape(B, T, C)
            x = x + mm(y, p[b + "attn.c_proj.weight"]) + p[b + "attn.c_proj.bias"]
            h = F.layer_norm(x, (C,), p[b + "ln_2.weight"], p[b + "ln_2.bias"])
            h = F.gelu(mm(h, p[b + "mlp.layers.0.weight"]) + p[b + "mlp.layers.0.bias"],
                       approximate="tanh")
            x = x + mm(h, p[b + "mlp.layers.1.weight"]) + p[b + "mlp.layers.1.bias"]
        x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"])
        return F.cross_entropy((x @ p["wte.weight"].T).reshape(-1, cfg.vocab_size),
                               ttgt.reshape(-1))
    return p, forward


def torch_llama(cfg, sd: dict, batch: int, device: str = "cpu", mm=None):
    """hpcdist's Llama written with torch ops on our parameter shapes, as torch_gpt is:
    RMSNorm, rotary embeddings (the half-split layout) on q and k, grouped-query attention
    (SDPA with the kv heads expanded), SwiGLU, an untied head; ``mm`` as torch_gpt's."""
    import torch
    mm = mm or torch.matmul
    F = torch.nn.functional
    p = {k: torch.tensor(v, requires_grad=True, device=device) for k, v in sd.items()}
    B, T, C, nh = batch, cfg.block_size, cfg.n_embd, cfg.n_head
    nkv, hd = cfg.kv_heads, C // nh
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = (a.to(p["embed_tokens.weight"].dtype).to(device) for a in (ang.cos(), ang.sin()))

    def rope(x):                                      # (B, H, T, hd)
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def forward(tidx, ttgt):
        x = p["embed_tokens.weight"][tidx]
        for i in range(cfg.n_layer):
            b = f"blocks.{i}."
            h = rms(x, p[b + "attn_norm.weight"])
            q, k, v = mm(h, p[b + "attn.qkv.weight"]).split([nh * hd, nkv * hd, nkv * hd], 2)
            q = rope(q.view(B, T, nh, hd).transpose(1, 2))
            k = rope(k.view(B, T, nkv, hd).transpose(1, 2)).repeat_interleave(nh // nkv, 1)
            v = v.view(B, T, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + mm(y.transpose(1, 2).reshape(B, T, C), p[b + "attn.proj.weight"])
            g, u = mm(rms(x, p[b + "mlp_norm.weight"]), p[b + "mlp.gate_up.weight"]).chunk(2, -1)
            x = x + mm(F.silu(g) * u, p[b + "mlp.down.weight"])
        x = rms(x, p["norm.weight"])
        head = p["lm_head.weight"] if "lm_head.weight" in p else p["embed_tokens.weight"].T
        return F.cross_entropy((x @ head).reshape(-1, cfg.vocab_size), ttgt.reshape(-1))
    return p, forward


# ---- per-op overhead ---------------------------------------------------------------------------

def op_overhead_us(iters: int = 20000) -> float:
    """Mean extra microseconds an hpcdist op costs over the bare NumPy call (forward, graph on)."""
    a = np.ones(4, np.float32)
    b = np.ones(4, np.float32)
    ta = hd.tensor(a, requires_grad=True)
    tb = hd.tensor(b, requires_grad=True)
    pairs = [(lambda: a + b, lambda: ta + tb), (lambda: a * b, lambda: ta * tb),
             (lambda: np.tanh(a), lambda: ta.tanh()), (lambda: a.sum(), lambda: ta.sum())]
    extra = []
    for raw, ours in pairs:
        t_raw = min(_time(raw, iters) for _ in range(3))
        t_ours = min(_time(ours, iters) for _ in range(3))
        extra.append((t_ours - t_raw) / iters * 1e6)
    return float(np.mean(extra))


def _time(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def run_table(title, contenders, steps, warmup, rounds: int = 5):
    """Median step time per contender, the contenders taking turns (``rounds`` rounds of
    ``steps / rounds`` steps each) so a shared machine's drift falls on all of them alike;
    the loss after ``warmup + steps`` steps."""
    times = {name: [] for name in contenders}
    losses = {name: None for name in contenders}
    for name, step in contenders.items():
        for _ in range(warmup):
            losses[name] = step()
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for name, step in contenders.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                losses[name] = step()
                times[name].append(time.perf_counter() - t0)
    rows = {name: (float(np.median(times[name])), losses[name]) for name in contenders}
    ref = rows.get("pytorch", (None,))[0]
    print(f"\n{title}")
    n = warmup + per_round * rounds
    print(f"{'':16s} {'step ms':>9s} {'vs pytorch':>11s} {'loss after ' + str(n):>17s}")
    for name, (t, loss) in rows.items():
        ratio = f"{t / ref:.2f}x" if ref else "n/a"
        print(f"{name:16s} {t * 1e3:9.3f} {ratio:>11s} {loss:17.6f}")
    return rows


def twin_agreement(cfg: nn.GPTConfig, batch: int, steps: int = 30) -> float | None:
    """Largest |loss difference| over ``steps`` training steps of hpcdist's GPT and its
    PyTorch twin in float64 (in float32 the two drift apart by rounding alone — PyTorch's own
    threaded reductions give a different loss run to run — so the model is checked in
    float64, where only a different network could differ by more than ~1e-12)."""
    c = gpt_contenders(cfg, batch, 1e-3, dtype="float64")
    if "pytorch" not in c:
        return None
    return max(abs(c["hpcdist"]() - c["pytorch"]()) for _ in range(steps))


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.bench autograd", description=__doc__)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per contender")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "1"),
                    help="threads per contender; with --shapes a list (1,2): each in turn")
    ap.add_argument("--shapes", nargs="?", const=shapes.DEFAULT, default=None,
                    help=f"GPT step at these shapes, LxC:T:vocab:batch,... (alone: "
                         f"{shapes.DEFAULT}) instead of the default tables")
    ap.add_argument("--profile", action="store_true",
                    help="with --shapes: where each step's time goes, side by side")
    ap.add_argument("--memory", action="store_true",
                    help="with --shapes: a step's peak bytes, CPU kernels and NumPy twins")
    ap.add_argument("--out", default="runs/bench_shapes.json", help="with --shapes: the table")
    ap.add_argument("--arch", default="gpt", choices=("gpt", "llama"),
                    help="with --shapes: the family (llama: a quarter of the heads kv heads)")
    ap.add_argument("--pool-ab", type=int, default=0, metavar="ROUNDS",
                    help="with --shapes: hpcdist with host/pool.py on and off in turn beside "
                         "PyTorch, ROUNDS rounds at each thread count (no table; numba's "
                         "threads stay OpenMP's in the off arm, as they started)")
    args = ap.parse_args(argv)
    counts = [int(n) for n in str(args.threads).split(",")]
    if args.shapes and args.pool_ab:
        for n in counts:
            shapes.pool_ab(args.shapes, n, args.pool_ab, gpt_contenders)
        return 0
    if args.shapes:
        from hpcdist.device.kernels import cpu
        print(f"autograd at training shapes | numpy {np.__version__} | CPU kernels "
              f"{cpu.describe()}")
        rows = shapes.run(args.shapes, counts, args.steps, args.warmup, args.profile,
                          args.memory, gpt_contenders=gpt_contenders, run_table=run_table,
                          out=args.out, arch=args.arch)
        if any("ratio" in r for r in rows):
            print(f"median hpcdist / pytorch over the table: {shapes.median_ratio(rows):.3f}")
        return 0
    args.threads = counts[0]
    try:
        import torch
        torch.set_num_threads(args.threads)
        tv = torch.__version__
    except ImportError:
        tv = "not installed (pip install torch==2.13.0 to compare)"
    print(f"autograd benchmark | threads {args.threads} | numpy {np.__version__} | torch {tv}")
    mlp = run_table("MLP 784-128-10, batch 64, SGD momentum",
                    mlp_contenders(64, 0.05), args.steps, args.warmup)
    from hpcdist.train import TrainConfig
    d = TrainConfig()
    cfg = nn.GPTConfig(block_size=2 * d.length - 1, vocab_size=d.num_digits, n_layer=d.n_layer,
                       n_head=d.n_head, n_embd=d.n_embd)
    gpt = run_table(f"GPT {cfg.n_layer}x{cfg.n_embd} (train.py default), batch {d.batch_size}, "
                    f"T {cfg.block_size}, AdamW", gpt_contenders(cfg, d.batch_size, 1e-3),
                    args.steps, args.warmup)
    print(f"\nTensor overhead over raw NumPy: {op_overhead_us():.2f} us per op (target <= 3)")
    for title, rows, target in (("MLP", mlp, 1.3), ("GPT", gpt, 1.0)):
        if "pytorch" in rows:
            r = rows["hpcdist"][0] / rows["pytorch"][0]
            dl = abs(rows["hpcdist"][1] - rows["pytorch"][1])
            print(f"{title}: hpcdist/pytorch = {r:.2f} (target <= {target}); "
                  f"|loss difference| in float32 = {dl:.2e}")
    agree = twin_agreement(cfg, d.batch_size)
    if agree is not None:
        print(f"GPT twin check: float64, 30 AdamW steps from the same weights: max |loss "
              f"difference| = {agree:.1e} (target <= 1e-6: the same model)")
    return 0
