"""The elementwise and row kernels' 16-byte path (kernels/common.py's vectors), on the CPU's
model of the device: the launcher takes 16 bytes a thread only where every array starts on 16
bytes and no vector straddles a row, the self-check cases run both variants, a 16-byte access
off its alignment is a fault in the model as it is on a GPU, and autograd's engine sums two
gradients through the kernel."""
import numpy as np
import pytest

from hpcdist.device import backend, cudasim
from hpcdist.device.kernels import colsum, common, elementwise, layernorm, moe, rmsnorm, rows
import hpcdist.device.kernels as kernels

pytestmark = pytest.mark.skipif(cudasim.available() is not None,
                                reason=f"the CUDA execution model: {cudasim.available()}")

# (op, the module whose launcher asks for a vector width: common's ``vectors`` for the
# elementwise ones)
VECTORIZED = [(kernels.GELU_FWD, common), (kernels.BIAS_GELU, common),
              (kernels.GELU_BWD, common), (kernels.BIAS_RESIDUAL, common),
              (kernels.ADD, common), (kernels.LAYERNORM_FWD, layernorm),
              (kernels.LAYERNORM_BWD, layernorm), (kernels.RMSNORM_FWD, rmsnorm),
              (kernels.RMSNORM_BWD, rmsnorm), (kernels.SWIGLU_FWD, common),
              (kernels.SWIGLU_BWD, common), (kernels.GEGLU_FWD, common),
              (kernels.GEGLU_BWD, common), (kernels.WIDEN, common),
              (kernels.CROSS_ENTROPY_FWD, rows), (kernels.CROSS_ENTROPY_BWD, rows),
              (kernels.COLSUM_ADD, colsum), (kernels.ROTARY, common), (kernels.MOE_PERMUTE, moe),
              (kernels.MOE_COMBINE, moe), (kernels.MOE_COMBINE_BWD, moe)]
IDS = [op.name for op, _ in VECTORIZED]


def test_the_width_is_16_bytes_only_where_every_array_allows_it():
    bf16 = backend.dtype("bfloat16")
    buf = np.zeros(1024 + 8, dtype=np.float32)
    start = (-buf.ctypes.data % 16) // 4                  # the first element on 16 bytes
    a = buf[start:start + 1024]
    assert common.vector_width(1024, a) == 4
    assert common.vector_width(1024, a, row=64) == 4
    assert common.vector_width(1024, a, row=66) == 1      # a vector would straddle a row
    assert common.vector_width(1022, a[:1022]) == 1       # n not a multiple of 4
    assert common.vector_width(1020, a[1:1021]) == 1      # 4 bytes off 16
    assert common.vector_width(1020, a[4:1024]) == 4      # 16 bytes on: aligned again
    assert common.vector_width(1024, a, buf[start + 1:start + 1025]) == 1   # any array off
    assert common.vector_width(1024, a.view(np.uint16)[:1024].view(bf16)) == 8
    assert common.vector_width(512, a[:1024].view(np.float64)) == 2
    common.VECTORS[0] = False
    try:
        assert common.vector_width(1024, a) == 1
    finally:
        common.VECTORS[0] = True


