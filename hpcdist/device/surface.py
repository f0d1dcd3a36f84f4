"""The CuPy surface hpcdist may use, as CuPy 14 declares it: name -> (kind, signature), and
the count of what a GPU would launch through it. The GPU stand-in (standin.py) offers
exactly this; tests/cupy checks every entry against the real CuPy (make test-cupy)."""
from __future__ import annotations

import contextlib
import inspect

# ---- the surface: name -> (kind, signature as CuPy 14 writes it) -----------------------------
# kinds: "function", "ufunc" (signature: the inputs), "class", "dtype", "method", "property".
MODULE = {
    "arange": ("function", "(start, stop=None, step=1, dtype=None)"),
    "array": ("function", "(obj, dtype=None, copy=True, order='K', subok=False, ndmin=0, *, "
                          "blocking=False)"),
    "asarray": ("function", "(a, dtype=None, order=None, *, copy=None, blocking=False)"),
    "asnumpy": ("function", "(a, stream=None, order='C', out=None, *, blocking=True)"),
    "ascontiguousarray": ("function", "(a, dtype=None)"),
    "argpartition": ("function", "(a, kth, axis=-1)"),
    "argsort": ("function", "(a, axis=-1, kind=None)"),
    "broadcast_to": ("function", "(array, shape)"),
    "concatenate": ("function", "(tup, axis=0, out=None, *, dtype=None, casting='same_kind')"),
    "einsum": ("function", "(*operands, **kwargs)"),
    "empty": ("function", "(shape, dtype=float, order='C')"),
    "full": ("function", "(shape, fill_value, dtype=None, order='C')"),
    "clip": ("function", "(a, a_min, a_max, out=None)"),
    "empty_like": ("function", "(prototype, dtype=None, order='K', subok=None, shape=None)"),
    "get_array_module": ("function", "(*args)"),
    "get_default_memory_pool": ("function", "()"),
    "linalg.norm": ("function", "(x, ord=None, axis=None, keepdims=False)"),
    "linalg.qr": ("function", "(a, mode='reduced')"),
    "ones": ("function", "(shape, dtype=float, order='C')"),
    "ones_like": ("function", "(a, dtype=None, order='K', subok=None, shape=None)"),
    "repeat": ("function", "(a, repeats, axis=None)"),
    "stack": ("function", "(tup, axis=0, out=None, *, dtype=None, casting='same_kind')"),
    "swapaxes": ("function", "(a, axis1, axis2)"),
    "triu": ("function", "(m, k=0)"),
    "where": ("function", "(condition, x=None, y=None)"),
    "zeros": ("function", "(shape, dtype=float, order='C')"),
    "zeros_like": ("function", "(a, dtype=None, order='K', subok=None, shape=None)"),
    "abs": ("ufunc", "(x)"), "add": ("ufunc", "(x1, x2)"),
    "bitwise_or": ("ufunc", "(x1, x2)"), "divide": ("ufunc", "(x1, x2)"),
    "cos": ("ufunc", "(x)"), "sin": ("ufunc", "(x)"),
    "exp": ("ufunc", "(x)"), "isfinite": ("ufunc", "(x)"), "isnan": ("ufunc", "(x)"),
    "exp2": ("ufunc", "(x)"), "log2": ("ufunc", "(x)"), "floor": ("ufunc", "(x)"),
    "frexp": ("ufunc", "(x)"), "ldexp": ("ufunc", "(x1, x2)"),
    "log": ("ufunc", "(x)"), "maximum": ("ufunc", "(x1, x2)"),
    "minimum": ("ufunc", "(x1, x2)"), "multiply": ("ufunc", "(x1, x2)"),
    "reciprocal": ("ufunc", "(x)"), "rint": ("ufunc", "(x)"), "signbit": ("ufunc", "(x)"),
    "sqrt": ("ufunc", "(x)"),
    "subtract": ("ufunc", "(x1, x2)"), "tanh": ("ufunc", "(x)"),
    "ndarray": ("class", None), "inf": ("constant", None), "pi": ("constant", None),
    "bool_": ("dtype", None), "float16": ("dtype", None), "float32": ("dtype", None),
    "float64": ("dtype", None), "int32": ("dtype", None), "int64": ("dtype", None),
    "uint8": ("dtype", None), "uint16": ("dtype", None), "uint32": ("dtype", None),
    "uint64": ("dtype", None),
}
NDARRAY = {
    "T": ("property", None), "data": ("property", None), "dtype": ("property", None),
    "flags": ("property", None), "itemsize": ("property", None),
    "nbytes": ("property", None), "ndim": ("property", None), "shape": ("property", None),
    "size": ("property", None), "strides": ("property", None),
    "all": ("method", "(self, axis=None, out=None, keepdims=False)"),
    "any": ("method", "(self, axis=None, out=None, keepdims=False)"),
    "argmax": ("method", "(self, axis=None, out=None, dtype=None, keepdims=False)"),
    "astype": ("method", "(self, dtype, order='K', casting=None, subok=None, copy=True)"),
    "copy": ("method", "(self, order='C')"),
    "fill": ("method", "(self, value)"),
    "get": ("method", "(self, stream=None, order='C', out=None, blocking=True)"),
    "item": ("method", "(self)"),
    "max": ("method", "(self, axis=None, out=None, keepdims=False)"),
    "mean": ("method", "(self, axis=None, dtype=None, out=None, keepdims=False)"),
    "min": ("method", "(self, axis=None, out=None, keepdims=False)"),
    "ravel": ("method", "(self, order='C')"),
    "reshape": ("method", "(self, *shape, order='C', copy=None)"),
    "set": ("method", "(self, arr, stream=None)"),
    "sum": ("method", "(self, axis=None, dtype=None, out=None, keepdims=False)"),
    "transpose": ("method", "(self, *axes)"),
    "view": ("method", "(self, dtype=None, type=None)"),
}
FLAGS = ("c_contiguous", "f_contiguous", "owndata")      # no ``writeable`` in CuPy
CUDA = {
    "Device": ("class", "(device=None)"), "Device.use": ("method", "(self)"),
    "MemoryPool": ("class", "(allocator=None)"),
    "MemoryPool.malloc": ("method", "(self, size)"),
    "MemoryPool.total_bytes": ("method", "(self)"),
    "MemoryPool.used_bytes": ("method", "(self)"),
    "Stream": ("class", "(null=False, non_blocking=False, ptds=False, priority=None)"),
    "Stream.begin_capture": ("method", "(self, mode=None)"),
    "Stream.end_capture": ("method", "(self)"),
    "Stream.synchronize": ("method", "(self)"),
    "graph.Graph.launch": ("method", "(self, stream=None)"),
    "using_allocator": ("function", "(allocator=None)"),
    "alloc_pinned_memory": ("function", "(size)"),
    "get_current_stream": ("function", "(device_id=-1)"),
    "runtime.getDeviceCount": ("function", "()"),
    "runtime.getDeviceProperties": ("function", "(int device)"),
    "runtime.memGetInfo": ("function", "()"),
}
CUPYX = {"scatter_add": ("function", "(a, slices, value)")}
RANDOM = {
    "default_rng": ("function", "(seed=None)"),
    "Generator.random": ("method", "(self, size=None, dtype=float64, out=None)"),
    "Generator.standard_normal": ("method", "(self, size=None, dtype=float64, out=None)"),
    "XORWOW.state": ("method", "(self)"),
}
# cupy.cuda.nccl: typed, as NCCL's wrappers declare them (the conformance test checks the
# types of the values hpcdist passes, not only the names)
NCCL = {
    "get_unique_id": ("function", "() -> bytes"),
    "groupStart": ("function", "()"), "groupEnd": ("function", "()"),
    "NcclCommunicator": ("class", "(int ndev, bytes commId, int rank)"),
    "NcclCommunicator.allReduce": ("method", "(self, intptr_t sendbuf, intptr_t recvbuf, "
                                   "size_t count, int datatype, int op, intptr_t stream)"),
    "NcclCommunicator.reduceScatter": ("method", "(self, intptr_t sendbuf, intptr_t recvbuf, "
                                       "size_t recvcount, int datatype, int op, "
                                       "intptr_t stream)"),
    "NcclCommunicator.allGather": ("method", "(self, intptr_t sendbuf, intptr_t recvbuf, "
                                   "size_t count, int datatype, intptr_t stream)"),
    "NcclCommunicator.bcast": ("method", "(self, intptr_t buff, size_t count, int datatype, "
                               "int root, intptr_t stream)"),
    "NcclCommunicator.send": ("method", "(self, intptr_t sendbuf, size_t count, "
                              "int datatype, int peer, intptr_t stream)"),
    "NcclCommunicator.recv": ("method", "(self, intptr_t recvbuf, size_t count, "
                              "int datatype, int peer, intptr_t stream)"),
    "NcclCommunicator.destroy": ("method", "(self)"),
    "NcclCommunicator.abort": ("method", "(self)"),
    "NcclCommunicator.check_async_error": ("method", "(self)"),
    **{f"NCCL_{n}": ("constant", None) for n in (
        "FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "INT32", "INT64", "UINT8", "INT8", "SUM",
        "MAX", "MIN")},
}
# What kernels/gemm.py calls outside cupy's public module on a GPU (tensor-core GEMMs and
# gemm_add.py's gradients through gemm_ex): module (cublas: cupy_backends.cuda.libs.cublas,
# runtime: cupy_backends.cuda.api.runtime, device: cupy.cuda.device, linalg:
# cupy._core._routines_linalg) and name. Not offered by the GPU stand-in, which runs the GEMMs'
# twins; checked against CuPy and cuBLAS's wheels by make test-cupy.
CUBLAS = {
    "cublas.gemmEx": ("function", "(intptr_t handle, int transa, int transb, int m, int n, "
                      "int k, size_t alpha, size_t A, int Atype, int lda, size_t B, int Btype, "
                      "int ldb, size_t beta, size_t C, int Ctype, int ldc, int computeType, "
                      "int algo)"),
    "cublas.setStream": ("function", "(intptr_t handle, size_t stream)"),
    "device.get_cublas_handle": ("function", "()"),
    "linalg.set_compute_type": ("function", "(dtype, compute_type)"),
    **{f"cublas.{n}": ("constant", None) for n in (
        "CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F", "CUBLAS_COMPUTE_32F_FAST_TF32",
        "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT", "CUBLAS_GEMM_DEFAULT_TENSOR_OP")},
    **{f"runtime.{n}": ("constant", None) for n in ("CUDA_R_16BF", "CUDA_R_32F", "CUDA_R_64F")},
    **{f"linalg.COMPUTE_TYPE_{n}": ("constant", None) for n in ("DEFAULT", "FP32", "TF32")},
}
UFUNC_KWARGS = {"out", "dtype", "casting"}           # what CuPy's ufuncs take by keyword

