"""--precision fp8 (device/fp8.py): e4m3 forward operands and e5m2 gradients of the linear
layers' GEMMs, scaled per tensor by a power of two. The rounding against ml_dtypes' float8
types bit for bit; a linear layer's forward and backward against the same GEMMs written
from ml_dtypes' casts; the trainer's fp8 run against its bf16 run, on the CPU and on the GPU
stand-in; the codes cuBLASLt's FP8 matmul takes, and a layer on them against the emulation;
the refusal on a GPU without FP8 tensor cores."""
import types

import numpy as np
import pytest

from hpcdist.device import backend, fp8

ml_dtypes = pytest.importorskip("ml_dtypes")
CASTS = {fp8.E4M3: ml_dtypes.float8_e4m3fn, fp8.E5M2: ml_dtypes.float8_e5m2}


@pytest.fixture(params=["cpu", "standin"])
def device(request):
    prev = backend.device_label()
    backend.init(request.param)
    yield request.param
    backend.init(prev)


def _values():
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(200_000) * 10.0 ** rng.uniform(-8, 5, 200_000)
    edges = [0.0, -0.0, 448, 449, 464, 465, 480, -500, 57344, 61440, 1e6, 2.0 ** -9,
             2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -16, 2.0 ** -17, 1.0625, 1.1875, np.nan]
    return np.concatenate([spread, edges]).astype(np.float32)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=str)
def test_rounding_equals_ml_dtypes_bit_for_bit(device, fmt):
    """Nearest, ties to even, subnormals, saturation at the largest finite value, NaN."""
    x = _values()
    got = backend.to_numpy(fp8.round_to_fp8(backend.to_device(x), fmt))
    want = np.clip(x, -fmt.max, fmt.max).astype(CASTS[fmt]).astype(np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same][:5], got[~same][:5], want[~same][:5])
    assert np.signbit(got[x == 0]).tolist() == np.signbit(x[x == 0]).tolist()


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=str)
def test_the_codes_are_ml_dtypes_bits(device, fmt):
    """fp8.encode (the codes' twin: kernels/fp8_gemm.py) writes ml_dtypes' bits for every
    rounded value, 0x7f for a NaN; fp8.decode reads every one of the 256 codes as ml_dtypes
    does and inverts encode."""
    q = fp8.round_to_fp8(backend.to_device(_values()), fmt)
    got = backend.to_numpy(fp8.encode(q, fmt))
    q = backend.to_numpy(q)
    want = q.astype(CASTS[fmt]).view(np.uint8)
    nan = np.isnan(q)
    assert nan.any() and (got[nan] == 0x7f).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    back = backend.to_numpy(fp8.decode(backend.to_device(got), fmt))
    np.testing.assert_array_equal(back, q)
    assert np.signbit(back[q == 0]).tolist() == np.signbit(q[q == 0]).tolist()
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(backend.to_numpy(fp8.decode(backend.to_device(every), fmt)),
                                  every.view(CASTS[fmt]).astype(np.float32))


def test_the_scale_is_the_largest_power_of_two_that_fits(device):
    for amax in (3e-5, 0.7, 1.0, 448.0, 449.0, 9e6):
        x = backend.to_device(np.array([amax / 3, -amax], dtype=np.float32))
        s = float(backend.to_numpy(fp8.scale_of(x, fp8.E4M3)))
        assert s == 2.0 ** np.floor(np.log2(448.0 / np.float32(amax)))
        assert amax * s <= 448.0 < amax * s * 2
    zeros = backend.to_device(np.zeros(4, np.float32))
    assert not backend.to_numpy(fp8.quantized(zeros, fp8.E4M3)).any()


def _oracle(x, fmt):
    """x quantized as the test writes it: ml_dtypes' cast of x times its power-of-two scale."""
    x = x.astype(np.float32)
    amax = np.abs(x).max()
    s = np.float32(2.0 ** np.floor(np.log2(fmt.max / amax))) if amax else np.float32(1)
    return np.clip(x * s, -fmt.max, fmt.max).astype(CASTS[fmt]).astype(np.float64) / s