@pytest.mark.parametrize("op,module", VECTORIZED, ids=IDS)
def test_the_self_check_runs_both_widths(op, module, monkeypatch):
    """Each vectorized op's own cases take the 16-byte path and the one-element path, so
    `make test`'s three thread orders cover both (a case list that lost one fails here)."""
    widths = []
    real = common.vector_width

    def spy(n, *arrays, row=None):
        widths.append(real(n, *arrays, row=row))
        return widths[-1]
    monkeypatch.setattr(module, "vector_width", spy)
    for dtype in [d for d in ("float32", "bfloat16") if d in op.dtypes]:
        widths.clear()
        assert op.worst_error(dtype, cudasim.kernels(op, dtype)) <= op.tolerance_for(dtype)
        assert set(widths) == {1, 16 // backend.dtype(dtype).itemsize}, (dtype, widths)


def _unaligned(shape, dtype, rng):
    """A C-contiguous array of ``shape`` that starts 4 bytes past a 16-byte boundary."""
    n = int(np.prod(shape))
    item = np.dtype(dtype).itemsize
    buf = np.zeros(n + 32 // item, dtype=dtype)
    start = ((-buf.ctypes.data % 16) + 4) // item
    out = buf[start:start + n].reshape(shape)
    out[...] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    assert common.address(out) % 16 == 4
    return out


def test_an_array_off_16_bytes_runs_one_element_a_thread_and_equals_the_twin():
    """A bias that is a view into a flat parameter buffer may start anywhere: the launcher
    falls back, and the result is the twin's."""
    rng = np.random.default_rng(0)
    out = rng.standard_normal((6, 64)).astype(np.float32)
    bias, residual = _unaligned((64,), np.float32, rng), rng.standard_normal((6, 64)).astype(
        np.float32)
    want = kernels.bias_residual_twin(out.copy(), bias, residual)
    got = elementwise._bias_residual_launch(cudasim.kernels(kernels.BIAS_RESIDUAL, "float32"),
                                            out.copy(), bias, residual)
    np.testing.assert_array_equal(got, want)
    x, w, b = _unaligned((5, 96), np.float32, rng), np.ones(96, np.float32), np.zeros(96,
                                                                                   np.float32)
    y = layernorm._layernorm_launch(cudasim.kernels(kernels.LAYERNORM_FWD, "float32"),
                                    x, w, b, 1e-5)[0]
    np.testing.assert_allclose(y, kernels.layernorm_twin(x.copy(), w, b, 1e-5)[0], atol=1e-5)


def test_a_16_byte_access_off_its_alignment_is_a_fault_in_the_model():
    """What the launcher's check prevents: a uint4 load from an address off 16 bytes is a
    misaligned-address error on a GPU; the model names it rather than reading the bytes."""
    rng = np.random.default_rng(1)
    x = _unaligned((64,), np.float32, rng)
    fn = cudasim.kernels(kernels.GELU_FWD, "float32")("gelu_fwd", {"VEC": 4})
    with pytest.raises(cudasim.KernelFault, match="16-byte load at element .*not 16-byte aligned"):
        fn((1,), (16,), (x, np.zeros(64, np.float32), np.int64(64)))


def test_a_bf16_gradient_widens_into_its_float32_bucket_exactly():
    """DDP's mixed-precision cast (kernels.WIDEN): a bucket's view of the master gradient,
    written in place, every bf16 value exactly; another target dtype takes the assignment."""
    rng = np.random.default_rng(3)
    bf16 = backend.dtype("bfloat16")
    src = rng.standard_normal(4096).astype(np.float32).astype(bf16)
    master = np.zeros(8192, np.float32)
    bucket = master[1024:1024 + 4096]                   # 4 KiB in: on 16 bytes
    got = elementwise._widen_launch(cudasim.kernels(kernels.WIDEN, "bfloat16"), src, bucket)
    assert got is bucket and common.vector_width(4096, src, bucket) == 8
    np.testing.assert_array_equal(master[1024:5120], src.astype(np.float32))
    assert not master[:1024].any() and not master[5120:].any()
    wide = np.zeros(4096, np.float64)
    elementwise._widen_launch(cudasim.kernels(kernels.WIDEN, "bfloat16"), src, wide)
    np.testing.assert_array_equal(wide, src.astype(np.float64))


def test_a_bias_gradient_is_the_same_bits_from_one_chunk_or_many_and_every_call():
    """COLSUM_ADD over chunks of rows (the grid's y) adds the chunks' sums in chunk order: the
    same bits at every call (its counters are back at zero after each), within rounding of
    the one-chunk sum, and the counters' reset is what makes a second call right."""
    rng = np.random.default_rng(4)
    g = rng.standard_normal((1024, 768)).astype(np.float32)
    k = cudasim.kernels(kernels.COLSUM_ADD, "float32", order=2, seed=5)
    outs = [colsum._colsum_launch(k, g, np.zeros(768, np.float32)) for _ in range(3)]
    assert colsum.chunks(1024, 768 // 128) > 1
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_allclose(outs[0], g.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-4)
    assert not common.kept_zeros(np, 1, np.uint32, "colsum counters").any()


def test_the_engine_sums_two_gradients_through_the_kernel_on_a_device(monkeypatch):
    """A tensor used twice (the residual stream) gets its two gradients summed by kernels.ADD
    on a device: the gradient equals the CPU's, and the op was called."""
    from hpcdist.autograd.tensor import Tensor
    calls = []
    real = type(kernels.ADD).__call__
    monkeypatch.setattr(type(kernels.ADD), "__call__",
                        lambda self, *a: (calls.append(self.name), real(self, *a))[1])
    x0 = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    grads = {}
    for device in ("cpu", "standin"):
        backend.init(device)
        try:
            x = Tensor(backend.to_device(x0), requires_grad=True)
            y = (x * x + x).sum()                       # x reaches the sum by two paths
            y.backward()
            grads[device] = backend.to_numpy(x.grad)
        finally:
            backend.init("cpu")
    np.testing.assert_allclose(grads["standin"], grads["cpu"], rtol=1e-6)
    np.testing.assert_allclose(grads["cpu"], 2 * x0 + 1, rtol=1e-6)
    assert "add2" in calls
