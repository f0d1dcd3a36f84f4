"""GEMMs on tensor cores: TF32 and fp16 through CuPy's compute types, bf16 through cuBLAS.

``--tf32``: fp32 GEMMs on TF32 tensor cores; fp16 GEMMs accumulate in fp32 (``configure``).
bf16 on a CuPy without bfloat16: activations stay float32 and ``BF16_GEMM`` converts each
operand to bf16 words and runs cuBLAS's ``gemmEx`` (bf16 in, fp32 out and accumulation), a
self-checked kernel whose twin rounds the operands and multiplies in float32.

The rest of this design: docs/gpu.md, "hpcdist/device/kernels/gemm.py"."""
from __future__ import annotations

import os

import numpy as np

from .. import backend
from ..surface import CUBLAS
from ..fused import Fused, grid

_TO_BF16 = r"""
// float -> bfloat16 bits, round to nearest even; a NaN stays a (quiet) NaN
extern "C" __global__ void to_bf16(const T* x, unsigned short* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float f = (float)x[i];
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { y[i] = (unsigned short)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    y[i] = (unsigned short)(u >> 16);
}
// bf16 words back to float (exact)
extern "C" __global__ void from_bf16(const unsigned short* x, T* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (T)__uint_as_float((unsigned)x[i] << 16);
}
// the same rounding, kept as float32 (a batched GEMM's operands: cuBLAS has no batched gemmEx
// in CuPy's surface, so they are rounded here and multiplied in fp32)
extern "C" __global__ void round_bf16(const T* x, T* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float f = (float)x[i];
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { y[i] = x[i]; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    y[i] = (T)__uint_as_float(u & 0xffff0000u);
}
"""

_ROOTS = {"cublas": "cupy_backends.cuda.libs.cublas", "runtime": "cupy_backends.cuda.api.runtime",
          "device": "cupy.cuda.device", "linalg": "cupy._core._routines_linalg"}


_found: dict = {}          # dotted name -> what it names (looked up once: a GEMM asks for 9)

# cuBLAS's own entry points for CuPy's wrappers of the same name and arguments: CuPy's refuse
# to run while a stream captures a CUDA graph (its setStream raises NotImplementedError, "not
# mentioned in the cuBLAS docs"); cuBLAS itself is capturable, as every framework's graphs use
_DIRECT = {"cublas.gemmEx": ("cublasGemmEx", "pii iiip pii pii ppi iii"),
           "cublas.setStream": ("cublasSetStream_v2", "pp")}
# and one CuPy does not wrap at all
_ONLY_CUBLAS = {"cublas.setWorkspace": ("cublasSetWorkspace_v2", "ppz")}


def lib(dotted: str):
    """A cuBLAS / CuPy-internal name this module may use (listed in ``CUBLAS``)."""
    found = _found.get(dotted)
    if found is not None:
        return found
    if dotted in _ONLY_CUBLAS or dotted in _DIRECT:
        found = _direct(*{**_ONLY_CUBLAS, **_DIRECT}[dotted])
    elif dotted in CUBLAS:
        module, name = dotted.split(".", 1)
        found = getattr(backend.cupy_library(_ROOTS[module]), name)
    else:
        raise AttributeError(f"{dotted} is not in device_surface.CUBLAS: list it there first "
                             "(make test-cupy then checks it against CuPy)")
    _found[dotted] = found
    return found


def _direct(symbol: str, types: str):
    """``symbol`` of the libcublas this process loaded (CuPy's), called through ctypes with
    ``types`` (p: a pointer or handle, i: an int, z: a size); a status other than success
    raises."""
    import ctypes
    fn = getattr(ctypes.CDLL(_loaded_cublas()), symbol)
    kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int, "z": ctypes.c_size_t}
    fn.argtypes = [kinds[t] for t in types.replace(" ", "")]
    fn.restype = ctypes.c_int

    def call(*args):
        status = fn(*args)
        if status:
            raise RuntimeError(f"{symbol} returned cuBLAS status {status}")
    return call


