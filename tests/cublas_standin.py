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
