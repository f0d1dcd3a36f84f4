"""CUDA graphs (device/graphs.py): a training step's forward and backward captured once and
replayed, each step's batch copied into the array the graph reads, equal to the same steps run
eagerly. On the GPU stand-in (the default here) every call captures again and the capture
refuses device reads, synchronizations and host copies as CUDA does; under make test-gpu
($HPCDIST_DEVICE=gpu, tests/gpu/session.sh) the same tests replay a real graph."""
import numpy as np
import pytest

from hpcdist.device import backend, graphs
from hpcdist.device.errors import DeviceError
from hpcdist.device.surface import READS


@pytest.fixture
def device():
    """The GPU where the suite runs on one, else the GPU stand-in."""
    prev = backend.device_label()
    label = "gpu" if prev == "gpu" else "standin"
    backend.init(label)
    yield label
    backend.init(prev)


def _train(graph: bool, precision="fp32", arch="gpt", steps=5):
    """(the loss of each step, the master weights after, the step) of ``steps`` AdamW steps
    of the benchmark's step (bench/gpu.py) on a new batch each, forward and backward
    captured (``graph``) or eager."""
    from hpcdist.bench import gpu
    before, gpu.ARCH[0] = gpu.ARCH[0], arch
    try:
        step, _ = gpu._step_fn(2, 32, 8, 2, 17, 4, precision=precision, graph=graph)
    finally:
        gpu.ARCH[0] = before
    rng, losses = np.random.default_rng(1), []
    for _ in range(steps):
        step.idx[...] = backend.to_device(rng.integers(0, 17, (2, 8)))   # what the graph reads
        losses.append(float(step()))
    return losses, backend.to_numpy(step.master.data).copy(), step


@pytest.mark.parametrize("arch,precision", [("gpt", "fp32"), ("gpt", "bf16"),
                                            ("llama", "fp32"), ("llama", "bf16"),
                                            ("gpt", "fp8")])
def test_replayed_steps_equal_eager_steps_with_a_new_batch_each(device, arch, precision):
    want_losses, want_weights, _ = _train(False, precision, arch)
    losses, weights, step = _train(True, precision, arch)
    assert step.graph.captures == 1             # 2 warm-up calls, 1 capture, 2 replays
    tol = 1e-5 if precision == "fp32" else 2e-2                     # (atomics' order on a GPU)
    np.testing.assert_allclose(losses, want_losses, rtol=tol)
    # the weights to 1e-4 absolute: a GPU's atomics (norms' and the embedding's weight
    # gradients) sum in any order, and AdamW turns a near-zero gradient's flipped sign into a
    # step of up to lr (an H200 showed 3.2e-5 in 32 of 6,992 fp32 weights at lr 1e-2)
    np.testing.assert_allclose(weights, want_weights, rtol=tol, atol=1e-4)
    assert len(set(np.round(losses, 4))) == len(losses)             # the batches differed


def test_a_host_read_inside_the_step_is_refused_and_the_stream_left_usable(device):
    x = backend.to_device(np.arange(4.0))

    def reads():
        return float((x * 2).sum())           # a decision on a device value: no graph holds it

    step = graphs.capture(reads, warmup=1)
    assert step() == 12.0                     # the warm-up runs eagerly
    with pytest.raises(DeviceError, match="cannot be captured as a CUDA graph"):
        step()
    assert READS.capturing == 0
    fine = graphs.capture(lambda: x * 3, warmup=1)
    fine()
    np.testing.assert_array_equal(backend.to_numpy(fine()), [0.0, 3.0, 6.0, 9.0])


def test_a_host_array_copied_in_inside_the_step_is_refused(device):
    """CuPy refuses a host-to-device copy in a capture (rotary's frequencies were one, seen
    on an H200); a scalar it writes by a kernel, which a capture takes."""
    x = backend.to_device(np.arange(4.0))
    step = graphs.capture(lambda: x * backend.to_device(np.arange(4.0)), warmup=1)
    step()
    with pytest.raises(DeviceError, match="H2D|host-to-device"):
        step()
    scalar = graphs.capture(lambda: x * backend.xp().asarray(2.0), warmup=1)
    scalar()
    np.testing.assert_array_equal(backend.to_numpy(scalar()), [0.0, 2.0, 4.0, 6.0])