@pytest.mark.parametrize("t,m", [(5, 40), (8, 32)], ids=["values", "codes"])
def test_a_linear_layer_computes_on_fp8_values(device, t, m):
    """y = Q4(x) Q4(w) + b, dx = Q5(dy) Q4(w)^T, dw = Q4(x)^T Q5(dy): the layer's bf16
    results equal these float64 products of ml_dtypes' fp8 values to bf16's rounding, and
    differ from the bf16 layer's (the fp8 path ran): on the values (any shape) and, on the
    stand-in, on the codes (dimensions of multiples of 16: kernels/fp8_gemm.py)."""
    from hpcdist.autograd import ops
    from hpcdist.autograd.tensor import Tensor
    bf16 = backend.bfloat16()
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, t, 48)) * 3).astype(bf16)
    w = (rng.standard_normal((48, m)) * 0.02).astype(bf16)
    b = (rng.standard_normal(m) * 0.1).astype(bf16)
    dy = (rng.standard_normal((2, t, m)) * 1e-3).astype(bf16)

    def run(on):
        fp8.set_linears(on)
        try:
            xt, wt, bt = (Tensor(backend.to_device(a), requires_grad=True) for a in (x, w, b))
            y = ops.linear(xt, wt, bt)
            y.backward(backend.to_device(dy))
            return [backend.to_numpy(a).astype(np.float64)
                    for a in (y.data, xt.grad, wt.grad, bt.grad)]
        finally:
            fp8.set_linears(False)
    y, gx, gw, gb = run(True)
    qx, qw, qg = _oracle(x, fp8.E4M3), _oracle(w, fp8.E4M3), _oracle(dy, fp8.E5M2)
    wants = (qx @ qw + b.astype(np.float64), qg @ qw.T,
             qx.reshape(-1, 48).T @ qg.reshape(-1, m), dy.astype(np.float64).sum((0, 1)))
    for got, want in zip((y, gx, gw, gb), wants):
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())
    plain = run(False)
    assert not np.array_equal(plain[0], y) and not np.array_equal(plain[2], gw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_stand_in_the_gemms_take_codes_equal_to_the_emulation(monkeypatch, dtype):
    """A linear layer whose dimensions are multiples of 16 runs its three GEMMs on fp8 codes
    (kernels/fp8_gemm.py: x's and dy's codes in both layouts, the weight's in the one its GEMM
    reads, forward and backward; cuBLASLt's FP8 matmul as its twin on the stand-in; the
    weight's gradient written into its buffer): its output and gradients equal the values'
    emulation (HPCDIST_FP8_GEMM=emulated) to a summation order, the weight's gradient added
    into what the buffer held; a layer of other dimensions keeps the emulation."""
    from hpcdist.autograd import ops
    from hpcdist.autograd.tensor import Tensor
    from hpcdist.device.kernels import fp8_gemm
    made, products = fp8_gemm.product, []
    monkeypatch.setattr(fp8_gemm, "product",
                        lambda *a, **k: products.append(a[0].shape) or made(*a, **k))
    coded, written = fp8_gemm.codes, []

    def codes(x, fmt, amax=None, layouts=fp8_gemm.BOTH):
        c = coded(x, fmt, amax, layouts)
        written.append((x.shape, c.rows is not None, c.cols is not None))
        return c
    monkeypatch.setattr(fp8_gemm, "codes", codes)
    dt = backend.dtype(dtype)
    rng = np.random.default_rng(4)

    def run(shape, emulated):
        monkeypatch.setenv("HPCDIST_FP8_GEMM", "emulated" if emulated else "codes")
        (n, t, k), m = shape, 32
        x, w = rng.standard_normal((n, t, k)) * 3, rng.standard_normal((k, m)) * 0.05
        b, dy = rng.standard_normal(m) * 0.1, rng.standard_normal((n, t, m)) * 1e-3
        xt, wt, bt = (Tensor(backend.to_device(a.astype(dt)), requires_grad=True)
                      for a in (x, w, b))
        wt.grad = backend.to_device(np.full((k, m), 0.25).astype(dt))   # (added into)
        fp8.set_linears(True)
        try:
            y = ops.linear(xt, wt, bt)
            y.backward(backend.to_device(dy.astype(dt)))
        finally:
            fp8.set_linears(False)
        return [backend.to_numpy(a).astype(np.float64) for a in (y.data, xt.grad, wt.grad)]
    prev = backend.device_label()
    backend.init("standin")
    try:
        for shape, codes in (((2, 8, 48), True), ((2, 5, 48), False)):
            rng = np.random.default_rng(4)
            got = run(shape, emulated=False)
            assert len(products) == (3 if codes else 0), products
            w_shape, both = (shape[2], 32), (True, True)     # x, w (cols), dy, w (rows)
            assert written == ([(shape, *both), (w_shape, False, True),
                                (shape[:2] + (32,), *both), (w_shape, True, False)]
                               if codes else []), written
            written.clear()
            rng = np.random.default_rng(4)
            want = run(shape, emulated=True)
            assert len(products) == (3 if codes else 0)
            products.clear()
            tol = 8e-3 if dtype == "bfloat16" else 1e-6
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=tol, atol=tol * np.abs(w).max())
            assert np.abs(got[2] - 0.25).max() > 0 and np.abs(got[2]).min() > 0.1
    finally:
        backend.init(prev)