def _loaded_cublas() -> str:
    """The path of the libcublas CuPy loaded (its handle is made first), else the soname."""
    lib("device.get_cublas_handle")()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcublas.so"):
                return path
    return "libcublas.so.12"


_tf32 = False
_workspace: list = []          # the workspace cuBLAS is given at each GEMM, once one is made

WORKSPACE_BYTES = 32 << 20     # (Hopper's, as cuBLAS sizes its own; 4 MiB before it)


def use_workspace() -> None:
    """Give cuBLAS a workspace of our own from here on (made once, kept): since CUDA 12.2 its
    own is allocated stream-ordered, which a CUDA graph records as allocations beside each
    GEMM (graphs.py calls this before a capture). On an H200 the captured steps that are
    GPU-bound ran slower than eager ones (a T 256 tf32 step 27.1 against 24.1 ms, GPT-2
    medium bf16 58.6 against 48.5) with cuBLAS's own: the suspected cause, unmeasured.
    ``HPCDIST_CUBLAS_WORKSPACE_MB`` sizes it (0: cuBLAS's own, for the comparison)."""
    size = int(float(os.environ.get("HPCDIST_CUBLAS_WORKSPACE_MB", WORKSPACE_BYTES >> 20))
               * (1 << 20))
    if not _workspace and size > 0 and backend.device_label() != "cpu":
        _workspace.append(backend.xp().empty(size, dtype=np.uint8))


def tf32_on() -> bool:
    """Whether this run asked for TF32 (``--tf32``): its fp32 GEMMs and attention use it."""
    return _tf32


def configure(tf32: bool) -> None:
    """The GEMM modes of this run on a GPU: TF32 for fp32 or not, fp16 accumulating in fp32
    (no-op elsewhere)."""
    global _tf32
    _tf32 = bool(tf32)
    if backend.device_label() != "gpu":
        return
    fp32 = lib("linalg.COMPUTE_TYPE_TF32") if tf32 else lib("linalg.COMPUTE_TYPE_DEFAULT")
    lib("linalg.set_compute_type")(np.float32, fp32)
    lib("linalg.set_compute_type")(np.float16, lib("linalg.COMPUTE_TYPE_FP32"))


def describe(tf32: bool) -> str:
    """The header's word for ``--tf32``."""
    label = backend.device_label()
    return "" if not tf32 else "tf32 GEMMs" if label == "gpu" else \
        f"--tf32 has no effect on the {label} (fp32 GEMMs)"


def _operand(x):
    """(C-contiguous base, transposed?) of a 2-D operand, copying only when neither x nor x.T
    is C-contiguous."""
    if x.flags.c_contiguous:
        return x, False
    if x.T.flags.c_contiguous:
        return x.T, True
    return backend.xp().ascontiguousarray(x), False


def _to_bf16(k, x):
    xp = backend.xp()
    words = xp.empty(x.shape, dtype=xp.uint16)
    k("to_bf16")(*grid(x.size), (x, words, np.int64(x.size)))
    return words


def _gemm_launch(k, a, b):
    """(n, k) @ (k, m) in bf16 on tensor cores, fp32 out."""
    (ab, at), (bb, bt) = _operand(a), _operand(b)
    words = (lambda x, t: _to_bf16(k, x).T if t else _to_bf16(k, x))
    return _gemm_words(words(ab, at), words(bb, bt))


def _gemm_words(aw, bw):
    """(n, k) @ (k, m) of bf16 words (uint16; each C-contiguous or the transpose of one), fp32
    out."""
    xp = backend.xp()
    out = xp.empty((aw.shape[0], bw.shape[1]), dtype=xp.float32)
    return gemm_ex(aw, bw, out, "runtime.CUDA_R_16BF", "runtime.CUDA_R_32F",
                   "cublas.CUBLAS_COMPUTE_32F", beta=0.0)


