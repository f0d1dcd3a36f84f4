"""--precision fp8 (device/fp8.py): e4m3 forward operands and e5m2 gradients of the linear
layers' GEMMs, scaled per tensor by a power of two. The rounding against ml_dtypes' float8
types bit for bit; a linear layer's forward and backward against the same GEMMs written
from ml_dtypes' casts; the trainer's fp8 run against its bf16 run, on the CPU and on the GPU
stand-in; the refusal on a GPU without FP8 tensor cores."""
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


def test_a_linear_layer_computes_on_fp8_values(device):
    """y = Q4(x) Q4(w) + b, dx = Q5(dy) Q4(w)^T, dw = Q4(x)^T Q5(dy): the layer's bf16
    results equal these float64 products of ml_dtypes' fp8 values to bf16's rounding, and
    differ from the bf16 layer's (the fp8 path ran)."""
    from hpcdist.autograd import ops
    from hpcdist.autograd.tensor import Tensor
    bf16 = backend.bfloat16()
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 5, 48)) * 3).astype(bf16)
    w = (rng.standard_normal((48, 40)) * 0.02).astype(bf16)
    b = (rng.standard_normal(40) * 0.1).astype(bf16)
    dy = (rng.standard_normal((2, 5, 40)) * 1e-3).astype(bf16)

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
             qx.reshape(-1, 48).T @ qg.reshape(-1, 40), dy.astype(np.float64).sum((0, 1)))
    for got, want in zip((y, gx, gw, gb), wants):
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())
    plain = run(False)
    assert not np.array_equal(plain[0], y) and not np.array_equal(plain[2], gw)


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

    def spy(split=None):
        seen.append(fp8.linears())
        return made(split)
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