_C_TYPES = {"int": "", "bytes": "", "intptr_t": "", "size_t": "", "NcclConfig": ""}


def cupy_result_type(inputs, result):
    """A ufunc's ``result`` (NumPy's) with the dtype CuPy gives it where the two differ: NumPy
    with ml_dtypes makes bf16 @ bf16 float32 (ml_dtypes #235), and bf16 times a Python float
    too; CuPy keeps bf16 (its GEMM writes bf16 from an fp32 accumulation; a Python scalar is
    weak, NEP 50). So a native bf16 run's activations stay bf16 on the GPU stand-in as on a GPU."""
    arrays = [x for x in inputs if hasattr(x, "dtype")]
    if arrays and all(x.dtype.name == "bfloat16" for x in arrays) and \
            all(hasattr(x, "dtype") or isinstance(x, (int, float)) for x in inputs) and \
            getattr(result, "dtype", None) is not None and result.dtype.name == "float32":
        return result.astype(arrays[0].dtype)
    return result


def signature(text: str) -> inspect.Signature:
    """``text`` — "(a, dtype=None, *, copy=None)", C types allowed ("(int ndev, bytes id)")
    and an optional "-> type" — as an ``inspect.Signature`` (defaults are not evaluated:
    only names, order and kinds count)."""
    text = text.split("->")[0].strip()
    params = []
    for part in filter(None, (p.strip() for p in text[1:-1].split(","))):
        words = part.split("=")[0].split()
        name = words[-1]
        params.append(f"{name}=None" if "=" in part else name)
    ns: dict = {}
    exec(f"def f({', '.join(params)}): pass", ns)          # noqa: S102 (our own table)
    return inspect.signature(ns["f"])


