"""The CPU path of the fused ops: numba kernels (cpu_jit.py) behind the same calls as the twins.

``Fused.__call__`` takes one when numba imports, the op's first array has ``MIN_SIZE``
elements or more (smaller: the twin is as fast), its dtype is float32/float64, and it passed
the self-check against its twin (the GPU's cases). Each returns what the twin returns; what a
twin keeps for its backward (GELU's tanh, LayerNorm's x-hat, attention's probabilities) the
kernel does not: its backward recomputes it, as the GPU's does. The kernels run on the
threads hpcdist gives a rank (host/threads.py), never more: a rank of one thread runs them
serially. Attention: cpu_attention.py; experts: cpu_moe.py; the optimizer: cpu_flat.py.
HPCDIST_CPU_KERNELS=0 turns them off, HPCDIST_CPU_KERNELS_MIN sets the size. The rest:
docs/autograd.md, "At the shapes people train"."""
from __future__ import annotations

import importlib
import itertools
import os

import numpy as np

from ...host import blas, pool, threads
from .. import fused
from .common import GELU_C, ROW_BLOCK
from .layernorm import added_into

MIN_SIZE = int(os.environ.get("HPCDIST_CPU_KERNELS_MIN", str(1 << 15)))
ATTENTION_BYTES = 4 << 20          # scores held at once by causal attention (4 MiB: ~L2)
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_jit = None                        # cpu_jit once imported
_why_not = None                    # why numba is not used, once known
_threads = 0                       # the thread count last given to numba


def on() -> bool:
    return os.environ.get("HPCDIST_CPU_KERNELS", "1") != "0" and _why_not is None


def wanted(a) -> bool:
    """Whether the CPU kernel should take an op whose first array is ``a``."""
    return a.size >= MIN_SIZE and a.dtype in DTYPES and on() and isinstance(a, np.ndarray)


def why_not() -> str | None:
    """None when the kernels are in use, else why not (for the run header and the bench)."""
    if os.environ.get("HPCDIST_CPU_KERNELS", "1") == "0":
        return "off (HPCDIST_CPU_KERNELS=0)"
    return _why_not


def describe() -> str:
    """What runs the fused ops here, in a few words, without importing numba."""
    if why_not():
        return f"NumPy twins: {why_not()}"
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("numba") is None:
        return "NumPy twins: numba is not installed (pip install numba)"
    g = blas.find()
    gemms = (f"GEMMs and attention call {g.where} from the kernels" if g is not None
             else f"attention on NumPy's GEMMs: {blas.why_not}")
    if blas.mkl_why_not:
        gemms += f"; MKL not taken: {blas.mkl_why_not}"
    return (f"numba {importlib.metadata.version('numba')} (ops of >= {MIN_SIZE:,} elements; "
            f"smaller ones: the NumPy twins; {gemms})")


def jit():
    """The numba kernels, imported on first use, on this rank's threads."""
    global _jit, _why_not, _threads
    if _jit is None:
        try:
            import numba
            if not os.environ.get("NUMBA_THREADING_LAYER"):
                numba.config.THREADING_LAYER = _layer()
            from . import cpu_jit
            from . import cpu_norm_gate_rope_jit  # noqa: F401  (its kernels join cpu_jit's)
            from . import cpu_flat_jit  # noqa: F401  (the optimizer's: sumsq, scale, adamw)
            if blas.find() is not None:
                from . import cpu_gemm  # noqa: F401  (its kernels join cpu_jit's)
        except ImportError as e:           # numba absent or broken: the twins run
            _why_not = f"numba did not import ({e})"
            threads.release_blas()
            raise
        _jit = cpu_jit
    n = threads.threads
    if n and n != _threads:
        import numba
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _threads = n
    return _jit.SERIAL if n == 1 else _jit.PARALLEL


