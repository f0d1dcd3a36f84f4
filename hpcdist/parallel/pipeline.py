"""Pipeline parallelism: the model split into stages, and the executor that walks a schedule.

The layers of the one logical model are split over P ranks x v chunks (virtual stages, k =
chunk * P + rank): embeddings with the first virtual stage, final norm and head with the
last. Every rank builds its schedule (parallel/schedules.py), annotates each send and
receive with the shape it will carry, and verifies the whole schedule — every stage's list —
before any micro-batch moves. The executor only walks this rank's list — the list goes on in
docs/pipeline-parallel.md, "hpcdist/parallel/pipeline.py"."""
from __future__ import annotations

import time

import numpy as np

from ..device import backend
from ..host import timeline
from ..comm.p2p import MAX_TAG
from ..nn.module import Module
from ..autograd.tensor import Tensor, split_backward, weight_gradients
from . import schedules as S
from .base import Strategy, delegate
from ..nn.moe import loss_multiplier


class _Blocks(Module):
    """Blocks of the full model under their own indices (names stay "blocks.<i>...")."""

    def __init__(self, blocks: dict):
        for i, b in blocks.items():
            setattr(self, str(i), b)
        self.order = sorted(blocks)

    def __iter__(self):
        return (getattr(self, str(i)) for i in self.order)


FIRST, LAST = ("tokens", "positions"), ("norm", "head")     # a model's parts by role


class PipelineChunk(Module):
    """Virtual stage k of K: this chunk's blocks, plus the embeddings (k = 0) or the final
    norm and head (k = K - 1), found by role (``DecoderLM.part``) and held under the model's
    own names. ``model`` is a family's DecoderLM, cut for other dimensions or not (``seq``:
    its parallel.sequence.Sequence, told the length of each micro-batch)."""

    def __init__(self, model, k: int, K: int, layers: tuple[int, int], seq=None):
        self._model = (model,)                 # a tuple: not a child (its parameters are not ours)
        self.seq = seq
        self.first, self.last = k == 0, k == K - 1
        roles = (FIRST if self.first else ()) + (LAST if self.last else ())
        if self.last and not self.first and model.part("head") is None:
            roles += ("tokens",)               # the tied head: a copy of the first stage's table
        for role in roles:
            if model.part(role) is not None:
                setattr(self, model.PARTS[role], model.part(role))
        self.tied = self.last and not self.first and model.part("head") is None
        self.tokens = model.PARTS["tokens"]
        self.blocks = _Blocks({i: model.blocks[i] for i in range(*layers)})

    def forward(self, x, idx, targets, T: int):
        model = self._model[0]
        if self.seq is not None:
            self.seq.begin(T)
        if self.first:
            x = model.embed(idx)
        pos = model.layout(idx)
        for block in self.blocks:
            x = model.run_block(block, x, pos)
        if self.last:                          # (logits, loss)
            return model.head(x, targets)
        return x

    def table(self):
        """The token table this chunk holds (the first's own, the last's tied copy), or None."""
        return getattr(self, self.tokens, None) if self.first or self.tied else None


class PipelineModel(Module):
    """This rank's chunks (one, or v when interleaving); parameters named as in the full model."""

    def __init__(self, model, rank: int, P: int, v: int, bounds, seq=None):
        K = P * v
        self.config = model.config
        self.chunks = [PipelineChunk(model, c * P + rank, K, bounds[c * P + rank], seq)
                       for c in range(v)]
        self.full, self.seq = model, seq
        self.strategy = None                   # the PipelineStrategy that runs it (evaluation)

    def forward(self, idx, targets=None):
        """Evaluation (no gradients): the batch through every stage; (logits, loss) on every
        rank. Training goes through ``PipelineStrategy.forward_backward``."""
        logits, loss = self.strategy.evaluate_batch(idx, targets)
        return Tensor(logits), Tensor(np.asarray(loss))

    def _children(self):
        for chunk in self.chunks:
            yield from chunk._children()

    def train(self, mode: bool = True):
        self.full.train(mode)                  # the model the chunks call into (head, embed)
        for chunk in self.chunks:
            chunk.train(mode)
        self.training = mode
        return self

    def copies(self) -> set:
        """The tied table a last chunk holds for the head: the first stage's is the one."""
        return {id(c.table().weight) for c in self.chunks if c.tied}

    def declared_kinds(self) -> dict:
        return self.full.declared_kinds()

    def named_specs(self):
        specs = {id(p): spec for _, p, spec in self.full.named_specs()}
        return [(n, p, specs.get(id(p))) for n, p in self.named_parameters()]