def test_a_layer_kept_out_computes_as_in_bf16_forward_and_backward():
    """Inside fp8.kept_out() (the LM head, a router) a linear layer's forward and its backward,
    run after the context has closed, equal the bf16 layer's bit for bit; outside, they
    differ."""
    from hpcdist.autograd import ops
    from hpcdist.autograd.tensor import Tensor
    rng = np.random.default_rng(2)
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((6, 32), (32, 24), (6, 24)))

    def run(on, kept_out):
        fp8.set_linears(on)
        try:
            xt, wt = Tensor(x.copy(), requires_grad=True), Tensor(w.copy(), requires_grad=True)
            if kept_out:
                with fp8.kept_out():
                    y = ops.linear(xt, wt)
            else:
                y = ops.linear(xt, wt)
            y.backward(dy)
            return y.data, xt.grad, wt.grad
        finally:
            fp8.set_linears(False)
    plain, kept, quantized = run(False, False), run(True, True), run(True, False)
    for a, b, c in zip(plain, kept, quantized):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


@pytest.mark.parametrize("experts", [0, 4], ids=["llama", "mixtral"])
def test_the_lm_head_and_the_routers_are_kept_out(monkeypatch, experts):
    """Under fp8 the blocks' linear layers (attention's, the MLPs', the experts') compute in
    fp8; the untied LM head (the forward's last) and each mixture of experts' router do not."""
    from hpcdist.autograd.tensor import Tensor
    from hpcdist.device import kernels
    from hpcdist.nn.family import build
    from hpcdist.nn.moe import MoE
    seen, made = [], kernels.linear_operands

    def spy(split=None, *layer):
        seen.append(fp8.linears())
        return made(split, *layer)
    monkeypatch.setattr(kernels, "linear_operands", spy)
    model = build("llama", n_layer=2, n_embd=32, n_head=4, experts=experts, top_k=2)
    idx = np.random.default_rng(0).integers(0, 16, (2, 8))
    fp8.set_linears(True)
    try:
        _, loss = model(idx, idx)
        loss.backward()
    finally:
        fp8.set_linears(False)
    routers = sum(isinstance(m, MoE) for m in model.modules())
    assert routers == (2 if experts else 0)
    assert seen[-1] is False and seen.count(False) == routers + 1
    assert seen.count(True) >= 8                         # (4 a block at least)
    assert isinstance(loss, Tensor)