def _layer() -> str:
    """numba's threads: OpenMP where the GEMMs run inside the kernels (host/pool.py: one set of
    threads, waiting spinning between regions); else the work queue, whose threads sleep:
    OpenMP's spinning took the cores from BLAS's own threads (6x384 steps 1.9x slower)."""
    if not blas.split_here():
        return "workqueue"
    for layer in ("omp", "tbb"):
        try:
            importlib.import_module(f"numba.np.ufunc.{layer}pool")
            return layer
        except (ImportError, OSError):      # its runtime (libgomp, libtbb) is not there
            continue
    return "workqueue"


def threads_here() -> int:
    """The threads this rank's kernels use (at least 1)."""
    return max(1, threads.threads)


def gemm(a, b, into=None, beta: float = 1.0):
    """``a @ b`` (host/pool.py: wanted) with a's rows split over this rank's threads (bounds
    on 16-row lines), each part one BLAS call into its rows of the result, the inner
    dimension whole (cpu_gemm.gemm_rows); ``into``: ``into = a @ b + beta * into`` instead
    (BLAS's beta), split where pool.wanted, else one call."""
    out = np.empty((a.shape[0], b.shape[1]), a.dtype) if into is None else into
    (ta, lda), (tb, ldb) = pool.layout(a), pool.layout(b)
    g = blas.find()
    kernels, parts = jit(), threads.threads
    if into is not None and not pool.wanted(a, b):
        kernels, parts = _jit.SERIAL, 1
    kernels.gemm_rows(g.sgemm if a.dtype == np.float32 else g.dgemm, blas.int_type()(0),
                      a, ta, lda, b, tb, ldb, out, a.dtype.type(0 if into is None else beta),
                      parts)
    return out


def gemm_add(a, b, into, overwrite: bool = False) -> bool:
    """``into += a @ b`` (``overwrite``: ``into = a @ b``) in the GEMM itself (no product
    array, no pass to add it) where NumPy's BLAS is callable, ``into`` has MIN_SIZE elements or
    more (as the other kernels) and the operands are float32/float64 arrays BLAS takes;
    False: not done."""
    if not (wanted(into) and blas.split_here() and isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and isinstance(into, np.ndarray) and a.ndim == b.ndim == into.ndim == 2
            and a.dtype == b.dtype == into.dtype and a.dtype in DTYPES
            and into.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0]
            and into.flags.c_contiguous and into.size and a.shape[1]
            and pool.layout(a) is not None and pool.layout(b) is not None):
        return False
    jit()
    gemm(a, b, into, 0.0 if overwrite else 1.0)
    return True


def _c(x, value):
    return x.dtype.type(value)


def _mat(x):
    """x as a C-contiguous (rows, last axis) matrix (a view when it already is one)."""
    return np.ascontiguousarray(x).reshape(-1, x.shape[-1])


# ---- elementwise -------------------------------------------------------------------------

def bias_gelu(h, b):
    """twin: elementwise.bias_gelu_twin (h += b in place; gelu(h), no tanh kept)."""
    if not h.flags.c_contiguous:
        from .elementwise import bias_gelu_twin
        return bias_gelu_twin(h, b)
    y = np.empty_like(h)
    h2 = h.reshape(-1, h.shape[-1])
    jit().bias_gelu(h2, np.ascontiguousarray(b, dtype=h.dtype), y.reshape(h2.shape), True,
                    _c(h, GELU_C), _c(h, 0.044715))
    return y, None


def gelu(x):
    x2 = _mat(x)
    y = np.empty(x2.shape, x.dtype)
    jit().bias_gelu(x2, x2[0], y, False, _c(x, GELU_C), _c(x, 0.044715))
    return y.reshape(x.shape), None


def gelu_bwd(x, g, t=None):
    x2 = _mat(x)
    gx = np.empty(x2.shape, x.dtype)
    jit().gelu_bwd(x2, _mat(g.astype(x.dtype, copy=False)), gx, _c(x, GELU_C),
                   _c(x, 0.044715))
    return gx.reshape(x.shape)


def bias_residual(out, bias=None, residual=None):
    if not out.flags.c_contiguous or (residual is not None and residual.dtype != out.dtype):
        from .elementwise import bias_residual_twin
        return bias_residual_twin(out, bias, residual)
    o2 = out.reshape(-1, out.shape[-1])
    b = o2[0] if bias is None else np.ascontiguousarray(bias, dtype=out.dtype)
    r = o2 if residual is None else _mat(residual)
    jit().bias_residual(o2, b, r, bias is not None, residual is not None)
    return out


