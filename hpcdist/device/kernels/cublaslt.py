"""cuBLASLt's matmul with an epilogue, through ctypes (as gemm.py calls cuBLAS): the bias, the
bias + GELU with its input kept, or a bias's gradient, done by the GEMM as it stores; and
the FP8 matmul of two operands' codes with their scales (``fp8_matmul``: kernels/fp8_gemm.py).

``matmul(a, b, d, epilogue=..., ...)`` runs ``d = a @ b (+ beta c)`` row-major; cuBLASLt is
column-major, so it computes d^T = b^T a^T: our ``b`` is its A, our ``a`` its B, and a
vector over d's columns (a bias, a bias's gradient) is one over the rows of its D. A plan
(descriptors, the heuristic's algorithm) is made once per shape, type, epilogue and pointer
alignment and kept. The library calls go through ``api(name)``; tests put a fake of
cuBLASLt's documented contract in its place (tests/cublas_standin.py) and build every
descriptor against the real library's host functions, which run without a GPU."""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .. import backend

# cublasLt.h's values (CUDA 12), as the library's headers give them
EPILOGUES = {"default": 1, "bias": 4, "gelu_aux_bias": 164, "dgelu_bgrad": 208, "bgrada": 256}
_DESC = {"compute": 0, "scale": 1, "transa": 3, "transb": 4, "epilogue": 7, "bias": 8,
         "aux": 11, "aux_ld": 12, "a_scale": 17, "b_scale": 18}
_PREF_WORKSPACE = 1
_PREF_ALIGNMENT = (5, 6, 7, 8)            # the smallest alignment of A, B, C, D (uint32 bytes)
_TYPES = {"float32": 0, "float64": 1, "bfloat16": 14, "e4m3": 28, "e5m2": 29}  # cudaDataType
COMPUTE = {"32F": 68, "32F_FAST_TF32": 77, "64F": 70}          # cublasComputeType_t

# (name, argument types, result): p a pointer or handle, i int32, u uint64, q int64, z size_t
_SIGNATURES = {
    "cublasLtCreate": "p",
    "cublasLtMatmulDescCreate": "pii",
    "cublasLtMatmulDescSetAttribute": "pipz",
    "cublasLtMatrixLayoutCreate": "piuuq",
    "cublasLtMatmulPreferenceCreate": "p",
    "cublasLtMatmulPreferenceSetAttribute": "pipz",
    "cublasLtMatmulAlgoGetHeuristic": "pppppppipp",
    "cublasLtMatmul": "ppppppppppppppzp",
    "cublasLtMatmulDescGetAttribute": "pippp",          # (tests read the descriptors back)
    "cublasLtMatrixLayoutGetAttribute": "pippp",
}
_C = {"p": ctypes.c_void_p, "i": ctypes.c_int, "u": ctypes.c_uint64, "q": ctypes.c_int64,
      "z": ctypes.c_size_t}


class NoAlgorithm(RuntimeError):
    """cuBLASLt's heuristic has no algorithm for a matmul's descriptors."""


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (64 bytes), its workspace, a status."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


_found: dict = {}


def api(name: str):
    """cuBLASLt's ``name``, called with Python ints and pointers; a status other than success
    raises."""
    fn = _found.get(name)
    if fn is None:
        raw = getattr(ctypes.CDLL(library_path()), name)
        raw.argtypes = [_C[t] for t in _SIGNATURES[name]]
        raw.restype = ctypes.c_int

        def fn(*args, _raw=raw, _name=name):
            status = _raw(*args)
            if status:
                raise RuntimeError(f"{_name} returned cuBLAS status {status}")
        _found[name] = fn
    return fn


def library_path() -> str:
    """The libcublasLt this process loaded (libcublas loads it; CuPy's handle is made first),
    else the one beside that libcublas, else the soname."""
    from .gemm import _loaded_cublas
    beside = os.path.join(os.path.dirname(_loaded_cublas()), "libcublasLt.so.12")
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return path
    return beside if os.path.exists(beside) else "libcublasLt.so.12"


_handle_made: list = []    # the process's cuBLASLt handle, once made
_plans: dict = {}          # key -> Plan, or None: cuBLASLt has no algorithm for it


def _handle() -> int:
    if not _handle_made:
        h = ctypes.c_void_p()
        api("cublasLtCreate")(ctypes.byref(h))
        _handle_made.append(h.value)
    return _handle_made[0]


def _set(desc, attr: str, value, kind=ctypes.c_int32) -> None:
    v = kind(value)
    api("cublasLtMatmulDescSetAttribute")(desc, _DESC[attr], ctypes.byref(v), ctypes.sizeof(v))


def _layout(dtype: str, rows: int, cols: int, ld: int) -> int:
    out = ctypes.c_void_p()
    api("cublasLtMatrixLayoutCreate")(ctypes.byref(out), _TYPES[dtype], rows, cols, ld)
    return out.value