def test_a_synchronization_inside_the_step_is_refused(device):
    if device != "standin":
        pytest.skip("the GPU stand-in's refusal; a GPU's own refusal ends the capture itself")
    step = graphs.capture(lambda: backend.xp().cuda.get_current_stream().synchronize(), 1)
    step()
    with pytest.raises(DeviceError, match="synchronization"):
        step()


def test_a_replay_reads_the_arrays_now_and_the_host_values_of_the_capture(device):
    """A graph holds its kernels' arguments: an array's values are read at each replay, a
    Python number stays what it was at the capture. The GPU stand-in replays the launches it
    recorded, not the Python, so a value frozen there is frozen here too."""
    x = backend.to_device(np.arange(3.0))
    scale = [2.0]
    step = graphs.capture(lambda: x * scale[0], warmup=1)
    np.testing.assert_array_equal(backend.to_numpy(step()), [0.0, 2.0, 4.0])    # eager
    scale[0] = 3.0
    np.testing.assert_array_equal(backend.to_numpy(step()), [0.0, 3.0, 6.0])    # captured
    scale[0] = 5.0
    x[...] = backend.to_device(np.ones(3))
    np.testing.assert_array_equal(backend.to_numpy(step()), [3.0, 3.0, 3.0])    # replayed
    assert step.replayed and step.captures == 1


def test_a_replay_recomputes_copies_that_look_like_views_and_elements(device):
    """Reshaping a transposed array copies it (a kernel on a GPU); an element is a 0-d
    device array: both are recomputed at each replay (the GPU stand-in once kept the capture's
    copy, and gave elements as host numbers)."""
    y = backend.to_device(np.arange(6.0).reshape(2, 3))
    step = graphs.capture(lambda: (y.T.reshape(-1), y[1, 2] + 1.0), warmup=1)
    step()
    step()
    y[...] = backend.to_device(np.arange(6.0).reshape(2, 3) * 10)
    flat, element = step()
    np.testing.assert_array_equal(backend.to_numpy(flat), [0, 30, 10, 40, 20, 50])
    assert backend.to_numpy(element) == 51.0


def test_the_cpu_runs_the_step_and_a_capture_needs_a_warm_up():
    with pytest.raises(ValueError, match="warm-up"):
        graphs.capture(lambda: None, warmup=0)
    if backend.device_label() == "cpu":
        calls = []
        step = graphs.capture(lambda: calls.append(1) or len(calls))
        assert [step() for _ in range(4)] == [1, 2, 3, 4] and step.captures == 0


def _trained(tmp_path, device, *flags):
    from hpcdist import train
    from hpcdist.comm import Communicator
    lines = []
    cfg = train.parse_config(["--steps", "6", "--log-every", "3", "--device", device,
                              "--out-dir", str(tmp_path / "-".join((device,) + flags)),
                              *flags])
    final = train.train(cfg, comm=Communicator(), log=lambda *a, **k: lines.append(str(a)))
    return final, lines


@pytest.mark.parametrize("flags", [(), ("--precision", "bf16", "--grad-accum", "2"),
                                   ("--arch", "llama", "--n-kv-head", "2")])
def test_the_trainer_with_cuda_graphs_equals_the_trainer_without(tmp_path, device, flags):
    """--cuda-graph: the same losses and gradient norms step by step (a new batch each
    micro-batch, copied into the graph's arrays; DDP's average after backward), the header
    says so."""
    plain, _ = _trained(tmp_path, device, *flags)
    graphed, lines = _trained(tmp_path, device, "--cuda-graph", *flags)
    assert any("the whole step replayed as one CUDA graph" in line for line in lines), lines[:2]
    tol = 2e-2 if "bf16" in flags else 1e-5
    for g, p in zip(graphed["history"], plain["history"], strict=True):
        np.testing.assert_allclose([g["loss"], g["grad_norm"]], [p["loss"], p["grad_norm"]],
                                   rtol=tol)


def test_the_whole_step_replays_as_one_launch_with_no_device_read(tmp_path):
    """One replica: forward, backward, clipping and AdamW (its learning rate and step count
    on the device) are one graph; a replayed step is its launch and the copies of the loss
    and the norm out of it, and reads nothing to the host. The learning rate follows the
    warmup and the cosine as the eager run's does (the losses above: equal)."""
    from hpcdist.host import timeline
    prev = backend.device_label()
    rec = timeline.Recorder(0)
    timeline.activate(rec)
    try:
        backend.init("standin")
        _trained(tmp_path, "standin", "--cuda-graph", "--grad-clip", "0.5", "--warmup", "2")
    finally:
        timeline.deactivate()
        backend.init(prev)
    steps = [args for name, _, _, _, _, args in rec.events if name == "step"]
    assert [s["device_reads"] for s in steps] == [0] * 6, steps
    assert [s["launches"] for s in steps[3:]] == [3] * 3, steps    # replays: steps 4-6
    assert min(s["launches"] for s in steps[:3]) > 50, steps       # warm-up and capture


