"""The GPU stand-in offers only what CuPy 14 offers (make test-cupy: needs the CuPy wheel,
which installs and imports without a GPU). Each planted mismatch below is one that reached a
GPU before this test existed."""
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: make test-cupy installs it")

import surface  # noqa: E402  (tests/cupy/surface.py)
from hpcdist.device import standin as dd  # noqa: E402


def tables(**changes):
    out = {name: dict(getattr(dd, name)) if name != "FLAGS" else tuple(dd.FLAGS)
           for name in ("MODULE", "NDARRAY", "CUDA", "CUPYX", "RANDOM", "NCCL", "FLAGS")}
    for table, value in changes.items():
        out[table] = value
    return out


def test_every_name_the_emulated_gpu_offers_is_cupys_with_its_kind_and_arguments():
    found = surface.problems()
    assert not found, f"{len(found)} mismatches, the first: {found[0]}"


def test_the_cublas_names_of_the_tensor_core_gemms_are_cupys_and_cublass():
    """kernels/gemm.py's gemmEx call, handle, compute types and constants (CUBLAS): present,
    of their kind, and gemmEx's typed arguments as cuBLAS's wrapper declares them."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except ImportError as e:
        pytest.skip(f"cuBLAS's library is not installed ({e}): make test-cupy installs it")
    assert surface.problems({"CUBLAS": dict(dd.CUBLAS)}) == []
    planted = dict(dd.CUBLAS, **{"cublas.gemmEx": ("function", "(intptr_t handle, int transa, "
                                                   "int transb, int m, int n, int k)")})
    found = surface.problems({"CUBLAS": planted})
    assert found and found[0].startswith("cublas.gemmEx"), found
    missing = dict(dd.CUBLAS, **{"linalg.COMPUTE_TYPE_TF16": ("constant", None)})
    assert surface.problems({"CUBLAS": missing}) == [
        "linalg.COMPUTE_TYPE_TF16: CuPy has no such name"]


def test_a_planted_flags_writeable_is_caught():
    found = surface.problems(tables(FLAGS=dd.FLAGS + ("writeable",)))
    assert found and "writeable" in found[0], found


def test_a_planted_nccl_id_of_another_type_is_caught():
    nccl = dict(dd.NCCL, get_unique_id=("function", "() -> tuple"))
    found = surface.problems(tables(NCCL=nccl))
    assert found == ["cupy.cuda.nccl.get_unique_id: returns bytes in CuPy, tuple in the GPU "
                     "stand-in"]
    ctor = dict(dd.NCCL, NcclCommunicator=("class", "(int ndev, tuple commId, int rank)"))
    found = surface.problems(tables(NCCL=ctor))
    assert found and "commId" in found[0] and "bytes" in found[0], found


def test_a_planted_bit_generator_state_property_is_caught():
    rnd = dict(dd.RANDOM, **{"XORWOW.state": ("property", None)})
    found = surface.problems(tables(RANDOM=rnd))
    assert found == ["cupy.random.XORWOW.state: a property in the GPU stand-in, a method in CuPy"]


def test_planted_names_kinds_and_arguments_are_caught():
    cases = {
        "scatter_add": ("function", "(a, idx, values)"),          # cupy has it in cupyx only
        "exp": ("function", "(x)"),                               # a ufunc, not a function
        "maximum": ("ufunc", "(x)"),                              # two inputs
        "asarray": ("function", "(a, dtype=None, device=None)"),  # no such keyword
        "triu": ("function", "(k, m)"),                           # positions swapped
    }
    for name, entry in cases.items():
        found = surface.problems(tables(MODULE={name: entry}, NDARRAY={}, CUDA={}, CUPYX={},
                                        RANDOM={}, NCCL={}, FLAGS=()))
        assert found and found[0].startswith(f"cupy.{name}"), (name, found)
    found = surface.problems(tables(NDARRAY={"shape": ("method", "(self)")}, MODULE={},
                                    CUDA={}, CUPYX={}, RANDOM={}, NCCL={}, FLAGS=()))
    assert found == ["cupy.ndarray.shape: a method in the GPU stand-in, a property in CuPy"]