def typed_parameters(text: str) -> list[tuple[str, str]]:
    """[(C type, name)] of a typed signature ("(int ndev, bytes commId)"), self left out."""
    out = []
    for part in filter(None, (p.strip() for p in text.split("->")[0].strip()[1:-1].split(","))):
        words = part.split("=")[0].split()
        if len(words) == 2:
            out.append((words[0], words[1]))
    return out


# ---- launches: what a GPU would start -------------------------------------------------------

class _Launches:
    """Device operations counted as a GPU would launch them: every ufunc, every function and
    method that computes (not views, not allocations, not host transfers), gathers and
    scatters by index; a fused kernel (fused.py) counts as its own launches, its twin's
    operations inside it not at all."""
    count = 0
    depth = 0

    def add(self, n: int = 1) -> None:
        if not self.depth:
            self.count += n


LAUNCHES = _Launches()


class _Reads:
    """Device-to-host reads counted as a GPU would wait for them: ``get``, ``item``,
    ``asnumpy`` and the implicit ones (``float(x)``, ``int(x)``, ``bool(x)``, ``if x``). Each
    holds the host until the device has finished everything queued before it."""
    count = 0
    capturing = 0       # streams capturing a CUDA graph now (standin_runtime's): reads refused

    def add(self) -> None:
        if self.capturing:
            raise RuntimeError("a device-to-host read while a stream captures a CUDA graph "
                               "(CUDA refuses it: cudaErrorStreamCaptureUnsupported)")
        self.count += 1


READS = _Reads()


@contextlib.contextmanager
def one_launch(n: int = 1):
    """The operations inside count as ``n`` launches (a fused kernel running its twin)."""
    LAUNCHES.depth += 1
    try:
        yield
    finally:
        LAUNCHES.depth -= 1
        LAUNCHES.add(n)


NOT_LAUNCHES = {"broadcast_to", "swapaxes", "get_array_module", "asnumpy", "asarray", "array",
                "empty", "empty_like", "get_default_memory_pool", "reshape", "transpose",
                "view", "ravel", "get", "set", "item"}