@pytest.mark.parametrize("faster", ["graph", "eager"])
def test_auto_times_both_ways_and_keeps_the_faster(tmp_path, monkeypatch, faster):
    """--cuda-graph auto: steps 2-3 eager and 6-7 replayed are timed, the faster kept and
    said; either way the losses equal the eager run's (the host's learning rate back when
    eager wins). The clock is the test's: the graph's window reads 1 ms a step, the eager
    one 2 ms (or the other way)."""
    from hpcdist.run import graphed
    prev = backend.device_label()
    backend.init("standin")
    clock = iter([0.0, 2e-3 * 2, 1.0, 1.0 + 1e-3 * 2] if faster == "graph" else
                 [0.0, 1e-3 * 2, 1.0, 1.0 + 2e-3 * 2])
    monkeypatch.setattr(graphed.AutoChoice, "clock", staticmethod(lambda: next(clock)))
    try:
        plain, _ = _trained(tmp_path, "standin", "--steps", "10")
        auto, lines = _trained(tmp_path, "standin", "--cuda-graph", "auto", "--steps", "10")
    finally:
        backend.init(prev)
    said = [line for line in lines if "--cuda-graph auto:" in line]
    assert "steps 2-3 eager and 6-7 as a graph timed" in said[0], said
    want = ("2.00 ms a step eager, 1.00 ms replayed as a graph: graph from here on"
            if faster == "graph" else
            "1.00 ms a step eager, 2.00 ms replayed as a graph: eager from here on")
    assert any(want in line for line in said), said
    for g, p in zip(auto["history"], plain["history"], strict=True):
        np.testing.assert_allclose([g["loss"], g["grad_norm"]], [p["loss"], p["grad_norm"]],
                                   rtol=1e-5)


def test_auto_stays_eager_where_a_graph_cannot_hold_the_step(tmp_path, device):
    """What --cuda-graph on refuses, auto runs eagerly, and its header says why."""
    _, lines = _trained(tmp_path, device, "--cuda-graph", "auto", "--dropout", "0.1")
    assert any("--cuda-graph auto: eager (dropout's random offsets" in line
               for line in lines), lines[:1]


@pytest.mark.parametrize("flags,words", [(("--experts", "4"), "mixture of experts"),
                                         (("--dropout", "0.1"), "dropout"),
                                         (("--precision", "fp16"), "loss scale"),
                                         (("--tp", "2"), "tensor, pipeline and context"),
                                         (("--zero", "1"), "--zero 1")])
def test_what_a_graph_cannot_hold_is_refused_before_the_run(flags, words):
    from hpcdist import train
    from hpcdist.run.config import ConfigError, validate
    with pytest.raises(ConfigError, match=words) as e:
        validate(train.parse_config(["--cuda-graph", *flags]))
    assert "run without --cuda-graph" in str(e.value)


def test_auto_leaves_attentions_gemm_path_out_of_a_graphed_run(monkeypatch):
    """The GEMM path's batched GEMMs go through CuPy, whose cuBLAS refuses a capture: a
    graphed run's auto does not weigh it (on a GPU; the device label stands in here)."""
    from hpcdist.device.kernels import attention
    monkeypatch.setattr(attention.backend, "device_label", lambda: "gpu")
    qkv = np.zeros((2, 64, 3 * 128), np.float32)            # T 64, 2 heads of 64: gemms may run
    try:
        attention.configure("auto")
        assert "gemms" in attention.candidates(qkv, 2, 2)
        attention.configure("auto", graphs=True)
        assert "gemms" not in attention.candidates(qkv, 2, 2)
    finally:
        attention.configure("auto")


def test_cuda_graph_refuses_the_gemm_attention_path():
    from hpcdist import train
    from hpcdist.run.config import ConfigError, validate
    with pytest.raises(ConfigError, match="GEMM path"):
        validate(train.parse_config(["--cuda-graph", "--attention", "gemms", "--device", "gpu"]))
