"""What the kernels share: block reductions in CUDA, scalars of the accumulator's type, rows."""

from __future__ import annotations

import math

import numpy as np

from ..fused import grid


GELU_C = math.sqrt(2.0 / math.pi)
ROW_BLOCK = 64       # rows per partial sum of the CPU kernels' column reductions (cpu_jit.py)

_COMMON = r"""
#define NEG_INF ((A)(-__int_as_float(0x7f800000)))          // -infinity (no <math.h> in NVRTC)
__device__ __forceinline__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffff, v, o));
    return v;
}
// the sum over the warp, on every lane (a butterfly)
__device__ __forceinline__ A lane_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
// the sum (or max) over the block, on every thread; blockDim.x a multiple of 32, <= 1024
""" + "".join(r"""
__device__ A block_{op}(A v, A* shared) {{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_{op}(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? shared[lane] : {identity};
    if (warp == 0) v = warp_{op}(v);
    if (threadIdx.x == 0) shared[0] = v;
    __syncthreads();
    v = shared[0];
    __syncthreads();
    return v;
}}
""".format(op=op, identity=identity) for op, identity in (("sum", "(A)0"), ("max", "NEG_INF")))


WARP_ROWS = 8        # rows of a warp-a-row kernel's block (256 threads)
SHARED_DEFAULT = 48 << 10     # dynamic shared memory a kernel has without asking for more
BLOCKS_WANTED = 1024          # a row kernel's blocks: 8 of 256 threads on each of 128 SMs


