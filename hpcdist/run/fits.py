"""Whether the model's state fits before any of it is allocated: parameters, gradients and
AdamW's two moments per rank (the family's count of its parameters, nn/<family>.py, split by
TP and PP, sharded by ZeRO), times the ranks on this host, against the memory the host has
available (or, on a GPU, the device's free memory). Activations come on top, so a refusal
here is certain; a pass is not a promise. One line, before ``--n-embd 100000`` asks NumPy
for 224 GiB."""
from __future__ import annotations

from ..host.layout import Layout
from ..host.meminfo import host_available

GiB = 2 ** 30


def state_bytes(cfg, world: int, vocab: int, seq: int) -> float:
    """Bytes of parameters, gradients and optimizer state one rank holds."""
    from .. import nn
    declared = nn.config_of(cfg, vocab_size=vocab, block_size=seq, vocab_multiple=1)
    n = declared.parameters() / (cfg.tp * cfg.pp)
    word = 8 if cfg.dtype == "fp64" else 4
    dp = max(1, Layout.of(cfg, world).replicas)
    moments = 2 if cfg.optimizer == "adamw" else 1
    params, grads, optimizer = n * word, n * word, moments * n * word
    zero = cfg.zero if cfg.strategy == "collective" else 0
    optimizer /= dp if zero >= 1 else 1
    grads /= dp if zero >= 2 else 1
    params /= dp if zero >= 3 else 1
    return params + grads + optimizer


def problem(cfg, world: int, ranks_here: int, vocab: int, seq: int,
            device_free: float | None = None) -> str | None:
    """One line where the state cannot fit (None: it may)."""
    need = state_bytes(cfg, world, vocab, seq)
    hint = ("use --zero 3, --tp or --pp, fewer ranks per host, or a smaller model "
            "(python -m hpcdist.plan estimates a layout)")
    if device_free is not None:
        if need > device_free:
            return (f"the model's parameters, gradients and optimizer state need "
                    f"{need / GiB:.1f} GiB on each GPU and {device_free / GiB:.1f} GiB is "
                    f"free there: {hint}")
        return None
    free = host_available()
    if free is not None and need * ranks_here > free:
        return (f"the model's parameters, gradients and optimizer state need "
                f"{need / GiB:.1f} GiB a rank, {need * ranks_here / GiB:.1f} GiB for the "
                f"{ranks_here} rank(s) on this host, and {free / GiB:.1f} GiB is available: "
                f"{hint}")
    return None