def _operand(x):
    """(C-contiguous base, transposed?) of a 2-D operand, or None: neither x nor x.T is."""
    if x.flags.c_contiguous:
        return x, False
    if x.T.flags.c_contiguous:
        return x.T, True
    return None


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 dividing ``ptr`` (the heuristic picks algorithms for
    the pointers it is shown: a plan is kept per alignment)."""
    return min(256, ptr & -ptr) if ptr else 256


class Plan:
    """What one cublasLtMatmul needs that does not change from call to call: the descriptors
    of the operation and of A, B, C/D, the algorithm and its workspace."""

    def __init__(self, key, desc, layouts, algo, workspace):
        self.key, self.desc, self.layouts = key, desc, layouts
        self.algo, self.workspace = algo, workspace


def plan(a, b, d=None, *, epilogue: str, compute: str, vector=None, aux=None, c=None):
    """The plan of ``d = a @ b (+ beta c)`` (a (n, k), b (k, m), d (n, m) C-contiguous, None: a
    new array; a, b each C-contiguous or the transpose of such; c: d where None) with
    ``epilogue``; ``vector`` the bias (or its gradient); ``aux``: the (n, m) array of the
    GELU's input ("new": a new one takes it). Made once per key (the alignment of each pointer
    in it), then kept; None: cuBLASLt has no algorithm."""
    (ab, at), (bb, bt) = _operand(a), _operand(b)
    (n, k), m = a.shape, b.shape[1]
    dtype = a.dtype.name
    given = (d, vector, None if isinstance(aux, str) else aux, c)
    ptrs = [x.data.ptr for x in (ab, bb) + tuple(v for v in given if v is not None)]
    key = (dtype, at, bt, n, k, m, epilogue, compute, aux is None, isinstance(aux, str),
           d is None, vector is None, c is None, tuple(_alignment(p) for p in ptrs))
    if key in _plans:
        return _plans[key]
    desc = ctypes.c_void_p()
    api("cublasLtMatmulDescCreate")(ctypes.byref(desc), COMPUTE[compute],
                                    _TYPES["float64" if compute == "64F" else "float32"])
    desc = desc.value
    _set(desc, "transa", int(bt))                 # cuBLASLt's A is our b
    _set(desc, "transb", int(at))
    _set(desc, "epilogue", EPILOGUES[epilogue])
    if vector is not None:
        _set(desc, "bias", vector.data.ptr, ctypes.c_void_p)
    if aux is not None:
        _set(desc, "aux_ld", m, ctypes.c_int64)
        if not isinstance(aux, str):
            _set(desc, "aux", aux.data.ptr, ctypes.c_void_p)
    layouts = (_layout(dtype, k, m, k) if bt else _layout(dtype, m, k, m),      # A: b
               _layout(dtype, n, k, n) if at else _layout(dtype, k, n, k),      # B: a
               _layout(dtype, m, n, m))                                         # C and D
    d_align = _alignment(d.data.ptr) if d is not None else 256
    c_align = _alignment(c.data.ptr) if c is not None else d_align
    return _choose(key, desc, layouts, (_alignment(bb.data.ptr), _alignment(ab.data.ptr),
                                        c_align, d_align))


def _choose(key, desc: int, layouts: tuple, aligned: tuple):
    """The plan of ``desc`` over ``layouts`` (A, B, C = D) with the heuristic's first
    algorithm for our workspace and for pointers ``aligned`` (A, B, C, D: bytes; its default
    is 256, and a gradient buffer's view may sit at less), kept under ``key``; None (kept
    too): it has none."""
    from .gemm import _workspace, use_workspace
    use_workspace()                # (cuBLASLt has none of its own: the one cuBLAS is given)
    size = _workspace[0].size if _workspace else 0
    pref = ctypes.c_void_p()
    api("cublasLtMatmulPreferenceCreate")(ctypes.byref(pref))
    limit = ctypes.c_uint64(size)
    api("cublasLtMatmulPreferenceSetAttribute")(pref.value, _PREF_WORKSPACE,
                                                ctypes.byref(limit), ctypes.sizeof(limit))
    for attr, size in zip(_PREF_ALIGNMENT, aligned):
        least = ctypes.c_uint32(size)
        api("cublasLtMatmulPreferenceSetAttribute")(pref.value, attr, ctypes.byref(least),
                                                    ctypes.sizeof(least))
    result, count = HeuristicResult(), ctypes.c_int(0)
    try:
        api("cublasLtMatmulAlgoGetHeuristic")(_handle(), desc, layouts[0], layouts[1],
                                              layouts[2], layouts[2], pref.value, 1,
                                              ctypes.byref(result), ctypes.byref(count))
    except RuntimeError:                   # (CUBLAS_STATUS_NOT_SUPPORTED: no algorithm)
        count.value = 0
    found = _plans[key] = Plan(key, desc, layouts, result, size) \
        if count.value >= 1 and not result.state else None
    return found


def fp8_matmul(a, a_type: str, bt, b_type: str, d, *, scales, beta: float = 0.0):
    """The FP8 matmul ``d (n, m) = sa sb (a @ bt.T) + beta d`` of fp8 codes: a (n, k) and
    bt (m, k) C-contiguous uint8 codes of ``a_type`` / ``b_type`` ("e4m3", "e5m2"),
    ``scales`` = (sa, sb) (1,) float32 arrays on the device (the codes' scales' inverses), d
    float32 or bf16, fp32 accumulation. cuBLASLt's FP8 is "TN" only: its A is
    our bt read transposed, its B our a. Raises NoAlgorithm where it has none."""
    (n, k), m = a.shape, bt.shape[0]
    key = ("fp8", a_type, b_type, d.dtype.name, n, k, m,
           tuple(_alignment(x.data.ptr) for x in (a, bt, d)))
    p = _plans[key] if key in _plans else \
        _fp8_plan(key, (a_type, b_type, d.dtype.name), (n, k, m))
    if p is None:
        raise NoAlgorithm(f"cuBLASLt has no FP8 algorithm for {a_type} ({n}, {k}) @ "
                          f"{b_type} ({k}, {m}) into {d.dtype.name}")
    _set(p.desc, "b_scale", scales[0].data.ptr, ctypes.c_void_p)    # (its B is our a)
    _set(p.desc, "a_scale", scales[1].data.ptr, ctypes.c_void_p)
    _run(p, bt.data.ptr, a.data.ptr, d, d, beta=beta, scalar=np.float32)
    return d


def _fp8_plan(key, types: tuple, dims: tuple):
    """The FP8 plan of ``key``: types (a's, b's, d's), dims (n, k, m) as ``fp8_matmul``'s."""
    (a_type, b_type, d_type), (n, k, m) = types, dims
    desc = ctypes.c_void_p()
    api("cublasLtMatmulDescCreate")(ctypes.byref(desc), COMPUTE["32F"], _TYPES["float32"])
    desc = desc.value
    _set(desc, "transa", 1)
    _set(desc, "transb", 0)
    layouts = (_layout(b_type, k, m, k), _layout(a_type, k, n, k), _layout(d_type, m, n, m))
    a_align, b_align, d_align = key[-1]
    return _choose(key, desc, layouts, (b_align, a_align, d_align, d_align))


def _run(p: Plan, a_ptr: int, b_ptr: int, c, d, *, beta: float, scalar) -> None:
    """cublasLtMatmul of plan ``p``: its A at ``a_ptr``, B at ``b_ptr`` (cuBLASLt's names),
    D = alpha op(A) op(B) + beta C, alpha 1, on the current stream with our workspace."""
    one, beta = np.array(1.0, scalar), np.array(beta, scalar)
    from .gemm import _workspace
    ws = _workspace[0].data.ptr if _workspace and p.workspace else None
    api("cublasLtMatmul")(_handle(), p.desc, one.ctypes.data, a_ptr, p.layouts[0], b_ptr,
                          p.layouts[1], beta.ctypes.data, c.data.ptr, p.layouts[2], d.data.ptr,
                          p.layouts[2], ctypes.addressof(p.algo),     # (its algo field: offset 0)
                          ws, p.workspace, backend.xp().cuda.get_current_stream().ptr)


def matmul(a, b, d, *, epilogue: str = "default", compute: str = "32F", beta: float = 0.0,
           c=None, vector=None, aux=None):
    """``d = a @ b + beta c`` (c: ``d`` itself when None) with ``epilogue``: "bias" adds
    ``vector`` (m) to every row; "gelu_aux_bias" adds it, writes the sum to ``aux`` and its
    GELU (tanh form) to d; "dgelu_bgrad" multiplies the product by the GELU's derivative at
    ``aux`` (the forward's kept input) and writes d's sums over its rows to ``vector``;
    "bgrada" writes b's sums over k (m) to ``vector``. Returns d."""
    p = plan(a, b, d, epilogue=epilogue, compute=compute, vector=vector, aux=aux, c=c)
    if p is None:
        raise RuntimeError(f"cuBLASLt has no algorithm for {epilogue} at {a.shape} @ {b.shape}")
    if vector is not None:                            # (this call's pointers, same alignment)
        _set(p.desc, "bias", vector.data.ptr, ctypes.c_void_p)
    if aux is not None:
        _set(p.desc, "aux", aux.data.ptr, ctypes.c_void_p)
    _run(p, _operand(b)[0].data.ptr, _operand(a)[0].data.ptr, d if c is None else c, d,
         beta=beta, scalar=np.float64 if compute == "64F" else np.float32)
    return d