def rows_per_block(rows: int, partial_bytes: int) -> tuple[int, int]:
    """(rows a block takes, its dynamic shared memory) for a norm's backward that sums its
    weight gradient over rows in shared memory (``partial_bytes`` a block) and adds it into
    the gradient once a block: about BLOCKS_WANTED blocks, 2 to 32 rows each; 1 row (added
    row by row, no shared memory) where the sums would not fit in SHARED_DEFAULT beside the
    kernel's static 96 values (the block reduction's 32, two means of each of 32 rows; a
    launch asking for more fails without opting in)."""
    if partial_bytes + 96 * 8 > SHARED_DEFAULT or rows < 2:
        return 1, 0
    return max(2, min(32, rows // BLOCKS_WANTED)), partial_bytes


def row_threads(C: int, vec: int) -> int:
    """Threads of a block that walks rows of ``C`` ``vec`` elements a thread at a time: one
    vector each (a multiple of 32) up to 256, so no thread of a short row stands idle."""
    vectors = -(-C // vec)
    return min(256, max(32, (vectors + 31) // 32 * 32))


def accumulator(dtype) -> type:
    """The type a kernel's ``A`` is for arrays of ``dtype``: double for fp64, else float."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def sums(into, n: int, acc):
    """Where a kernel adds a sum over rows (atomics in ``A``): ``into`` itself when it is of
    the accumulator's type, else zeros of that type (``summed`` adds them in after)."""
    from .. import backend
    if into is not None and into.dtype == acc:
        return into
    return backend.xp().zeros(n, dtype=acc)


_KEPT: dict = {}        # (xp, what, dtype) -> an array every kernel that uses it leaves zero


def kept_zeros(xp, n: int, dtype, what: str):
    """``n`` zeros of ``dtype`` that stay allocated (``what`` names their use): a counter or a
    sum's workspace that each kernel using it zeroes again before it ends, so a call costs no
    zeroing launch and a CUDA graph's capture allocates nothing (its first calls run eagerly).
    Kernels on one stream take their turns; grows to the largest ``n`` asked."""
    key = (xp.__name__, what, np.dtype(dtype).str)
    have = _KEPT.get(key)
    if have is None or have.size < n:
        have = _KEPT[key] = xp.zeros(max(n, 1024), dtype=dtype)
    return have


_FINISH = r"""
#ifdef __CUDACC_RTC__
__device__ __forceinline__ A read_l2(const A* p) { return __ldcg(p); }   // (not this SM's L1)
#else
__device__ __forceinline__ A read_l2(const A* p) { return *p; }
#endif
// whether this block is the last of ``blocks`` to arrive at ``done`` (every block of the
// grid calls it, all its threads): the writes of the blocks before it are seen (each thread's
// fence before the count). The caller's last block zeroes ``done`` again for the next call.
__device__ bool last_to_arrive(unsigned* done, unsigned blocks) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = atomicAdd(done, 1u) == blocks - 1;
    __syncthreads();
    return last;
}
// the last block adds the float sums ``ws`` into ``low0`` (ws[0, n)) and, ``two``, ``low1``
// (ws[n, 2n)) in their dtype, rounding once, and leaves ``ws`` and the counter at zero for
// the next call: a norm's weight (and bias) gradient into 2-byte gradient buffers in the same
// kernel, where CuPy took a zeroing launch before it and an addition launch after it for each
__device__ void finish_into(A* ws, T* low0, T* low1, int n, int two, unsigned* done) {
    if (!last_to_arrive(done, gridDim.x)) return;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        low0[c] = (T)((A)low0[c] + read_l2(ws + c));
        ws[c] = 0;
        if (two) { low1[c] = (T)((A)low1[c] + read_l2(ws + n + c)); ws[n + c] = 0; }
    }
    if (threadIdx.x == 0) *done = 0;
}
"""


def finishes(x, acc, *into) -> bool:
    """Whether a norm's backward adds its sums into ``into`` itself (``finish_into``): every
    buffer given, contiguous, of ``x``'s 2-byte dtype rather than the accumulator's."""
    return all(b is not None and b.dtype != acc and b.dtype == x.dtype and b.flags.c_contiguous
               for b in into)


def summed(buf, into, dtype):
    """The sums of ``buf`` (from ``sums``) as the caller gets them: added into ``into`` when
    that is another array (a bf16 gradient buffer: rounded once), or as ``dtype``."""
    if into is None:
        return buf.astype(dtype, copy=False)
    if buf is not into:
        into += buf
    return into


def low(x) -> bool:
    """Whether ``x`` holds 2-byte floats (bf16, fp16): twins compute those in float32, as the
    kernels do, and store in the array's own dtype."""
    return getattr(x, "dtype", None) is not None and x.dtype.itemsize == 2 and \
        x.dtype.kind in "fV"


def wide(x):
    """``x`` in float32 where it holds 2-byte floats, else ``x`` itself."""
    return x.astype(np.float32) if low(x) else x


def _scalar(dtype, value):
    return np.dtype(dtype).type(value)


def _rows(x):
    """(rows, width) of x seen as a matrix over its last axis."""
    return int(x.size // x.shape[-1]) if x.shape[-1] else 0, int(x.shape[-1])


# ---- 16-byte vectors: VEC elements a thread ------------------------------------------------

VECTORS = [True]     # False: every elementwise kernel one element a thread (the bench's "off")

_VECTOR = r"""
#ifndef VEC
#define VEC 1
#endif
static_assert(VEC == 1 || VEC * sizeof(T) == 16, "VEC elements must make 16 bytes");
// VEC elements of T between an array and a thread's registers (``alignas(16) T r[VEC]``): one
// 16-byte access on the device where VEC > 1 (the launcher chose VEC so that every array
// starts on 16 bytes and no vector straddles a row); cudasim copies element by element and
// checks the alignment a 16-byte access needs
#ifdef __CUDACC_RTC__
__device__ __forceinline__ void copy_vec(T* dst, const T* src) {
#if VEC > 1
    *(uint4*)dst = *(const uint4*)src;
#else
    dst[0] = src[0];
#endif
}
#else
__device__ __forceinline__ void copy_vec(T* dst, const T* src) {
    if (VEC > 1) { sim_check16(dst, "store"); sim_check16(src, "load"); }
    for (int j = 0; j < VEC; j++) dst[j] = src[j];
}
#endif
"""


def address(a) -> int:
    """Where an array's first element is: a CuPy array's device pointer, a NumPy array's
    (cudasim's) host pointer."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def vector_width(n: int, *arrays, row: int | None = None) -> int:
    """VEC of an elementwise kernel over ``n`` elements of ``arrays`` (one dtype): 16 bytes a
    thread — 8 bf16, 4 float, 2 double — where every array starts on 16 bytes and ``n``, and
    ``row`` (the width a vector must not straddle: a bias's, a row's halves), divide by it;
    else 1. At 2 bytes an element a thread keeps too few bytes in flight to fill an H200's
    memory: bias + residual ran at a quarter of its bandwidth so (docs/gpu.md)."""
    width = 16 // arrays[0].dtype.itemsize
    if not VECTORS[0] or width <= 1 or n % width or (row is not None and row % width):
        return 1
    return width if all(address(a) % 16 == 0 for a in arrays) else 1


def vectors(k, name: str, n: int, *arrays, row: int | None = None):
    """(kernel ``name``'s variant for these arrays, its grid): an elementwise kernel over
    ``n`` elements, VEC a thread (``vector_width``)."""
    vec = vector_width(n, *arrays, row=row)
    return k(name, {"VEC": vec}), grid(-(-n // vec))
