"""The gradient's global norm in one launch beside its twin, for clipping (optim.grad_norm):
``grad_norm`` writes [sum of squares, norm] of a flat gradient, in float64, to the device,
where AdamW's kernels read the norm (kernels/adamw.py: no read to the host, and a CUDA graph
holds it). Each block adds the squares of its grid-stride share; the block that arrives last
(common.py's ``last_to_arrive``) adds the blocks' sums, each of its threads a fixed stride of
them and then a tree in shared memory: the same order at every call. CuPy took four launches
and a gradient-sized temporary (the squares, their sum in the gradient's dtype, a widening,
the root)."""
from __future__ import annotations

import numpy as np

from .. import backend
from ..fused import Fused
from .common import _FINISH, kept_zeros

_GRAD_NORM = _FINISH + r"""
#ifdef __CUDACC_RTC__
__device__ __forceinline__ double read_l2_f64(const double* p) { return __ldcg(p); }
#else
__device__ __forceinline__ double read_l2_f64(const double* p) { return *p; }
#endif
// the sum over the block (256 threads) of each thread's v, on thread 0, in a fixed tree
__device__ double block_sum_f64(double v, double* s) {
    s[threadIdx.x] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    return s[0];
}
extern "C" __global__ void grad_norm(const T* g, long long n, double* part, unsigned* done,
                                     double* out) {
    __shared__ double s[256];
    double a = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        double v = (double)(A)g[i];
        a += v * v;
    }
    double total = block_sum_f64(a, s);
    if (threadIdx.x == 0) part[blockIdx.x] = total;
    if (!last_to_arrive(done, gridDim.x)) return;          // (its barrier ends s's reads)
    double b = 0.0;
    for (unsigned k = threadIdx.x; k < gridDim.x; k += blockDim.x) b += read_l2_f64(part + k);
    total = block_sum_f64(b, s);
    if (threadIdx.x == 0) {
        out[0] = total;
        out[1] = sqrt(total);
        *done = 0;
    }
}
"""

BLOCKS = 1056            # the blocks at most: eight of 256 threads on each of an H100's 132
                         # SMs, enough loads in flight for its memory (grid-stride beyond)
PER_THREAD = 4           # elements a thread adds at least (so a small gradient's launch also
                         # strides: the self-check's cases reach every path in cudasim cheaply)


def grad_norm_twin(g):
    """[the sum of g's squares, its square root] (float64, on g's device)."""
    xp = backend.array_module(g)
    wide = g.astype(np.float64).reshape(-1)
    sq = (wide * wide).sum()
    return xp.stack([sq, xp.sqrt(sq)])


def _grad_norm_launch(k, g):
    xp = backend.xp()
    out = xp.empty(2, dtype=np.float64)
    if not g.size:
        out[...] = 0
        return out
    g = xp.ascontiguousarray(g).reshape(-1)
    blocks = min(BLOCKS, -(-g.size // (256 * PER_THREAD)))
    part = kept_zeros(xp, blocks, np.float64, "grad norm of each block")
    done = kept_zeros(xp, 1, np.uint32, "grad norm blocks done")
    k("grad_norm")((blocks,), (256,), (g, np.int64(g.size), part, done, out))
    return out


def _grad_norm_cases(xp, rng, dt):
    # one block; several, each thread striding; 257 blocks: the last block's threads add
    # more than one block's sum each
    for n, spread in ((1, 1.0), (7, 1e-6), (1000, 1e4), (5000, 3.0),
                      (257 * 256 * PER_THREAD, 1.0), (4096, 0.0)):
        yield (xp.asarray((rng.standard_normal(n) * spread).astype(dt)),)


GRAD_NORM = Fused("grad_norm", _GRAD_NORM, ["grad_norm"], _grad_norm_launch, grad_norm_twin,
                  _grad_norm_cases, tolerance=1e-12, cpu="cpu_flat.grad_norm")
