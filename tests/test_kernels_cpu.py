"""Every CUDA kernel of hpcdist/device/kernels/ executed on the CPU (device/cudasim.py) on its
self-check cases, with a block's threads in index order, reversed and shuffled, against its
NumPy twin at the self-check's tolerance; and the model itself: an out-of-bounds access, a
missing barrier, a barrier in divergent code and a wrongly typed argument are each caught."""
import numpy as np
import pytest

from hpcdist.device import cudasim, fused
import hpcdist.device.kernels  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.skipif(cudasim.available() is not None,
                                reason=f"the CUDA execution model: {cudasim.available()}")

OPS = [(name, dt) for name, op in sorted(fused.registry().items()) if not op.library
       for dt in op.dtypes]


def test_every_kernel_of_the_source_tree_is_covered():
    """Each ``extern "C"`` kernel is run by some op the model checks (the GEMMs' cuBLAS and
    cuBLASLt calls and cuDNN's are the things outside it: the gemmEx contract is tested in
    test_kernels.py, cublasLtMatmul's in test_cublaslt.py, against stand-ins over host
    memory)."""
    declared = {k for op in fused.registry().values()
                for k in cudasim.translate(op.code(op.dtypes[0]))[1]}
    run = {k for op in fused.registry().values() if not op.library for k in op.kernels}
    assert declared and declared == run
    assert {op.name for op in fused.registry().values() if op.library} == \
        {"bf16_gemm", "gemm_add", "gemm_add_tf32", "cudnn_fwd", "cudnn_bwd", "fp8_gemm"} | \
        {f"gemm_{op}{tf}" for op in ("bias", "bias_gelu", "dgelu_bgrad", "bgrad")
         for tf in ("", "_tf32")}


@pytest.mark.parametrize("name,dtype", OPS, ids=[f"{n}-{d}" for n, d in OPS])
def test_kernel_equals_its_twin_in_every_thread_order(name, dtype):
    op = fused.registry()[name]
    errors = cudasim.check(op, dtype)
    assert set(errors) == set(cudasim.ORDERS)
    assert max(errors.values()) <= op.tolerance_for(dtype)


COPY = r"""
typedef float T;
typedef float A;
extern "C" __global__ void copy(const T* x, T* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i > n) return;                                  // the bug: i == n reads x[n]
    y[i] = x[i];
}
"""


def test_an_out_of_bounds_read_is_named():
    k = cudasim.RawModule(COPY).get_function("copy")
    x, y = np.arange(40, dtype=np.float32), np.zeros(40, np.float32)
    with pytest.raises(cudasim.KernelFault, match=r"copy's x\[40\] is outside its 40 elements"):
        k((1,), (64,), (x, y, np.int64(40)))
    k((1,), (64,), (x, y, np.int64(39)))                # inside: runs, copies 0..39
    np.testing.assert_array_equal(y, x)


SUM = r"""
typedef float T;
typedef float A;
extern "C" __global__ void block_total(const T* x, T* out) {
    __shared__ A part[64];
    part[threadIdx.x] = (A)x[blockIdx.x * blockDim.x + threadIdx.x];
    BARRIER
    if (threadIdx.x == 0) {
        A s = 0;
        for (int i = 0; i < (int)blockDim.x; i++) s += part[i];
        out[blockIdx.x] = (T)s;
    }
}
"""


def _totals(source, order):
    k = cudasim.RawModule(source, order=order, seed=3).get_function("block_total")
    x = np.arange(1, 129, dtype=np.float32)
    out = np.zeros(2, np.float32)
    k((2,), (64,), (x, out))
    return out


def test_a_missing_barrier_shows_when_the_threads_change_order():
    want = np.array([np.arange(1, 65).sum(), np.arange(65, 129).sum()], np.float32)
    for order in cudasim.ORDERS:                        # with the barrier: right in any order
        np.testing.assert_array_equal(_totals(SUM.replace("BARRIER", "__syncthreads();"),
                                              order), want)
    racy = SUM.replace("BARRIER", "")
    results = [_totals(racy, order) for order in cudasim.ORDERS]
    assert any(not np.array_equal(r, want) for r in results)


DIVERGENT = r"""
typedef float T;
typedef float A;
extern "C" __global__ void divergent(T* x) {
    A v = (A)x[threadIdx.x];
    if (threadIdx.x < 32) __syncthreads();
    else v += __shfl_down_sync(0xffffffff, v, 1);
    x[threadIdx.x] = (T)v;
}
"""


def test_a_barrier_in_divergent_code_is_named_not_a_hang():
    k = cudasim.RawModule(DIVERGENT).get_function("divergent")
    with pytest.raises(cudasim.KernelFault, match="exited before __syncthreads number 1"):
        k((1,), (64,), (np.ones(64, np.float32),))
    inside_a_warp = cudasim.RawModule(DIVERGENT.replace("< 32", "< 16")).get_function("divergent")
    with pytest.raises(cudasim.KernelFault, match="deadlock: 16 threads wait at __syncthreads"):
        inside_a_warp((1,), (32,), (np.ones(32, np.float32),))


def test_arguments_are_checked_as_the_device_would_read_them():
    k = cudasim.RawModule(COPY).get_function("copy")
    x, y = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="n is a long long"):
        k((1,), (8,), (x, y, np.int32(7)))              # CuPy would pass 4 bytes for 8
    with pytest.raises(TypeError, match="n is a long long"):
        k((1,), (8,), (x, y, 7))                        # a Python int
    with pytest.raises(TypeError, match="C-contiguous float32 array, got float64"):
        k((1,), (8,), (x.astype(np.float64), y, np.int64(7)))
    with pytest.raises(TypeError, match="strided"):
        k((1,), (8,), (np.zeros(16, np.float32)[::2], y, np.int64(7)))


def test_the_warp_shuffle_and_dynamic_shared_memory_behave_as_cuda_says():
    src = r"""
typedef double T;
typedef double A;
extern "C" __global__ void shuffle(T* x, int delta) {
    extern __shared__ unsigned char smem[];
    A* s = (A*)smem;
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = __shfl_down_sync(0xffffffff, s[threadIdx.x], delta);
}
"""
    k = cudasim.RawModule(src, dtype="float64").get_function("shuffle")
    x = np.arange(64, dtype=np.float64)
    k((1,), (64,), (x, np.int32(3)), shared_mem=64 * 8)
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(x, np.where(lane + 3 < 32, np.arange(64) + 3, np.arange(64)))
    with pytest.raises(cudasim.KernelFault,
                       match=r"extern __shared__ memory\[1\] is outside its 1 elements"):
        k((1,), (64,), (x, np.int32(1)), shared_mem=8)  # too little shared memory


def test_an_atomic_add_on_bf16_is_refused_at_compile_time_as_nvrtc_refuses_it():
    """CUDA has no atomicAdd for our bf16 type (a kernel adds bf16 sums in its float ``A``):
    the model refuses to compile one, as NVRTC does, rather than run it."""
    source = fused.BF16 + r"""
typedef bf16 T;
typedef float A;
extern "C" __global__ void add_all(const T* x, T* total, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}
"""
    with pytest.raises(RuntimeError, match="atomicAdd: no overload for this type in CUDA"):
        cudasim.RawModule(source, "bfloat16")
