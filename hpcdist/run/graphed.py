"""``--cuda-graph``: each micro-batch's forward and backward recorded once as a CUDA graph
(device/graphs.py) and replayed, one graph per batch shape. The batch is copied into arrays
the graph reads; DDP averages the gradients after backward (``sync``), not from its hooks
during it: MPI inside a graph cannot be. What a graph cannot hold is refused before the run
(parallel/capabilities.py, ``CUDA_GRAPH``). On the CPU the step runs as it is."""
from __future__ import annotations

import numpy as np

from ..device import backend, graphs


class GraphedForwardBackward:
    """``strategy.forward_backward(x, y, scale)`` replayed as a graph: host batches in,
    the loss (a device scalar the next replay overwrites) out."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.graphs: dict = {}        # (x's and y's shapes and dtypes, scale) ->
                                      # (x, y on the device, the captured step)

    def __call__(self, x, y, scale: float = 1.0):
        x, y = np.asarray(x), np.asarray(y)
        key = (x.shape, x.dtype.str, y.shape, y.dtype.str, scale)
        entry = self.graphs.get(key)
        if entry is None:
            xd, yd = backend.to_device(x).copy(), backend.to_device(y).copy()
            entry = self.graphs[key] = (xd, yd, graphs.capture(
                lambda: self._forward_backward(xd, yd, scale)))
        xd, yd, step = entry
        xd.set(np.ascontiguousarray(x))
        yd.set(np.ascontiguousarray(y))
        return step()

    def _forward_backward(self, x, y, scale):
        with self.strategy.ddp.no_sync():           # (the buckets: at sync, after backward)
            return self.strategy.forward_backward(x, y, scale)


def describe(cfg) -> str:
    """The header's words for --cuda-graph ("" without it)."""
    if not cfg.cuda_graph:
        return ""
    return {"cpu": "--cuda-graph has no effect on the cpu",
            "standin": "CUDA graphs (the GPU stand-in captures at every micro-batch and "
                      "refuses what a GPU's capture would)"}.get(
        backend.device_label(), "forward and backward replayed as CUDA graphs (captured at "
                                "each batch shape's third micro-batch; gradients averaged "
                                "after backward)")


def forward_backward(cfg, strategy):
    """What a step calls for each micro-batch: the strategy's, or its graph (--cuda-graph),
    made once per strategy."""
    if not cfg.cuda_graph or backend.device_label() == "cpu":
        return strategy.forward_backward
    graphed = getattr(strategy, "graphed", None)
    if graphed is None:
        graphed = strategy.graphed = GraphedForwardBackward(strategy)
    return graphed