class _Batch:
    """One batch's state while the executor walks the schedule."""

    def __init__(self, x, y, parts, weights, scale, T):
        self.x, self.y, self.parts, self.weights, self.scale, self.T = x, y, parts, weights, \
            scale, T
        self.stash: dict = {}        # (mb, chunk) -> (input tensor, output) until sent back
        self.received: dict = {}     # ("ACT" | "GRAD", mb, chunk) -> array
        self.deferred: dict = {}     # (mb, chunk) -> what its W pass needs
        self.sends: list = []
        self.loss = 0.0


@delegate("inner", ("zero_grad", "micro_context", "scale_loss", "apply", "eval_context",
                   "memory", "peak_memory", "full_parameters", "flat_state", "optimizer",
                   "loaded", "compression", "holds_state"))
class PipelineStrategy(Strategy):
    """The pipeline strategy: an inner DataParallelStrategy or Zero (ZeRO-1) over this rank's
    parameters, plus the schedule executor. Same interface as every strategy: the step's
    forward and backward are the schedule's, the gradient sync adds the tied embedding's,
    everything else is the inner strategy's."""

    def __init__(self, inner, pmodel: PipelineModel, mesh, name: str, m: int, v: int,
                 *, embed_comm=None):
        self.inner, self.model, self.mesh = inner, pmodel, mesh
        self.pp = mesh.pp_comm
        self.P, self.m, self.v, self.name = mesh.pp, m, v, name
        self.dp_comm, self.comm, self.scaler = inner.dp_comm, inner.comm, inner.scaler
        self.embed_comm = embed_comm
        if 2 * self.P * v * m > MAX_TAG:
            raise ValueError(f"pp x virtual stages x micro-batches = {self.P * v * m} is too "
                             f"many messages to tag (at most {MAX_TAG // 2})")
        self.recipe = S.get(name)      # the registry's record: generator, stash bound, replan
        self.schedule = S.make(name, self.P, m, v)
        self.peak_stash = 0
        # activations and their gradients travel in the compute precision (the parameters'
        # dtype once the inner strategy made its compute copies: bf16, fp16, fp32 or fp64)
        self.act_dtype = next(iter(pmodel.parameters())).data.dtype
        pmodel.strategy = self
        # A schedule that replans (ZB-H1) is planned with equal op times until
        # ``recipe.replan_after`` steps were measured, then again from the measured times,
        # agreed over the pipeline (so every stage gets one plan)
        self.steps_done, self.times = 0, {"F": [], "I": [], "W": [], "B": []}
        self._verified = {}            # (micro-batch sizes, T) -> this schedule, verified

    # -- the strategy interface: the inner strategy's (``delegate``), but for these -------

    def close(self) -> None:
        """The tied embedding's communicator, then the mesh's (Strategy.close)."""
        if self.embed_comm is not None:
            self.embed_comm.close()
            self.embed_comm = None
        super().close()

    def describe(self) -> list[str]:
        inner = self.inner.describe()
        virtual = f", {self.v} virtual stages" if self.v > 1 else ""
        return [f"{inner[0]} | {self.name}, {self.m} micro-batches{virtual}"] + inner[1:]

    def sync(self):
        table = (self.model.chunks[0] if self.model.chunks[0].first else
                 self.model.chunks[-1]).table() if self.embed_comm is not None else None
        if table is not None and self.embed_comm.size > 1 and table.weight.requires_grad:
            g = table.weight.grad                                     # (tied; LoRA: frozen)
            self.embed_comm.allreduce(g, out=g)
        self.inner.sync()

    # -- the executor ------------------------------------------------------------------------
    def _shapes(self, sizes, T: int):
        """The activation shape each micro-batch carries between stages on this rank."""
        cfg, seq = self.model.config, self.model.seq
        rows = T
        if seq is not None:                    # this rank's positions of the sequence
            seq.begin(T)
            rows = len(seq.positions(np.arange(T)))
        return [(int(b), rows, cfg.n_embd) for b in sizes]

    def verified_schedule(self, sizes, T):
        """The schedule with every send and receive annotated with its shape, verified (once
        per batch shape: the sizes and the schedule do not change between steps)."""
        key = (tuple(sizes), T)
        if key not in self._verified:
            self._verified[key] = self._annotate_and_verify(sizes, T)
        return self._verified[key]

    def _annotate_and_verify(self, sizes, T):
        shapes = self._shapes(sizes, T)
        sched = [[S.Action(a.kind, a.mb, a.chunk, tuple(
            S.Op(o.kind, o.what, o.mb, o.chunk, o.peer, shapes[o.mb]) for o in a.ops))
            for a in stage] for stage in self.schedule]
        S.verify(sched, self.P, self.m, self.v,
                 stash_limit=self.recipe.stash(self.P, self.m, self.v))
        return sched

    def _tag(self, op: S.Op) -> int:
        src, dst, what, mb, k = S.message_key(op, self.pp.rank, self.P, self.v)
        return (k * self.m + mb) * 2 + (what == "GRAD")

    def forward_backward(self, x, y, scale: float = 1.0) -> float:
        """One batch through the pipeline, forward and backward; returns the batch's mean loss
        (the same on every rank)."""
        m, T = self.m, x.shape[1]
        if len(x) < m:
            raise ValueError(f"--batch-size {len(x)} cannot be split into {m} micro-batches: "
                             "use at least as many sequences as micro-batches")
        parts = np.array_split(np.arange(len(x)), m)
        scored = np.array([int((y[p] != -100).sum()) for p in parts], dtype=np.float64)
        batch = _Batch(x, y, parts, scored / max(scored.sum(), 1.0), scale, T)
        for a in self.verified_schedule([len(p) for p in parts], T)[self.pp.rank]:
            label = "COMM" if a.kind == "COMM" else f"{a.kind}{a.mb}" + (
                f".{a.chunk}" if self.v > 1 else "")
            with timeline.span(label, cat="pipeline", kind=a.kind, mb=a.mb, chunk=a.chunk,
                               ops=[str(o) for o in a.ops] if a.ops else None):
                if a.kind == "COMM":
                    self._communicate(a, batch)
                elif self.recipe.replan and self.steps_done < self.recipe.replan_after:
                    t0 = time.perf_counter()
                    self._compute(a, batch)
                    self.times[a.kind].append(time.perf_counter() - t0)
                else:
                    self._compute(a, batch)
        for h in batch.sends:
            h.wait()
        if batch.stash:
            raise RuntimeError(f"pipeline stage {self.pp.rank}: micro-batches "
                               f"{sorted(batch.stash)} were never sent back")
        last = (self.P * self.v - 1) % self.P      # the loss lives on the last stage
        loss = float(self.pp.allreduce(np.array([batch.loss if self.pp.rank == last
                                                 else 0.0]))[0])
        self.steps_done += 1
        if self.recipe.replan and self.steps_done == self.recipe.replan_after:
            self._replan()
        return loss

    def _replan(self) -> None:
        """The schedule again from the op times measured in the first steps (mean over the
        stages)."""
        med = np.array([np.median(self.times[k]) if self.times[k] else 0.0
                        for k in ("F", "I", "W")])
        med = self.pp.allreduce(med, op="avg")       # bitwise the same on every stage
        self.schedule = S.make(self.name, self.P, self.m, self.v,
                               dict(zip(("F", "I", "W"), (float(x) for x in med))))
        self._verified.clear()                      # the new plan is verified before it runs

    def _communicate(self, a, batch) -> None:
        """Post the action's sends (waited at the end of the step) and receives; wait for the
        receives and check each brought the shape the schedule says."""
        xp = backend.xp()
        recvs = []
        for op in a.ops:
            key = (op.mb, op.chunk)
            if op.kind == "SEND":
                inp, out = batch.stash[key]
                data = out.data if op.what == "ACT" else inp.grad
                batch.sends.append(self.pp.isend(xp.ascontiguousarray(data, self.act_dtype),
                                                 op.peer, self._tag(op)))
                if op.what == "GRAD":                 # the micro-batch is done on this stage
                    del batch.stash[key]
            else:
                recvs.append((op, self.pp.irecv(op.peer, self._tag(op), shape=op.shape,
                                                dtype=self.act_dtype)))
        for op, h in recvs:
            arr = h.wait()
            if tuple(arr.shape) != op.shape:
                raise ValueError(f"pipeline stage {self.pp.rank}: {op} brought shape "
                                 f"{tuple(arr.shape)}, expected {op.shape}")
            batch.received[(op.what, op.mb, op.chunk)] = arr

    def _compute(self, a, batch) -> None:
        """F, B, I or W of one micro-batch through one of this rank's chunks."""
        xp = backend.xp()
        key, K = (a.mb, a.chunk), self.P * self.v
        k = a.chunk * self.P + self.pp.rank             # the virtual stage
        if a.kind == "F":
            inp = None if k == 0 else Tensor(batch.received.pop(("ACT",) + key),
                                             requires_grad=True)
            rows = batch.parts[a.mb]
            out = self.model.chunks[a.chunk](inp, xp.asarray(batch.x[rows]),
                                             xp.asarray(batch.y[rows]), batch.T)
            if k == K - 1:                              # the loss, weighted by its share
                w = batch.weights[a.mb]
                batch.loss += float(out[1].data) * w
                out = self.inner.scale_loss(out[1] * float(w * batch.scale))
            batch.stash[key] = (inp, out)
            self.peak_stash = max(self.peak_stash, len(batch.stash))
        else:                                           # B, I or W: MoE's auxiliary losses
            weight = float(batch.weights[a.mb] * batch.scale)     # get this micro-batch's
            with loss_multiplier(self.multiplier(weight)):        # multiplier
                if a.kind == "W":
                    weight_gradients(batch.deferred.pop(key))
                else:
                    self._backward(a, batch, key, k, K)

    def _backward(self, a, batch, key, k: int, K: int) -> None:
        """B or I of one micro-batch through one chunk (I: the weight gradients wait)."""
        inp, out = batch.stash[key]
        seed = None if k == K - 1 else batch.received.pop(("GRAD",) + key)
        if seed is not None and seed.dtype != out.data.dtype:   # sent in compute precision
            seed = seed.astype(out.data.dtype)
        if a.kind == "I":                               # weight gradients wait for W
            batch.deferred[key] = []
            with split_backward(batch.deferred[key]):
                out.backward(seed)
        else:
            out.backward(seed)
        if k == 0:                                      # nothing to send back
            del batch.stash[key]
        else:
            batch.stash[key] = (inp, None)              # the output is no longer needed

    def evaluate_batch(self, x, y):
        """Forward only, no schedule: (logits, mean loss), the same on every rank."""
        xp = backend.xp()
        T, K = x.shape[1], self.P * self.v
        last = (K - 1) % self.P
        act, logits, loss = None, None, 0.0
        for k in range(K):
            owner, c = k % self.P, k // self.P
            if owner != self.pp.rank:
                continue
            if k > 0:
                act = self.pp.recv((k - 1) % self.P, tag=MAX_TAG - 1)
            out = self.model.chunks[c](None if k == 0 else Tensor(act), xp.asarray(x),
                                       xp.asarray(y), T)
            if k < K - 1:
                self.pp.send(xp.ascontiguousarray(out.data), (k + 1) % self.P, tag=MAX_TAG - 1)
            else:
                logits = xp.ascontiguousarray(out[0].data, backend.default_float())
                loss = float(out[1].data)
        if logits is None:
            logits = xp.empty(tuple(x.shape) + (self.model.config.vocab_size,),
                              dtype=backend.default_float())
        self.pp.bcast(logits, root=last)
        loss = float(self.pp.allreduce(np.array([loss if self.pp.rank == last else 0.0]))[0])
        return logits, loss
