"""``--cuda-graph``: a step recorded once as a CUDA graph (device/graphs.py) and replayed. One
data-parallel replica, or several over NCCL: the whole step is one graph (``GraphedStep``:
every micro-batch's forward and backward, the buckets' NCCL allreduces on the step's stream,
the fp32 master's gradient, clipping, and AdamW with its step count and learning rate on the
device, optim.DeviceSchedule). Several replicas over MPI: each micro-batch's forward and
backward (``GraphedForwardBackward``), the gradients averaged after it, the optimizer eager.
One graph per batch shape; batches are copied in, results copied out. ``--cuda-graph auto``
times the first steps both ways and keeps the faster (``AutoChoice``). What a graph cannot
hold is refused before the run (parallel/capabilities.py) or, under auto, run eagerly. On the
CPU the step runs as it is. The design: docs/gpu.md, "run/graphed.py"."""
from __future__ import annotations

import numpy as np

import time

from .. import optim
from ..device import backend, graphs
from ..parallel.capabilities import graph_problem


class GraphedForwardBackward:
    """``strategy.forward_backward(x, y, scale)`` replayed as a graph: host batches in,
    the loss (a device scalar the next replay overwrites) out."""

    def __init__(self, strategy, warmup: int = 2):
        self.strategy, self.warmup = strategy, warmup
        self.graphs: dict = {}        # (x's and y's shapes and dtypes, scale) ->
                                      # ([x, y] on the device, the captured step)

    def __call__(self, x, y, scale: float = 1.0):
        host = [np.asarray(x), np.asarray(y)]
        key = (_shapes(host), scale)
        entry = self.graphs.get(key)
        if entry is None:
            xd, yd = _device_copies(host)
            entry = self.graphs[key] = ([xd, yd], graphs.capture(
                lambda: self._forward_backward(xd, yd, scale), self.warmup))
        arrays, step = entry
        _copy_in(arrays, host)
        return step()

    def _forward_backward(self, x, y, scale):
        with self.strategy.ddp.no_sync():           # (the buckets: at sync, after backward)
            return self.strategy.forward_backward(x, y, scale)


class GraphedStep:
    """The whole step as one graph, on one data-parallel replica (``whole_step_problem``):
    host batches in, (loss, gradient norm) out as device scalars of their own."""

    def __init__(self, cfg, strategy, warmup: int = 2):
        self.strategy, self.opt, self.grad_clip = strategy, strategy.opt, cfg.grad_clip
        self.warmup = warmup
        self.opt.schedule = optim.DeviceSchedule(cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr)
        self.graphs: dict = {}        # the batches' shapes and dtypes -> (their device arrays,
                                      # the captured step)

    def __call__(self, batches):
        """One optimizer step over ``batches`` ([(x, y)] on the host, a micro-batch each)."""
        host = [np.asarray(a) for pair in batches for a in pair]     # x0, y0, x1, y1, ...
        key = _shapes(host)
        entry = self.graphs.get(key)
        if entry is None:
            arrays = _device_copies(host)
            pairs = list(zip(arrays[::2], arrays[1::2]))
            entry = self.graphs[key] = (arrays, graphs.capture(lambda: self._step(pairs),
                                                               self.warmup), {})
        arrays, step, sent = entry
        _copy_in(arrays, host)
        self.opt.schedule.sync(self.opt.step_count)
        comm, captures = self.strategy.comm, step.captures
        before = _calls(comm)
        loss, norm = step()
        if step.captures > captures:  # what the capture's Python counted, each replay sends
            sent.update(_calls_since(comm, before))
        if step.replayed:             # (the Python that counts the step ran only at capture)
            self.opt.step_count += 1
            if sent:
                _recount(comm, sent)
        self.opt.schedule.host_step = self.opt.step_count
        return loss.copy(), norm.copy()

    def _step(self, arrays):
        s, n = self.strategy, len(arrays)
        s.zero_grad()
        loss_sum = 0.0
        for micro, (x, y) in enumerate(arrays):
            with s.micro_context(micro == n - 1):
                loss_sum += s.forward_backward(x, y, 1.0 / n)
        s.sync()
        # (the learning rate passed is not read: AdamW reads the device's schedule)
        applied, norm = s.apply(0.0, self.grad_clip)
        return loss_sum / n, norm

    def close(self) -> None:
        """Back to the host's learning rate (the run goes on eagerly)."""
        self.opt.schedule = None
        self.graphs.clear()