def test_the_linear_layer_equals_pytorchs_scaled_mm_on_the_same_codes():
    """bench gpu's fp8 peer (bench/float8_peer.py: torchao's tensorwise recipe through
    ``torch._scaled_mm``, which PyTorch runs on the CPU too) quantizes every operand to the
    values hpcdist's emulation computes on, bit for bit, and its forward and both gradients
    equal the layer's to bf16's rounding: the peer and the emulation are one recipe."""
    torch = pytest.importorskip("torch")
    from hpcdist.autograd import ops
    from hpcdist.autograd.tensor import Tensor
    from hpcdist.bench.float8_peer import float8_matmul, to_fp8
    prev = backend.device_label()
    backend.init("cpu")
    bf16 = backend.bfloat16()
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 16, 64)) * 3).astype(bf16)
    w = (rng.standard_normal((64, 48)) * 0.02).astype(bf16)
    dy = (rng.standard_normal((2, 16, 48)) * 1e-3).astype(bf16)
    tx0, tw0, tdy = (torch.tensor(a.astype(np.float32)).to(torch.bfloat16) for a in (x, w, dy))
    for a, t, dtype, fmt in ((x, tx0, torch.float8_e4m3fn, fp8.E4M3),
                             (w, tw0, torch.float8_e4m3fn, fp8.E4M3),
                             (dy, tdy, torch.float8_e5m2, fp8.E5M2)):
        codes, inv = to_fp8(t, dtype, fmt.max)
        np.testing.assert_array_equal((codes.float() * inv).numpy(),
                                      fp8.quantized(a.astype(np.float32), fmt))
    fp8.set_linears(True)
    try:
        xt, wt = (Tensor(a, requires_grad=True) for a in (x, w))
        y = ops.linear(xt, wt, None)
        y.backward(dy)
        ours = [a.astype(np.float64) for a in (y.data, xt.grad, wt.grad)]
    finally:
        fp8.set_linears(False)
        backend.init(prev)
    tx, tw = (t.clone().requires_grad_() for t in (tx0, tw0))
    ty = float8_matmul(tx, tw)
    ty.backward(tdy)
    for got, want in zip(ours, (ty, tx.grad, tw.grad)):
        want = want.detach().double().numpy()
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -8 * np.abs(want).max())


def _trained(tmp_path, device, precision):
    from hpcdist import train
    from hpcdist.comm import Communicator
    cfg = train.parse_config(["--steps", "30", "--log-every", "30", "--device", device,
                              "--precision", precision, "--lr", "1e-3",
                              "--out-dir", str(tmp_path / f"{device}-{precision}")])
    lines = []
    final = train.train(cfg, comm=Communicator(), log=lambda *a, **k: lines.append(str(a)))
    return final, lines


def test_the_trainer_in_fp8_follows_bf16_and_the_stand_in_follows_the_cpu(tmp_path):
    """30 steps: fp8's losses stay within 3% of bf16's at every step (and differ from them);
    the GPU stand-in's fp8 run equals the CPU's to bf16's tolerance; the header says fp8."""
    prev = backend.device_label()
    try:
        bf16, _ = _trained(tmp_path, "cpu", "bf16")
        cpu, lines = _trained(tmp_path, "cpu", "fp8")
        standin, _ = _trained(tmp_path, "standin", "fp8")
    finally:
        backend.init(prev)
    assert any("fp8: the linear layers' GEMMs on e4m3 operands" in line for line in lines)
    losses = {k: np.array([r["loss"] for r in run["history"]])
              for k, run in (("bf16", bf16), ("cpu", cpu), ("standin", standin))}
    np.testing.assert_allclose(losses["cpu"], losses["bf16"], rtol=3e-2)
    assert not np.array_equal(losses["cpu"], losses["bf16"])
    assert losses["cpu"][-1] < losses["cpu"][0] * 0.8                   # it learns
    np.testing.assert_allclose(losses["standin"], losses["cpu"], rtol=2e-2)


def test_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line(monkeypatch):
    props = {"major": 8, "minor": 0}
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: props)))
    monkeypatch.setattr(fp8.backend, "device_label", lambda: "gpu")
    monkeypatch.setattr(fp8.backend, "xp", lambda: fake)
    assert fp8.fp8_cores_problem() == ("FP8 tensor cores need compute capability 9.0 or later "
                                    "(H100, H200, B200); this GPU's is 8.0")
    props.update(major=9)
    assert fp8.fp8_cores_problem() is None
