"""FP8 GEMMs on Hopper's tensor cores: a linear layer's operands as fp8 codes — one byte a
value, e4m3 forward, e5m2 for the gradient — with their per-tensor scale, multiplied by
cuBLASLt's FP8 matmul (kernels/cublaslt.py: fp32 accumulation, the output in the activations'
dtype). cuBLASLt takes FP8 only as "TN" (k contiguous in both operands), so one pass writes
an operand in the layouts its GEMMs read (``fp8_codes``: a 32 x 32 tile through shared
memory, rows and its transpose): the forward reads x's rows and w's transpose, the input
gradient dy's rows and w's rows, the weight gradient x's and dy's transposes (w, quantized
in the forward and again in the backward: one layout each time).

``Codes`` is the operand: its codes, the inverse of its scale on the device (cuBLASLt's A/B
scale pointers), the shape a layer reshapes and transposes. The GPU stand-in runs the twins
(the definitions); the CPU the values' emulation (device/fp8.py). docs/gpu.md: "fp8_gemm.py"."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from .. import backend, fp8, fused
from ..fused import Fused
from .fp8_quant import _FP8, FP8_AMAX, ROUNDING, _amax

_CODE_KERNEL = r"""
// the code of q, an fp8 value of the format or a NaN: sign, biased exponent, mantissa bits
// (a NaN: 0x7f in e4m3fn and e5m2 both)
__device__ __forceinline__ unsigned char fp8_code(float q, int mantissa, int min_exp) {
    if (q != q) return 0x7f;
    unsigned char sign = (__float_as_uint(q) >> 31) ? 0x80 : 0;
    float a = fabsf(q);
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e);
    e -= 1;                                                // a in [2^e, 2^(e+1))
    if (e < min_exp)                                       // a subnormal: steps of the smallest
        return sign | (unsigned char)rintf(ldexpf(a, mantissa - min_exp));
    unsigned m = (unsigned)rintf((ldexpf(a, -e) - 1.0f) * (float)(1 << mantissa));
    return sign | (unsigned char)(((e - min_exp + 1) << mantissa) | m);
}
// rows (r, c) and cols (c, r) = the codes of x * s, s from the amax, each where ``layouts``
// asks for it (1 rows, 2 cols, 3 both); inverse = 1 / s. A block of 32 x 8 threads takes a
// 32 x 32 tile (row tiles grid-strided past gridDim.y)
extern "C" __global__ void fp8_codes(const T* x, unsigned char* rows, unsigned char* cols,
                                     long long r, long long c, const float* amax,
                                     int mantissa, int min_exp, float fmax, int layouts,
                                     float* inverse) {
    __shared__ unsigned char tile[32][33];
    float s = fp8_scale_of(*amax, fmax);
    long long c0 = (long long)blockIdx.x * 32;
    for (long long r0 = (long long)blockIdx.y * 32; r0 < r; r0 += (long long)gridDim.y * 32) {
        for (int j = threadIdx.y; j < 32; j += blockDim.y) {
            long long i = r0 + j, k = c0 + threadIdx.x;
            unsigned char code = 0;
            if (i < r && k < c) {
                code = fp8_code(fp8_rounded((float)x[i * c + k] * s, mantissa, min_exp, fmax),
                                mantissa, min_exp);
                if (layouts & 1) rows[i * c + k] = code;
            }
            tile[j][threadIdx.x] = code;
        }
        __syncthreads();
        for (int j = threadIdx.y; j < 32; j += blockDim.y) {
            long long k = c0 + j, i = r0 + threadIdx.x;
            if ((layouts & 2) && i < r && k < c) cols[k * r + i] = tile[threadIdx.x][j];
        }
        __syncthreads();
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0)
        *inverse = 1.0f / s;
}
"""
_CODES = ROUNDING + _CODE_KERNEL


class Codes:
    """An fp8 operand: ``rows`` (n, k) and ``cols`` (k, n), the codes of one matrix in its two
    layouts (uint8, C-contiguous; None: a layout no GEMM of it reads, not written),
    ``inverse`` (1,) float32 its scale's inverse, ``fmt``, and ``shape`` as the layer sees it
    (leading axes folded into n). ``.T`` and ``reshape`` are the views a linear layer takes;
    ``dtype`` is uint8 (no bf16 or fp32 path takes one), ``out`` the dtype a product of it is
    stored in."""

    dtype = np.dtype(np.uint8)
    flags = SimpleNamespace(c_contiguous=False)       # (no epilogue path takes codes)

    def __init__(self, rows, cols, inverse, fmt: fp8.Format, shape: tuple, out):
        self.rows, self.cols, self.inverse, self.fmt = rows, cols, inverse, fmt
        self.shape, self.out = tuple(shape), np.dtype(out)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> "Codes":
        assert self.ndim == 2, self.shape
        return Codes(self.cols, self.rows, self.inverse, self.fmt, self.shape[::-1], self.out)

    def __matmul__(self, b: "Codes"):
        """The FP8 GEMM ``self @ b`` (``product``)."""
        return product(self, b)

    def add_product(self, b: "Codes", into, overwrite: bool) -> bool:
        """``into (+)= self @ b`` by the FP8 GEMM (``overwrite``: =), where ``into`` is the
        C-contiguous float32 or bf16 (n, m) it may write; False: not done."""
        if into.shape != (self.shape[0], b.shape[1]) or not into.flags.c_contiguous or \
                into.dtype.name not in ("float32", "bfloat16"):
            return False
        product(self, b, into, overwrite)
        return True

    def reshape(self, *shape) -> "Codes":
        """The same matrix with its leading axes folded or unfolded (the last stays)."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape[-1] != self.shape[-1]:
            raise ValueError(f"fp8 codes {self.shape} keep their last axis: not {shape}")
        n = int(np.prod(self.shape[:-1]))
        shape = tuple(n if s == -1 else s for s in shape[:-1]) + (shape[-1],) \
            if -1 in shape[:-1] else tuple(shape)
        if int(np.prod(shape[:-1])) != n:
            raise ValueError(f"cannot reshape fp8 codes {self.shape} to {shape}")
        return Codes(self.rows, self.cols, self.inverse, self.fmt, shape, self.out)


