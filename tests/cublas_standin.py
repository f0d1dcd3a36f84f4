"""cuBLAS's gemmEx and the constants kernels/gemm.py asks for, over host memory (the standin
GPU's pointers are host addresses): what the GEMM launchers hand cuBLAS, checked against
its column-major contract without a GPU. Each call is recorded as (transa, transb, m, n, k,
lda, ldb, ldc, Atype, Btype, Ctype, computeType, algo)."""
import ctypes

import numpy as np

CONSTANTS = {"cublas.CUBLAS_OP_N": 0, "cublas.CUBLAS_OP_T": 1, "runtime.CUDA_R_32F": 0,
             "runtime.CUDA_R_64F": 1, "runtime.CUDA_R_16BF": 14, "cublas.CUBLAS_COMPUTE_32F": 68,
             "cublas.CUBLAS_COMPUTE_32F_FAST_TF32": 77, "cublas.CUBLAS_COMPUTE_64F": 70,
             "cublas.CUBLAS_GEMM_DEFAULT": -1, "cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP": 99}


def fake_cublas(calls, events=None):
    """``lib`` for kernels/gemm.py: gemmEx computes C = alpha op(A) op(B) + beta C with A, B,
    C column-major of their own types (fp32, fp64, bf16 words), alpha and beta of the compute
    type, summed in float64 and stored in C's type; ``calls`` collects each call."""
    import ml_dtypes
    types = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 14: np.dtype(ml_dtypes.bfloat16)}

    def matrix(ptr, dtype, rows, cols, ld):                 # column-major (rows x cols), ld
        raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)),
                                    shape=(cols * ld * dtype.itemsize,))
        return raw.view(dtype).reshape(cols, ld)[:, :rows].T

    def gemm_ex(handle, ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc,
                compute, algo):
        calls.append((ta, tb, m, n, k, lda, ldb, ldc, at, bt, ct, compute, algo))
        scalar = ctypes.c_double if compute == 70 else ctypes.c_float
        al = ctypes.cast(alpha, ctypes.POINTER(scalar))[0]
        be = ctypes.cast(beta, ctypes.POINTER(scalar))[0]
        a = matrix(A, types[at], *((k, m) if ta else (m, k)), lda).astype(np.float64)
        b = matrix(B, types[bt], *((n, k) if tb else (k, n)), ldb).astype(np.float64)
        c = matrix(C, types[ct], m, n, ldc)
        prod = (a.T if ta else a) @ (b.T if tb else b)      # (m, n)
        before = c.astype(np.float64) if be else 0.0         # (beta 0: C is not read)
        c[...] = (al * prod + be * before).astype(types[ct])
    events = [] if events is None else events     # ("stream" | "workspace" | "gemm", ...)

    def set_stream(handle, stream):                          # the handle's, an address
        assert handle == 7 and isinstance(stream, int), (handle, stream)
        events.append(("stream", stream))

    def set_workspace(handle, ptr, size):
        assert handle == 7, handle
        events.append(("workspace", ptr, size))

    def gemm(*args):
        events.append(("gemm",))
        gemm_ex(*args)
    names = dict(CONSTANTS, **{"cublas.gemmEx": gemm, "device.get_cublas_handle": lambda: 7,
                               "cublas.setStream": set_stream,
                               "cublas.setWorkspace": set_workspace})
    return lambda dotted: names[dotted]