def _calls(comm) -> dict:
    """The communicator's counts per kind of call ({kind: [calls, bytes]}; the NCCL
    backend's: a graph holds no MPI call)."""
    return {k: list(v) for k, v in getattr(comm, "calls", {}).items()}


def _calls_since(comm, before: dict) -> dict:
    now = _calls(comm)
    return {k: [n - before.get(k, [0, 0])[0], b - before.get(k, [0, 0])[1]]
            for k, (n, b) in now.items() if [n, b] != before.get(k, [0, 0])}


def _recount(comm, calls: dict) -> None:
    """Count ``calls`` ({kind: [calls, bytes]}) on the NCCL communicator once more: what a
    replay sends without the Python that counted it at the capture."""
    for kind, (n, nbytes) in calls.items():
        c = comm.calls.setdefault(kind, [0, 0])
        c[0] += n
        c[1] += nbytes
        comm.bytes_sent += nbytes


def _shapes(host) -> tuple:
    """A graph's key: the shapes and dtypes of the host arrays it reads."""
    return tuple((a.shape, a.dtype.str) for a in host)


def _device_copies(host) -> list:
    """Device arrays of their own for the graph to read (the batch is copied into them)."""
    return [backend.to_device(a).copy() for a in host]


def _copy_in(arrays, host) -> None:
    for d, h in zip(arrays, host):
        d.set(np.ascontiguousarray(h))


class AutoChoice:
    """``--cuda-graph auto``: the run's steps 2-3 eagerly and 6-7 replayed are timed (the
    device waited for at both ends of each), step 4 warms the graph up and step 5 captures
    it; from step 8 the faster runs, and the run says which with both times. A run a graph
    cannot hold runs eagerly and says why at the start."""
    EAGER, WARM, GRAPH = (2, 3), 4, (6, 7)  # the timed windows (first and last step of
                                            # each) and the graph's first (warm-up) step
    clock = staticmethod(time.perf_counter)

    def __init__(self, cfg, strategy):
        self.cfg, self.strategy = cfg, strategy
        self.k, self.t0, self.ms = 0, 0.0, {}
        self.graph = None
        self.why = "the CPU runs no graph" if backend.device_label() == "cpu" else \
            graph_problem(cfg)
        self.choice = "eager" if self.why else None     # None: still measuring

    def current(self):
        """What this step calls (forward_backward's answer)."""
        if self.choice == "graph" or (self.choice is None and self.k >= self.WARM):
            if self.graph is None:          # (kernels compiled and checked by the eager steps)
                self.graph = made(self.cfg, self.strategy, warmup=1)
            return self.graph
        return self.strategy.forward_backward

    def before_step(self) -> None:
        self.k += 1
        if self.choice is None and self.k in (self.EAGER[0], self.GRAPH[0]):
            backend.synchronize()
            self.t0 = self.clock()

    def after_step(self) -> str | None:
        """A line for the run's log when the choice is made."""
        if self.choice is not None or self.k not in (self.EAGER[1], self.GRAPH[1]):
            return None
        backend.synchronize()
        way, (first, last) = ("eager", self.EAGER) if self.k == self.EAGER[1] else \
            ("graph", self.GRAPH)
        self.ms[way] = (self.clock() - self.t0) * 1e3 / (last - first + 1)
        if way == "eager":
            return None
        self.choice = "graph" if self.ms["graph"] <= self.ms["eager"] else "eager"
        if self.choice == "eager":
            if isinstance(self.graph, GraphedStep):
                self.graph.close()
            self.graph = None
        return (f"--cuda-graph auto: {self.ms['eager']:.2f} ms a step eager, "
                f"{self.ms['graph']:.2f} ms replayed as a graph: {self.choice} from here on")


