import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import hpcdist as hd  # noqa: E402
from hpcdist.device import backend  # noqa: E402

# The unit tests run on the device $HPCDIST_DEVICE names (cpu unless set): make test-gpu runs
# the op gradchecks and the PyTorch oracles with HPCDIST_DEVICE=gpu, and HPCDIST_DEVICE=standin
# runs them on the GPU stand-in without a GPU. Comparisons take device arrays: the
# np.testing assertions below copy them to the host first (a CuPy array refuses implicit
# conversion).
backend.init(os.environ.get("HPCDIST_DEVICE", "cpu"))


def _on_host(fn):
    def compare(actual, desired, *args, **kwargs):
        return fn(_host(actual), _host(desired), *args, **kwargs)
    compare.__name__ = fn.__name__
    return compare


def _host(x):
    if isinstance(x, hd.Tensor):
        x = x.data
    return backend.to_numpy(x) if backend.is_gpu_array(x) else x


for _name in ("assert_allclose", "assert_array_equal", "assert_array_less"):
    setattr(np.testing, _name, _on_host(getattr(np.testing, _name)))


@pytest.fixture(autouse=True)
def _no_fp8_after():
    """A run's --precision fp8 (a process-wide setting each run makes) ends with its test:
    the ops of the next test compute as it asks."""
    yield
    from hpcdist.device import fp8
    fp8.set_linears(False)


@pytest.fixture
def float64():
    """New parameters and float tensors in float64 for the duration of a test."""
    prev = backend.default_float()
    backend.set_default_float("float64")
    yield
    backend.set_default_float(prev)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def numerical_grad(f, arrays, i, weights, eps=1e-6):
    """Central differences of sum(f(*arrays) * weights) with respect to arrays[i]."""
    a = arrays[i]
    grad = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + eps
        plus = float((_host(f(*[hd.tensor(x) for x in arrays])) * weights).sum())
        a[idx] = old - eps
        minus = float((_host(f(*[hd.tensor(x) for x in arrays])) * weights).sum())
        a[idx] = old
        grad[idx] = (plus - minus) / (2 * eps)
    return grad


def gradcheck(f, *arrays, wrt=None, atol=1e-6, rtol=1e-5, seed=0):
    """Compare autograd's gradient of a random projection of f with central differences."""
    arrays = [np.array(_host(a), dtype=np.float64) for a in arrays]
    wrt = range(len(arrays)) if wrt is None else wrt
    tensors = [hd.tensor(a.copy(), requires_grad=(i in wrt)) for i, a in enumerate(arrays)]
    out = f(*tensors)
    weights = np.random.default_rng(seed).standard_normal(out.shape)
    (out * hd.tensor(weights)).sum().backward()
    for i in wrt:
        num = numerical_grad(f, arrays, i, weights)
        np.testing.assert_allclose(tensors[i].grad, num, atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {i}")
    return out


def pytest_collection_modifyitems(config, items):
    """HPCDIST_QUICK=1 (make test-quick): the tests listed in tests/slow.txt are left out."""
    if os.environ.get("HPCDIST_QUICK") != "1":
        return
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "slow.txt")) as f:
        slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    root = os.path.dirname(here)
    keep, drop = [], []
    for item in items:
        path = os.path.relpath(str(item.path), root)
        name = f"{path}::{item.originalname if hasattr(item, 'originalname') else item.name}"
        (drop if name in slow else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