def cublaslt_path():
    """The libcublasLt of the nvidia-cublas wheel (CuPy's), or None where it is not installed:
    its host functions (descriptors, layouts, preferences) run without a GPU."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("nvidia.cublas") if importlib.util.find_spec("nvidia") \
        else None
    for root in (spec.submodule_search_locations if spec else []) or []:
        path = os.path.join(root, "lib", "libcublasLt.so.12")
        if os.path.exists(path):
            return path
    return None


def fake_cublaslt(real, calls):
    """``api`` for kernels/cublaslt.py: the real library's host functions (``real(name)``)
    for every descriptor, and over host memory, in their place, the three calls that need a
    GPU: the handle, the heuristic (one algorithm) and cublasLtMatmul, which reads the
    descriptors back from the real library and computes what cuBLASLt documents:
    D = epilogue(alpha op(A) op(B) + beta C), column-major, summed in float64 and stored in
    D's type; BIAS adds a vector over D's rows; GELU_AUX_BIAS writes the biased sum to the
    aux matrix and its GELU (tanh form) to D; DGELU_BGRAD multiplies by the GELU's derivative
    at the aux matrix and writes D's sums over its columns to the bias pointer; BGRADA writes
    op(A)'s sums over k to the bias pointer. ``calls`` collects each matmul's (transa,
    transb, m, n, k, epilogue, compute type). FP8 (A or B of e4m3 or e5m2 codes) as its
    contract says: "TN" only (A transposed, B not), leading dimensions multiples of 16, not
    both e5m2, D float32 or bf16, each operand times the float32 at its scale pointer."""
    import ml_dtypes
    types = {0: np.dtype(np.float32), 1: np.dtype(np.float64), 14: np.dtype(ml_dtypes.bfloat16),
             28: np.dtype(ml_dtypes.float8_e4m3fn), 29: np.dtype(ml_dtypes.float8_e5m2)}

    def attr(getter, obj, which, kind):
        v, written = kind(), ctypes.c_size_t()
        real(getter)(obj, which, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written))
        assert written.value == ctypes.sizeof(v), (getter, which, written.value)
        return v.value

    def layout(obj):
        get = (lambda w, k: attr("cublasLtMatrixLayoutGetAttribute", obj, w, k))
        return (types[get(0, ctypes.c_uint32)], get(2, ctypes.c_uint64), get(3, ctypes.c_uint64),
                get(4, ctypes.c_int64), get(1, ctypes.c_int32))

    def matrix(ptr, spec):
        dtype, rows, cols, ld, order = spec
        assert order == 0 and ld >= rows, spec                      # column-major
        raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)),
                                    shape=(cols * ld * dtype.itemsize,))
        return raw.view(dtype).reshape(cols, ld)[:, :rows].T

    def vector(ptr, dtype, n):
        raw = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)),
                                    shape=(n * dtype.itemsize,))
        return raw.view(dtype)

    def create(handle):
        handle._obj.value = 7

    def heuristic(handle, desc, a, b, c, d, pref, wanted, result, count):
        assert handle == 7 and wanted == 1
        count._obj.value, result._obj.state = 1, 0

    def matmul(handle, desc, alpha, A, adesc, B, bdesc, beta, C, cdesc, D, ddesc, algo, ws,
               ws_size, stream):
        get = (lambda w, k: attr("cublasLtMatmulDescGetAttribute", desc, w, k))
        ta, tb, epi = get(3, ctypes.c_int32), get(4, ctypes.c_int32), get(7, ctypes.c_int32)
        scalar = ctypes.c_double if get(0, ctypes.c_int32) == 70 else ctypes.c_float
        al = ctypes.cast(alpha, ctypes.POINTER(scalar))[0]
        be = ctypes.cast(beta, ctypes.POINTER(scalar))[0]
        a = matrix(A, layout(adesc)).astype(np.float64)
        b = matrix(B, layout(bdesc)).astype(np.float64)
        if 1 in (layout(adesc)[0].itemsize, layout(bdesc)[0].itemsize):       # FP8
            assert layout(adesc)[0].itemsize == layout(bdesc)[0].itemsize == 1
            assert (ta, tb) == (1, 0), ("FP8 is TN only", ta, tb)
            assert layout(adesc)[3] % 16 == 0 and layout(bdesc)[3] % 16 == 0
            assert not layout(adesc)[0] == layout(bdesc)[0] == types[29], "e5m2 x e5m2"
            assert layout(ddesc)[0] in (types[0], types[14]), layout(ddesc)
            for which, x in ((17, "a"), (18, "b")):
                ptr = get(which, ctypes.c_void_p)
                scale = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))[0] if ptr else 1.0
                a, b = (a * scale, b) if x == "a" else (a, b * scale)
        a, b = (a.T if ta else a), (b.T if tb else b)
        assert cdesc == ddesc or layout(cdesc) == layout(ddesc)
        d = matrix(D, layout(ddesc))
        before = matrix(C, layout(cdesc)).astype(np.float64) if be else 0.0
        calls.append((ta, tb, a.shape[0], b.shape[1], a.shape[1], epi, get(0, ctypes.c_int32)))
        out = al * (a @ b) + be * before
        if epi in (4, 164):                                       # BIAS, GELU_AUX_BIAS
            out = out + vector(get(8, ctypes.c_void_p), d.dtype, d.shape[0])[:, None]
        if epi == 164:
            ld = get(12, ctypes.c_int64)
            assert ld % 8 == 0 and ld >= d.shape[0], ld
            aux = matrix(get(11, ctypes.c_void_p), (d.dtype, d.shape[0], d.shape[1], ld, 0))
            aux[...] = out.astype(d.dtype)
            c0 = (2 / np.pi) ** 0.5
            out = 0.5 * out * (1 + np.tanh(c0 * (out + 0.044715 * out ** 3)))
        if epi == 208:                                            # DGELU_BGRAD
            ld = get(12, ctypes.c_int64)
            assert ld % 8 == 0 and ld >= d.shape[0], ld
            x = matrix(get(11, ctypes.c_void_p),
                       (d.dtype, d.shape[0], d.shape[1], ld, 0)).astype(np.float64)
            c0 = (2 / np.pi) ** 0.5
            t = np.tanh(c0 * (x + 0.044715 * x ** 3))
            out = out * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c0 * (1 + 3 * 0.044715 * x * x))
            vector(get(8, ctypes.c_void_p), d.dtype, d.shape[0])[...] = out.sum(axis=1)
        if epi == 256:                                            # BGRADA
            vector(get(8, ctypes.c_void_p), d.dtype, d.shape[0])[...] = a.sum(axis=1)
        assert epi in (1, 4, 164, 208, 256), epi
        d[...] = out.astype(d.dtype)

    fakes = {"cublasLtCreate": create, "cublasLtMatmulAlgoGetHeuristic": heuristic,
             "cublasLtMatmul": matmul}
    return lambda name: fakes[name] if name in fakes else real(name)
