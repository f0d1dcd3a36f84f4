"""A tensor's fp8 values (device/fp8.py) in two launches beside its twin (``fp8.quantized``,
a dozen operations op by op): one grid-wide reduction to the amax, one elementwise rounding.

``fp8_amax``: each block reduces its grid-stride share of |x| (NaNs left out) to a maximum
in shared memory; the block that arrives last (common.py's ``last_to_arrive``) reduces the
blocks' maxima in block order, writes the amax and zeroes its counter for the next call. The
amax stays on the device (a CUDA graph holds the pair); a tensor-parallel shard's is max-
allreduced between the two (``FP8_AMAX``, then ``FP8_ROUND``). ``fp8_round``: the scale
from the amax — the largest power of two with amax * s <= max, by frexpf as the twin finds it
by frexp, exact at every power of two where a log2 may be one ulp off — then x * s rounded
to the format (rintf's ties to even, saturation that keeps a NaN), divided back by s, stored
in x's dtype (exact: an fp8 value times a power of two is a bf16 one)."""
from __future__ import annotations

import numpy as np

from .. import backend, fp8
from ..fused import Fused, grid
from .common import _FINISH, kept_zeros

# the scale and the rounding, shared with the codes' kernel (kernels/fp8_gemm.py)
ROUNDING = r"""
// the largest power of two s with amax * s <= fmax (amax 0: as if 1)
__device__ __forceinline__ float fp8_scale_of(float amax, float fmax) {
    int e;
    frexpf(fmax / (amax > 0.0f ? amax : 1.0f), &e);
    return ldexpf(1.0f, e - 1);
}
// v rounded to the format: nearest, ties to even, saturated at +-fmax, a NaN kept
__device__ __forceinline__ float fp8_rounded(float v, int mantissa, int min_exp, float fmax) {
    int e;
    frexpf(v, &e);                                         // |v| in [2^(e-1), 2^e)
    e = e - 1 > min_exp ? e - 1 : min_exp;                 // (subnormals: the smallest step)
    float step = ldexpf(1.0f, e - mantissa);
    float q = rintf(v / step) * step;
    return q > fmax ? fmax : (q < -fmax ? -fmax : q);
}
"""

_FP8 = _FINISH + ROUNDING + r"""
extern "C" __global__ void fp8_amax(const T* x, long long n, A* part, unsigned* done,
                                    float* amax) {
    __shared__ float m[256];
    float a = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = fabsf((float)x[i]);
        if (v > a) a = v;                                  // (a NaN never is)
    }
    m[threadIdx.x] = a;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && m[threadIdx.x + s] > m[threadIdx.x])
            m[threadIdx.x] = m[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = m[0];
    if (!last_to_arrive(done, gridDim.x)) return;
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (unsigned k = 0; k < gridDim.x; k++) {
            float b = read_l2(part + k);
            if (b > t) t = b;
        }
        *amax = t;
        *done = 0;
    }
}
// out = round_fp8(x * s) / s, s from the amax
extern "C" __global__ void fp8_round(const T* x, T* out, long long n, const float* amax,
                                     int mantissa, int min_exp, float fmax) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = fp8_scale_of(*amax, fmax);
    out[i] = (T)(fp8_rounded((float)x[i] * s, mantissa, min_exp, fmax) / s);
}
"""

BLOCKS = 264             # the reduction's blocks at most, two an SM of an H100 (grid-stride
                         # beyond: a tensor of 50 M values is ~740 a thread)


def quantized_twin(x, fmax, mantissa, min_exp):
    """fp8.quantized with the format given by its numbers (the self-check's arguments)."""
    return fp8.quantized(x, _format(fmax, mantissa, min_exp))


def rounded_twin(x, amax, fmax, mantissa, min_exp):
    """fp8.quantized scaled by a given amax (a (1,) array)."""
    return fp8.quantized(x, _format(fmax, mantissa, min_exp), amax)


def amax_twin(x):
    return fp8.amax_of(x).reshape(1)


def _format(fmax, mantissa, min_exp):
    return fp8.Format("", mantissa, min_exp, fmax)


def _amax(k, x):
    """x's amax, a (1,) float32 array on the device (x contiguous, not empty)."""
    xp = backend.xp()
    blocks = min(BLOCKS, -(-x.size // 256))
    part = kept_zeros(xp, blocks, np.float32, "fp8 amax of each block")
    done = kept_zeros(xp, 1, np.uint32, "fp8 amax blocks done")
    amax = xp.empty(1, dtype=np.float32)
    k("fp8_amax")((blocks,), (256,), (x, np.int64(x.size), part, done, amax))
    return amax


def _round(k, x, amax, fmax, mantissa, min_exp):
    out = backend.xp().empty_like(x)
    k("fp8_round")(*grid(x.size), (x, out, np.int64(x.size), amax, np.int32(mantissa),
                                   np.int32(min_exp), np.float32(fmax)))
    return out


def _quantize_launch(k, x, fmax, mantissa, min_exp):
    x = backend.xp().ascontiguousarray(x)
    if not x.size:
        return backend.xp().empty_like(x)
    return _round(k, x, _amax(k, x), fmax, mantissa, min_exp)


def _amax_launch(k, x):
    x = backend.xp().ascontiguousarray(x)
    return _amax(k, x) if x.size else backend.xp().zeros(1, dtype=np.float32)


def _round_launch(k, x, amax, fmax, mantissa, min_exp):
    x = backend.xp().ascontiguousarray(x)
    if not x.size:
        return backend.xp().empty_like(x)
    return _round(k, x, backend.xp().ascontiguousarray(amax, dtype=np.float32), fmax,
                  mantissa, min_exp)


def _tensors(xp, rng, dt):
    for n, spread in ((1, 1.0), (7, 1e-6), (1000, 1e4), (BLOCKS * 256 + 7, 3.0), (4096, 0.0)):
        x = rng.standard_normal(n) * spread * 10.0 ** rng.uniform(-3, 3, n)
        if n == 1000:
            x[[3, 500]] = [np.nan, -0.0]
        yield xp.asarray(x.astype(dt))


def _cases(xp, rng, dt):
    for fmt in (fp8.E4M3, fp8.E5M2):
        for x in _tensors(xp, rng, dt):
            yield x, fmt.max, fmt.mantissa, fmt.min_exp


def _amax_cases(xp, rng, dt):
    for x in _tensors(xp, rng, dt):
        yield (x,)


def _round_cases(xp, rng, dt):
    """Each tensor scaled by its own amax, by a group's larger one, and by a smaller one (the
    values past it saturate), and by 0 (as if 1)."""
    for fmt in (fp8.E4M3, fp8.E5M2):
        for x in _tensors(xp, rng, dt):
            own = float(amax_twin(x)[0])
            for amax in (own, own * 5.0, own / 3.0, 0.0):
                yield x, xp.asarray([amax], dtype=np.float32), fmt.max, fmt.mantissa, \
                    fmt.min_exp


FP8_QUANTIZE = Fused("fp8_quantize", _FP8, ["fp8_amax", "fp8_round"], _quantize_launch,
                     quantized_twin, _cases, launches=2, tolerance=0.0,
                     dtypes=("float32", "bfloat16"))
FP8_AMAX = Fused("fp8_amax", _FP8, ["fp8_amax"], _amax_launch, amax_twin, _amax_cases,
                 tolerance=0.0, dtypes=("float32", "bfloat16"))
FP8_ROUND = Fused("fp8_round", _FP8, ["fp8_round"], _round_launch, rounded_twin, _round_cases,
                  tolerance=0.0, dtypes=("float32", "bfloat16"))