def _colsum(g2):
    """The column sums of g2 (R, C), added in a fixed order at any thread count."""
    part = np.empty((-(-g2.shape[0] // ROW_BLOCK), g2.shape[1]), g2.dtype)
    jit().colsum_partial(g2, part)
    return part.sum(axis=0)


def residual_layernorm(x, bias, residual, w, b, eps):
    """twin: layernorm.residual_layernorm_twin, the two CPU kernels one after the other."""
    bias_residual(x, bias, residual)
    return (x,) + layernorm(x, w, b, eps)


def colsum_add(g, out):
    out += _colsum(_mat(g))
    return out


def gelu_bwd_colsum(h, g, t, out):
    """twin: gelu_colsum.gelu_bwd_colsum_twin, the two CPU kernels one after the other."""
    gh = gelu_bwd(h, g, t)
    colsum_add(gh, out)
    return gh


# ---- rows ----------------------------------------------------------------------------------

def layernorm(x, w, b, eps):
    x2 = _mat(x)
    y = np.empty(x2.shape, x.dtype)
    mean, rstd = np.empty(x2.shape[0], x.dtype), np.empty(x2.shape[0], x.dtype)
    jit().layernorm_fwd(x2, np.ascontiguousarray(w, dtype=x.dtype),
                        np.ascontiguousarray(b, dtype=x.dtype), y, mean, rstd, _c(x, eps))
    lead = x.shape[:-1]
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead), None


def residual(add, gx):
    """(the rows a norm's backward adds to its input gradient, whether to): ``add`` as gx's
    matrix in gx's dtype, or (gx, False) without one (one type for the kernel either way)."""
    if add is None:
        return gx, False
    return _mat(np.asarray(add, dtype=gx.dtype)).reshape(gx.shape), True


def layernorm_bwd(g, x, w, mean, rstd, xhat=None, gw_into=None, gb_into=None, add=None):
    x2 = _mat(x)
    R, C = x2.shape
    gx = np.empty(x2.shape, x.dtype)
    blocks = -(-R // ROW_BLOCK)
    gw_part, gb_part = np.empty((blocks, C), x.dtype), np.empty((blocks, C), x.dtype)
    jit().layernorm_bwd(_mat(g.astype(x.dtype, copy=False)), x2,
                        np.ascontiguousarray(w, dtype=x.dtype),
                        np.ascontiguousarray(mean, dtype=x.dtype).reshape(-1),
                        np.ascontiguousarray(rstd, dtype=x.dtype).reshape(-1),
                        *residual(add, gx), gx, gw_part, gb_part, _c(x, 1.0 / C))
    return (gx.reshape(x.shape),) + added_into(gw_part.sum(axis=0), gb_part.sum(axis=0),
                                               gw_into, gb_into)


def softmax_causal(x, scale, past=0):
    y = np.array(x, order="C").reshape(-1, x.shape[-1])       # (the kernel works in place)
    jit().softmax_causal(y, np.empty(y.shape[0], x.dtype), x.shape[-2] if x.ndim > 1 else 1,
                         past, _c(x, scale))
    return y.reshape(x.shape)


def softmax_causal_bwd(g, y, scale):
    y2 = _mat(y)
    gx = np.array(g, dtype=y.dtype, order="C").reshape(y2.shape)    # (in place, as above)
    jit().softmax_bwd(gx, y2, _c(y, scale))
    return gx.reshape(y.shape)


def cross_entropy(z, t, ignore, vocab=None):
    z2 = _mat(z)
    nll, lse = np.empty(z2.shape[0], z.dtype), np.empty(z2.shape[0], z.dtype)
    jit().cross_entropy_fwd(z2, np.ascontiguousarray(t, dtype=np.int64).reshape(-1),
                            int(ignore), z2.shape[1] if vocab is None else int(vocab),
                            nll, lse, _c(z, 0.0))
    return nll, lse


def cross_entropy_bwd(z, t, lse, ignore, weight, vocab=None):
    z2 = _mat(z)
    gz = np.empty(z2.shape, z.dtype)
    jit().cross_entropy_bwd(z2, np.ascontiguousarray(t, dtype=np.int64).reshape(-1),
                            np.ascontiguousarray(lse, dtype=z.dtype), int(ignore),
                            z2.shape[1] if vocab is None else int(vocab),
                            _c(z, float(weight)), gz)
    return gz


def scatter_rows(target, idx, values) -> bool:
    """``target[idx] += values`` for 2-D ``target`` and ``values`` (one row each ``idx``,
    in range and non-negative) in one kernel; False: not taken (backend.scatter_add's sort
    and ``add.reduceat`` run: serial, 1.9 ms of a GPT 4x128 step)."""
    if not (wanted(values) and target.dtype == values.dtype and target.ndim == values.ndim == 2
            and target.flags.c_contiguous and isinstance(target, np.ndarray)):
        return False
    jit().scatter_rows(target, np.ascontiguousarray(idx, dtype=np.int64),
                       np.ascontiguousarray(values))
    return True


def ready(dtype, largest: int | None = None) -> None:
    """Load and self-check, now, every CPU kernel this rank will run for ``dtype`` (what the
    first use of each would do inside the first step: ~1.4 s there at GPT 4x128).
    ``largest``: a bound on a step's widest activation; below ``MIN_SIZE`` no op on
    activations takes a kernel, and nothing is loaded here (about a second of a rank's
    start): the optimizer's kernel over the flat parameters, where those reach the size,
    loads at its first use."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPES or not on() or threads.threads < 1:
        return
    if largest is not None and largest < MIN_SIZE:
        return
    try:
        for op in fused.registry().values():
            if op.cpu is not None and dtype.name in op.dtypes:
                op._cpu_ok(dtype.name)
        _ready_gemms(dtype)
        rows = np.ones((2, 256), dtype)
        jit().scatter_rows(np.zeros_like(rows), np.zeros(2, np.int64), rows)
        jit().scale(np.ones(8, dtype), dtype.type(1.0))   # optim.clip's (the norm's kernel
                                                          # loaded by GRAD_NORM's check above)
    except ImportError:                  # numba absent or broken: the twins will run
        pass


def _ready_gemms(dtype) -> None:
    """The GEMM kernel for every layout pair (row- or column-major each side: numba compiles
    one per pair), split over threads and whole: a pair first met inside the first step
    loaded there (+80 ms of a 4x128 step's 350)."""
    def both(rows, cols):                      # C and F order (a slice would be 'A')
        return np.ones((rows, cols), dtype), np.ones((cols, rows), dtype).T
    n = 64 * threads_here()
    for left, right in itertools.product(both(n, 256), both(256, 256)):
        if pool.wanted(left, right):           # split over threads
            gemm(left, right)
    for left, right in itertools.product(both(2, 256), both(256, 256)):
        gemm(left, right, np.zeros((2, 256), dtype))                # whole (one BLAS call)


def warm() -> dict:
    """Compile every CPU kernel, threaded and serial, for float32 and float64 (numba caches
    them on disk, so no later process compiles: ``make venv`` runs this) and check each
    against its twin; {(op, dtype, variant): largest error, or why it failed}."""
    global _threads
    out, saved = {}, threads.threads
    try:
        for n, variant in ((1, "serial"), (2, "threaded")):
            threads.threads = n                    # (jit() picks the variant by it)
            for name, op in fused.registry().items():
                if op.cpu is None:
                    continue
                for dtype in op.dtypes:
                    if dtype not in ("float32", "float64"):   # (2-byte floats go through
                        continue                              # float32 on the CPU)
                    try:
                        out[name, dtype, variant] = op.worst_error(dtype, run=op.cpu)
                    except Exception as e:             # numba absent or broken
                        out[name, dtype, variant] = f"{type(e).__name__}: {e}"[:200]
    finally:
        threads.threads, _threads = saved, 0
    return out
