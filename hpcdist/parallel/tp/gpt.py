"""A tensor-parallel GPT: the one model of ``nn.GPT(cfg)``, each rank holding its shards.

Attention heads and the MLP's hidden width are split over the tensor-parallel group; the token
embedding (and an untied output head) over the vocabulary; LayerNorms, position embeddings and
the biases of row-parallel layers are replicated. Parameter names are those of ``nn.GPT``, so
a checkpoint maps one-to-one, and ``shard_spec`` says how each was cut.

The rest of this design: docs/tensor-parallel.md, "hpcdist/parallel/tp/gpt.py"."""
from __future__ import annotations

from ...device import backend
from ...nn.gpt import attention, cached_length
from ...nn.layers import Dropout, LayerNorm
from ...nn.module import Module, ModuleList, Parameter
from ...autograd.recompute import checkpoint
from ...autograd.tensor import Tensor
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     vocab_parallel_cross_entropy)
from .mappings import copy_to_tp, gather_from_sp, sequence_bounds, _allgather_last


def check_divisible(cfg, tp: int) -> None:
    """Raise ValueError when ``cfg`` cannot be split ``tp`` ways: tp must divide n_head (then
    n_embd and the MLP width, multiples of it, split too)."""
    if cfg.n_head % tp:
        divisors = [d for d in range(1, cfg.n_head + 1) if cfg.n_head % d == 0]
        raise ValueError(f"tensor-parallel size {tp} must divide n_head ({cfg.n_head}); "
                         f"choose one of {', '.join(map(str, divisors))}")


def _copy_replicated(layer_norm: LayerNorm) -> LayerNorm:
    ln = LayerNorm.__new__(LayerNorm)
    ln.weight = Parameter(layer_norm.weight.data.copy())
    ln.bias = Parameter(layer_norm.bias.data.copy()) if layer_norm.bias is not None else None
    ln.eps = layer_norm.eps
    ln.shard_spec = {"weight": None, "bias": None}
    return ln


class ParallelAttention(Module):
    """Causal self-attention with this rank's n_head / tp heads."""

    cp = None                       # a ContextParallel group (parallel/context.py), if any

    def __init__(self, attn, cfg, comm, sp: bool):
        self.c_attn = ColumnParallelLinear(attn.c_attn.weight.data,
                                           attn.c_attn.bias.data if attn.c_attn.bias else None,
                                           comm, pieces=3, sequence_parallel=sp)
        self.c_proj = RowParallelLinear(attn.c_proj.weight.data,
                                        attn.c_proj.bias.data if attn.c_proj.bias else None,
                                        comm, sequence_parallel=sp)
        self.attn_drop, self.resid_drop = Dropout(cfg.dropout), Dropout(cfg.dropout)
        self.n_head = cfg.n_head // comm.size
        self.causal_mask = attn.causal_mask

    def forward(self, x: Tensor, T: int, cache: dict | None = None) -> Tensor:
        qkv = self.c_attn(x, T)                                     # (B, T, 3C/tp): q|k|v
        y = attention(qkv, self.n_head, self.causal_mask, self.attn_drop, cache, self.cp)
        return self.resid_drop(self.c_proj(y))                     # (B, T or T/tp, C)


class ParallelMLP(Module):
    """Column-parallel fc (4C split), GELU, row-parallel projection."""

    def __init__(self, mlp, comm, sp: bool):
        fc, proj = mlp.layers
        self.layers = ModuleList([
            ColumnParallelLinear(fc.weight.data, fc.bias.data if fc.bias else None, comm,
                                 sequence_parallel=sp),
            RowParallelLinear(proj.weight.data, proj.bias.data if proj.bias else None, comm,
                              sequence_parallel=sp)])
        self.act, self.drop = mlp.act, Dropout(mlp.drop.p)

    def forward(self, x: Tensor, T: int) -> Tensor:
        return self.drop(self.layers[1](self.act(self.layers[0](x, T))))


class ParallelBlock(Module):
    def __init__(self, block, cfg, comm, sp: bool):
        self.ln_1 = _copy_replicated(block.ln_1)
        self.attn = ParallelAttention(block.attn, cfg, comm, sp)
        self.ln_2 = _copy_replicated(block.ln_2)
        self.mlp = ParallelMLP(block.mlp, comm, sp)
        self.T = None

    def forward(self, x: Tensor, cache: dict | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), self.T, cache)
        return x + self.mlp(self.ln_2(x), self.T)