def made(cfg, strategy, warmup: int = 2):
    """The step's graph: the whole step (one replica) or each micro-batch's forward and
    backward."""
    if whole_step_problem(cfg, strategy) is None:
        return GraphedStep(cfg, strategy, warmup)
    return GraphedForwardBackward(strategy, warmup)


def whole_step_problem(cfg, strategy) -> str | None:
    """Why --cuda-graph cannot hold this run's whole step (None: it can)."""
    from ..parallel.strategy import DataParallelStrategy
    if not isinstance(strategy, DataParallelStrategy):
        return "the strategy runs its own optimizer step"
    if not _over_nccl(strategy.comm) and (not strategy.ddp.averages_nothing or
                                          strategy.batch_comm.size > 1):
        return ("gradients are averaged over MPI between backward and the optimizer "
                "(--backend nccl averages them inside the graph)")
    if strategy.grad_sum is not None or strategy.norm.comms:
        return "the gradient's sums or norm are added up over MPI"
    if not isinstance(strategy.opt, optim.AdamW):
        return f"--optimizer {cfg.optimizer} reads its learning rate on the host"
    if strategy.scaler.enabled:
        return "a loss scale is a host value"
    return None


def _over_nccl(comm) -> bool:
    """DDP's buckets go through NCCL on the step's stream, which a graph captures (NCCL 2.9
    and later; the GPU stand-in's NCCL records them)."""
    from ..comm.nccl import NcclCommunicator
    return isinstance(comm, NcclCommunicator)


def describe(cfg, strategy) -> str:
    """The header's words for --cuda-graph ("" without it)."""
    if cfg.cuda_graph == "off":
        return ""
    label = backend.device_label()
    if label == "cpu":
        return f"--cuda-graph {cfg.cuda_graph} has no effect on the cpu"
    choice = auto(cfg, strategy)
    if choice is not None and choice.why:
        return f"--cuda-graph auto: eager ({choice.why})"
    where = " (the GPU stand-in: it replays the launches it recorded)" * (label == "standin")
    why = whole_step_problem(cfg, strategy)
    way = (f"the whole step replayed as one CUDA graph{where}: forward, backward, clipping "
           "and AdamW, its learning rate on the device" if why is None else
           f"forward and backward replayed as CUDA graphs{where}, the optimizer eager ({why})")
    if cfg.cuda_graph == "auto":
        return (f"--cuda-graph auto: steps {AutoChoice.EAGER[0]}-{AutoChoice.EAGER[1]} eager "
                f"and {AutoChoice.GRAPH[0]}-{AutoChoice.GRAPH[1]} as a graph timed, the faster "
                f"kept; the graph: {way}")
    return way


def auto(cfg, strategy) -> AutoChoice | None:
    """The run's ``AutoChoice`` under --cuda-graph auto (None otherwise), made once."""
    if cfg.cuda_graph != "auto":
        return None
    choice = getattr(strategy, "graph_choice", None)
    if choice is None:
        choice = strategy.graph_choice = AutoChoice(cfg, strategy)
    return choice


def forward_backward(cfg, strategy):
    """What a step calls: the strategy's forward and backward for each micro-batch, its
    graph (--cuda-graph), or the whole step's (``GraphedStep``), made once per strategy;
    under auto, the way being timed or chosen."""
    if cfg.cuda_graph == "off" or backend.device_label() == "cpu":
        return strategy.forward_backward
    if cfg.cuda_graph == "auto":
        return auto(cfg, strategy).current()
    graphed = getattr(strategy, "graphed", None)
    if graphed is None:
        graphed = strategy.graphed = made(cfg, strategy)
    return graphed