def gemm_ex(a, b, out, ab_type: str, out_type: str, compute: str, beta: float,
            scalar=np.float32):
    """``out`` (n, m) = a (n, k) @ b (k, m) + ``beta`` out by one cuBLAS gemmEx (the names of
    its data and compute types as CUBLAS lists them; alpha and beta of type ``scalar``); a
    and b each C-contiguous or the transpose of such, out C-contiguous. cuBLAS is column-
    major: the row-major product C = A B is C^T = B^T A^T, so B goes first."""
    (n, kk), m = a.shape, b.shape[1]
    if not (n and m):
        return out
    if not kk:
        if beta == 0.0:
            out.fill(0)
        return out
    (a, at), (b, bt) = _operand(a), _operand(b)
    one, beta = np.array(1.0, scalar), np.array(beta, scalar)
    ab_type = lib(ab_type)
    trans = (lib("cublas.CUBLAS_OP_N"), lib("cublas.CUBLAS_OP_T"))
    algo = "cublas.CUBLAS_GEMM_DEFAULT" if scalar is np.float64 else \
        "cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP"
    handle = lib("device.get_cublas_handle")()
    # the handle runs on the stream it was last given (CuPy sets it before each of its own
    # calls): this call's is the current one (a CUDA graph's capture runs on its own stream);
    # setting a stream gives the handle back cuBLAS's own workspace: ours goes after it
    lib("cublas.setStream")(handle, backend.xp().cuda.get_current_stream().ptr)
    if _workspace:
        lib("cublas.setWorkspace")(handle, _workspace[0].data.ptr, _workspace[0].size)
    lib("cublas.gemmEx")(handle, trans[bt], trans[at], m, n, kk,
                         one.ctypes.data, b.data.ptr, ab_type, kk if bt else m,
                         a.data.ptr, ab_type, n if at else kk,
                         beta.ctypes.data, out.data.ptr, lib(out_type), m, lib(compute),
                         lib(algo))
    return out


def gemm_twin(a, b):
    """The definition: both operands rounded to bf16 (in float32), multiplied, fp32 out."""
    return backend.round_to_bf16(a) @ backend.round_to_bf16(b)


def _gemm_cases(xp, rng, dt):
    for n, k, m in ((1, 1, 1), (3, 5, 7), (64, 48, 33), (17, 256, 129), (2, 0, 3)):
        a = (rng.standard_normal((n, k)) * 3).astype(dt)
        b = (rng.standard_normal((k, m)) * 3).astype(dt)
        yield xp.asarray(a), xp.asarray(b)
        yield xp.asarray(a.T.copy()).T, xp.asarray(b.T.copy()).T      # transposed views
    nan = np.ones((2, 3), dt)
    nan[0, 1] = np.nan
    yield xp.asarray(np.ones((4, 2), dt)), xp.asarray(nan)


# tolerance: the same bf16 products, summed in another order (relative to the largest output)
BF16_GEMM = Fused("bf16_gemm", _TO_BF16, ["to_bf16"], _gemm_launch, gemm_twin, _gemm_cases,
                  launches=3, tolerance=1e-4, dtypes=("float32",), library="cuBLAS gemmEx")


def _from_bf16(k, words):
    xp = backend.xp()
    out = xp.empty(words.shape, dtype=np.float32)
    k("from_bf16")(*grid(words.size), (words, out, np.int64(words.size)))
    return out


def _round_trip_launch(k, x):
    """float32 -> bf16 words -> float32: both conversion kernels, against round_to_bf16."""
    return _from_bf16(k, _to_bf16(k, backend.xp().ascontiguousarray(x)))