class TensorParallelGPT(Module):
    """``nn.GPT`` split over the tensor-parallel communicator ``comm``; same forward contract:
    ``model(idx, targets) -> (logits, loss)``. In training the logits are this rank's
    vocabulary slice (the full logits never exist on one rank); in eval mode they are
    gathered (trimmed to the vocabulary) for the caller's argmax."""

    cp = None                       # a ContextParallel group: each rank a slice of a sequence

    def __init__(self, full, comm, sequence_parallel: bool = False):
        cfg = full.config
        check_divisible(cfg, comm.size)
        self.config, self.comm, self.sp = cfg, comm, sequence_parallel
        # the one model's shapes: a checkpoint names tensors by them (reshard.py)
        self.logical_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
        self.wte = VocabParallelEmbedding(full.wte.weight.data, comm, sequence_parallel)
        self.wpe = full.wpe
        self.wpe.shard_spec = {"weight": None}
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([ParallelBlock(b, cfg, comm, sequence_parallel)
                                  for b in full.blocks])
        self.ln_f = _copy_replicated(full.ln_f)
        self.lm_head = None if full.lm_head is None else ColumnParallelLinear(
            _pad_columns(full.lm_head.weight.data, comm.size), None, comm,
            sequence_parallel=sequence_parallel)

    def forward(self, idx, targets=None, ignore_index: int = -100, cache=None):
        """As ``nn.GPT``'s; ``cache``: a KV cache per block (inference, without sequence
        parallelism: each rank caches its own heads' keys and values)."""
        if isinstance(idx, Tensor):
            idx = idx.data
        if cache is not None:
            if self.sp:
                raise ValueError("sampling with a KV cache runs without sequence parallelism")
            x = self.embed(idx, cached_length(cache))
            for block, layer_cache in zip(self.blocks, cache):
                block.T = idx.shape[1]
                x = block(x, layer_cache)
            return self.head(x, targets, ignore_index, idx.shape[1])
        x = self.embed(idx)                                          # (B, T or T/tp, C)
        for block in self.blocks:
            x = self.run_block(block, x, idx.shape[1])
        return self.head(x, targets, ignore_index, idx.shape[1])

    # The pieces a pipeline stage runs (parallel/pipeline.py): embed, blocks, head.
    def embed(self, idx, past: int = 0) -> Tensor:
        B, T = idx.shape
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size "
                             f"{self.config.block_size}")
        if self.cp is not None:                                      # this rank's tokens
            idx, pos = self.cp.take(idx)
            T = idx.shape[1]
        else:
            pos = backend.array_module(idx).arange(past, past + T)
        lo, hi = sequence_bounds(T, self.comm.size, self.comm.rank) if self.sp else (0, T)
        return self.drop(self.wte(idx) + self.wpe(pos[lo:hi]))

    def run_block(self, block, x: Tensor, T: int) -> Tensor:
        block.T = T if self.cp is None else self.cp.local_length(T)
        recompute = self.config.checkpoint_activations and self.training
        return checkpoint(block, x) if recompute else block(x)

    def head(self, x: Tensor, targets=None, ignore_index: int = -100, T: int | None = None):
        x = self.ln_f(x)
        full_targets = targets
        if self.cp is not None:                  # this rank's positions of the sequence
            T = self.cp.local_length(T) if T is not None else len(self.cp.positions())
            targets = None if targets is None else self.cp.local_targets(targets)
        if T is None:
            T = x.shape[1] if not self.sp else None
        if self.lm_head is None:                                     # tied: wte's rows
            x = gather_from_sp(x, T, self.comm) if self.sp else copy_to_tp(x, self.comm)
            logits = x @ self.wte.weight.T                           # (B, T, Vp/tp)
        else:
            logits = self.lm_head(x, T)
        loss = None if targets is None else vocab_parallel_cross_entropy(
            logits, targets, self.comm, self.wte.lo, self.config.vocab_size, ignore_index)
        if not self.training or targets is None:
            logits = Tensor(_allgather_last(logits.data, self.comm)[..., :self.config.vocab_size])
        if self.cp is not None:
            return self.cp.finish(logits, loss, full_targets, ignore_index, self.training)
        return logits if targets is None else (logits, loss)

    # ---- which parameters are what -----------------------------------------------------
    def named_specs(self):
        """(name, parameter, spec) for every parameter, in ``parameters()`` order: spec is
        (axis, pieces) for a shard, None for a replicated parameter."""
        spec = {}
        for m in self.modules():
            for name, s in getattr(m, "shard_spec", {}).items():
                if getattr(m, name, None) is not None:
                    spec[id(getattr(m, name))] = s
        return [(n, p, spec.get(id(p))) for n, p in self.named_parameters()]

    def sequence_parallel_params(self):
        """Replicated parameters whose gradient is partial under sequence parallelism (they
        see only this rank's sequence rows): LayerNorms, row-parallel biases, position table."""
        if not self.sp:
            return []
        return [p for _, p, spec in self.named_specs() if spec is None]


def _pad_columns(weight, world):
    xp = backend.array_module(weight)
    C, V = weight.shape
    Vp = -(-V // world) * world
    full = xp.zeros((C, Vp), dtype=weight.dtype)
    full[:, :V] = weight
    return full