ROWS, COLS, BOTH = 1, 2, 3        # the layouts fp8_codes writes


def codes_twin(x, amax, fmax, mantissa, min_exp, layouts=BOTH):
    """(rows, cols, inverse) of the 2-D ``x`` scaled by ``amax``'s power of two: fp8.encode of
    fp8.round_to_fp8(x * s); a layout ``layouts`` leaves out: an empty (0, 0) array."""
    fmt = fp8.Format("", mantissa, min_exp, fmax)
    s = fp8.scale_for(amax, fmt)
    rows = fp8.encode(fp8.round_to_fp8(x.astype(np.float32) * s, fmt), fmt)
    xp = backend.array_module(x)
    none = xp.empty((0, 0), dtype=np.uint8)
    return (rows if layouts & ROWS else none,
            xp.ascontiguousarray(rows.T) if layouts & COLS else none,
            (np.float32(1) / s).reshape(1).astype(np.float32))


def _codes_launch(k, x, amax, fmax, mantissa, min_exp, layouts=BOTH):
    xp = backend.xp()
    x = xp.ascontiguousarray(x)
    r, c = x.shape
    rows = xp.empty((r, c) if layouts & ROWS else (0, 0), dtype=np.uint8)
    cols = xp.empty((c, r) if layouts & COLS else (0, 0), dtype=np.uint8)
    inverse = xp.empty(1, dtype=np.float32)
    grid = (max(1, -(-c // 32)), max(1, min(65535, -(-r // 32))))
    k("fp8_codes")(grid, (32, 8), (x, rows, cols, np.int64(r), np.int64(c),
                                   xp.ascontiguousarray(amax, dtype=np.float32),
                                   np.int32(mantissa), np.int32(min_exp), np.float32(fmax),
                                   np.int32(layouts), inverse))
    return rows, cols, inverse


def _codes_cases(xp, rng, dt):
    """Tiles whole and cut, one row and one column, NaNs and signed zeros, amaxes of the
    tensor's own, larger (a tensor-parallel group's) and smaller (saturation); both layouts,
    and each alone (its place in the other left unwritten)."""
    for fmt in (fp8.E4M3, fp8.E5M2):
        for r, c in ((1, 1), (32, 32), (33, 70), (1, 100), (100, 1), (64, 48)):
            x = rng.standard_normal((r, c)) * 10.0 ** rng.uniform(-4, 4, (r, c))
            if r * c > 2:
                x.flat[[0, r * c // 2]] = [np.nan, -0.0]
            x = xp.asarray(x.astype(dt))
            own = float(fp8.amax_of(x))
            for amax, layouts in ((own, BOTH), (own * 6.0, BOTH), (own / 5.0, BOTH),
                                  (own, ROWS), (own / 5.0, COLS)):
                yield x, xp.asarray([amax], dtype=np.float32), fmt.max, fmt.mantissa, \
                    fmt.min_exp, layouts


FP8_CODES = Fused("fp8_codes", _CODES, ["fp8_codes"], _codes_launch, codes_twin, _codes_cases,
                  tolerance=0.0, dtypes=("float32", "bfloat16"))


def codes(x, fmt: fp8.Format, amax=None, layouts: int = BOTH):
    """x (2-D, or leading axes folded) as ``Codes`` of ``fmt``, scaled by ``amax`` (a (1,)
    float32 array: a tensor-parallel group's) or x's own (FP8_AMAX: one launch more), in the
    ``layouts`` its GEMMs read (ROWS: x as the left operand of a product, or the right one
    transposed; COLS: the right one as it is, or the left one transposed)."""
    x2 = x.reshape(-1, x.shape[-1])
    amax = FP8_AMAX(x2) if amax is None else amax
    rows, cols, inverse = FP8_CODES(x2, amax, fmt.max, fmt.mantissa, fmt.min_exp, layouts)
    return Codes(rows if layouts & ROWS else None, cols if layouts & COLS else None, inverse,
                 fmt, x.shape, x.dtype)


def codes_product_twin(a: Codes, b: Codes, out_dtype):
    """The FP8 GEMM's definition: the codes' values times their scales' inverses, multiplied
    with float32 sums, stored in ``out_dtype``."""
    av = fp8.decode(a.rows, a.fmt) * a.inverse
    bv = fp8.decode(b.cols, b.fmt) * b.inverse
    return (av @ bv.T).astype(out_dtype)


def product(a: Codes, b: Codes, into=None, overwrite: bool = True):
    """``a @ b`` of two fp8 operands ((..., k) and (k, m)) by one cuBLASLt FP8 matmul, in
    ``a.out``; ``into`` (n, m): written there instead (``overwrite`` False: added, beta 1)."""
    n, k = int(np.prod(a.shape[:-1])), a.shape[-1]
    if b.shape[0] != k or b.ndim != 2:
        raise ValueError(f"fp8 product of {a.shape} and {b.shape}")
    if a.rows is None or b.cols is None:
        raise ValueError("fp8 product: an operand's codes were not written in the layout it "
                         "reads (fp8_gemm.codes: layouts)")
    m = b.shape[1]
    label = backend.device_label()
    if label == "gpu":
        d = into if into is not None else backend.xp().empty((n, m), dtype=a.out)
        if _matmul(a, b, d, 0.0 if overwrite else 1.0):
            return d if into is not None else d.reshape(a.shape[:-1] + (m,))
    if label == "standin":
        from .. import standin
        with standin.one_launch(1):
            got = codes_product_twin(a, b, np.float32)
    else:
        got = codes_product_twin(a, b, np.float32)
    if into is None:
        return got.astype(a.out).reshape(a.shape[:-1] + (m,))
    into[...] = (got if overwrite else into.astype(np.float32) + got).astype(into.dtype)
    return into


def _matmul(a: Codes, b: Codes, d, beta: float) -> bool:
    """cuBLASLt's FP8 matmul d = a @ b (+ beta d); False where it has no algorithm for it
    (the refusal kept in fused.refusals())."""
    from . import cublaslt
    try:
        cublaslt.fp8_matmul(a.rows, str(a.fmt), b.cols, str(b.fmt), d,
                            scales=(a.inverse, b.inverse), beta=beta)
        return True
    except cublaslt.NoAlgorithm as e:
        fused.refuse("fp8_gemm " + "x".join(map(str, (a.rows.shape + b.cols.shape[:1]))),
                     str(e))
        return False


def takes(x, n: int, k: int, m: int) -> bool:
    """Whether a linear layer of ``x`` (n, k) @ (k, m) runs its GEMMs on fp8 codes: on a GPU
    whose FP8_GEMM passed its check (compute capability 9.0+), and on the stand-in; float32 or
    bf16 activations; every dimension a multiple of 16 (cuBLASLt's FP8 alignment: each GEMM of
    the three takes one of them as its k). ``HPCDIST_FP8_GEMM=emulated``: the values' path
    (fp8's numbers through bf16 GEMMs) everywhere, to compare."""
    if _emulated() or x.dtype.name not in ("float32", "bfloat16") or (n % 16) or (k % 16) \
            or (m % 16):
        return False
    label = backend.device_label()
    return label == "standin" or (label == "gpu" and FP8_GEMM.ready(x.dtype.name))


def _emulated() -> bool:
    """``HPCDIST_FP8_GEMM=emulated``: fp8's values on bf16 GEMMs everywhere."""
    return os.environ.get("HPCDIST_FP8_GEMM", "codes") == "emulated"


def describe() -> str:
    """The run header's words for how fp8's GEMMs run on this device."""
    values = "fp8's values on bf16 GEMMs (an exact emulation, bf16's speed)"
    if _emulated() or backend.device_label() == "cpu":
        return values
    return ("cuBLASLt's FP8 matmul on the codes where a layer's dimensions are multiples of "
            f"16, else {values}")


def _gemm_launch(k, a, b, a_e5m2=False, b_e5m2=False):
    """a (n, k) @ b (k, m) as an fp8 linear layer computes it: each quantized (its amax, its
    codes) and multiplied by cuBLASLt, in a's dtype."""
    def quantized(x, e5m2):
        fmt = fp8.E5M2 if e5m2 else fp8.E4M3
        x2 = backend.xp().ascontiguousarray(x)
        rows, cols, inverse = _codes_launch(k, x2, _amax(k, x2), fmt.max, fmt.mantissa,
                                            fmt.min_exp)
        return Codes(rows, cols, inverse, fmt, x.shape, x.dtype)
    qa, qb = quantized(a, a_e5m2), quantized(b, b_e5m2)
    d = backend.xp().empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    from . import cublaslt
    cublaslt.fp8_matmul(qa.rows, str(qa.fmt), qb.cols, str(qb.fmt), d,
                        scales=(qa.inverse, qb.inverse))
    return d


def gemm_twin(a, b, a_e5m2=False, b_e5m2=False):
    """fp8.quantized(a) @ fp8.quantized(b), float32 sums, in a's dtype."""
    qa = fp8.quantized(a.astype(np.float32), fp8.E5M2 if a_e5m2 else fp8.E4M3)
    qb = fp8.quantized(b.astype(np.float32), fp8.E5M2 if b_e5m2 else fp8.E4M3)
    return (qa @ qb).astype(a.dtype)


def _gemm_cases(xp, rng, dt):
    for n, kk, m in ((16, 16, 16), (64, 48, 32), (48, 256, 80)):
        for a_e5m2, b_e5m2 in ((False, False), (True, False), (False, True)):
            a = rng.standard_normal((n, kk)) * 10.0 ** rng.uniform(-2, 2)
            b = rng.standard_normal((kk, m)) * 10.0 ** rng.uniform(-2, 2)
            yield xp.asarray(a.astype(dt)), xp.asarray(b.astype(dt)), a_e5m2, b_e5m2


# tolerance: the same exact products summed in another order, and one rounding of the
# output (bf16: BF16_TOLERANCE)
FP8_GEMM = Fused("fp8_gemm", _FP8 + _CODE_KERNEL, ["fp8_amax", "fp8_codes"], _gemm_launch,
                 gemm_twin, _gemm_cases, launches=5, tolerance=1e-5, dtypes=("float32", "bfloat16"),
                 library="cuBLASLt FP8 matmul")