def _words_launch(k, x):
    """The conversion alone, its words read back as float32 (the kernel's own check)."""
    words = _to_bf16(k, backend.xp().ascontiguousarray(x))
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _words_cases(xp, rng, dt):
    for n in (1, 7, 1000, 100_003):
        yield xp.asarray((rng.standard_normal(n) * 3).astype(dt)),
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), np.inf, -np.inf, np.nan,
                     0.0, -0.0, 3.4e38, 1e-40], dtype=dt)       # halfway cases, specials
    yield xp.asarray(ties),


# the conversion kernel on its own, against backend.round_to_bf16 (BF16_GEMM runs it twice)
TO_BF16 = Fused("to_bf16", _TO_BF16, ["to_bf16"], _words_launch, backend.round_to_bf16,
                _words_cases, tolerance=0.0, dtypes=("float32",))


# the way back from words (cuDNN's attention outputs bf16: kernels/cudnn_attention.py)
FROM_BF16 = Fused("from_bf16", _TO_BF16, ["to_bf16", "from_bf16"], _round_trip_launch,
                  backend.round_to_bf16, _words_cases, launches=2, tolerance=0.0,
                  dtypes=("float32",))


def matmul(a, b):
    """``a @ b`` as the run's precision asks: bf16 emulated in float32 storage runs each
    2-D-foldable GEMM through ``BF16_GEMM`` (tensor cores on a GPU) and, on a GPU, rounds a
    batched GEMM's operands with one ``ROUND_BF16`` kernel each (op by op the rounding took
    four launches an operand: 45% of an H200's bf16 step at GPT 12x768); everything else is
    ``backend.matmul``."""
    if not (backend.bf16_emulated() and a.dtype == np.float32):
        return backend.matmul(a, b)
    if not (b.ndim == 2 and a.ndim >= 2 and (a.ndim == 2 or a.flags.c_contiguous)):
        if backend.device_label() == "gpu" and b.dtype == np.float32:
            return ROUND_BF16(a) @ ROUND_BF16(b)
        return backend.matmul(a, b)
    out = BF16_GEMM(a.reshape(-1, a.shape[-1]), b)
    return out.reshape(a.shape[:-1] + b.shape[-1:])


def operand(x):
    """``x`` as this run's GEMMs take it, converted once for every product it enters (an op
    keeps it for its backward): under bf16 emulation, bf16 words on a GPU whose BF16_GEMM
    passed its check (one TO_BF16 pass), else its bf16 values in float32; otherwise x. A
    linear layer's six conversions a step (x and w for y, dy and w for dx, x and dy for dw)
    become three: x, w, dy."""
    if not (backend.bf16_emulated() and x.dtype == np.float32):
        return x
    if BF16_GEMM.ready("float32"):
        xp = backend.xp()
        base, t = _operand(x) if x.ndim == 2 else (xp.ascontiguousarray(x), False)
        words = _to_bf16(lambda name: BF16_GEMM._kernel("float32", name), base)
        return words.T if t else words
    return backend.round_to_bf16(x)


def product(a, b):
    """``a @ b`` of two ``operand`` results: (..., k) @ (k, m), any leading axes on a
    contiguous left side, or 2-D views (transposes too), or of two fp8 ``Codes``."""
    if a.dtype == np.uint8:                        # fp8 codes: their own product
        return a @ b
    if a.dtype == np.uint16:
        if a.ndim > 2:
            out = _gemm_words(a.reshape(-1, a.shape[-1]), b)
            return out.reshape(a.shape[:-1] + b.shape[-1:])
        return _gemm_words(a, b)
    return backend.matmul(a, b, rounding=False)


def _round_launch(k, x):
    x = backend.xp().ascontiguousarray(x)
    y = backend.xp().empty_like(x)
    k("round_bf16")(*grid(x.size), (x, y, np.int64(x.size)))
    return y


ROUND_BF16 = Fused("round_bf16", _TO_BF16, ["round_bf16"], _round_launch, backend.round_to_bf16,
                   _words_cases, tolerance=0.0, dtypes=("float32",))
