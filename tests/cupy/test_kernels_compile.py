"""Every fused kernel's CUDA source compiles with NVRTC for sm_80 (A100) and sm_90 (H100/H200),
in float and double — no GPU needed (make test-cupy installs NVRTC's wheel)."""
import pytest

pytest.importorskip("cupy", reason="CuPy is not installed: make test-cupy installs it")

from hpcdist.device import fused, kernels  # noqa: E402,F401  (kernels registers them)

SOURCES = sorted(fused.sources().items())


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("key,source", SOURCES, ids=[f"{n}-{d}" for (n, d), _ in SOURCES])
def test_the_kernel_compiles(key, source, arch):
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source, f"{key[0]}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}"])
    except nvrtc.NVRTCError:
        pytest.fail(f"{key} does not compile for {arch}:\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    for kernel in fused.registry()[key[0]].kernels:
        assert kernel.encode() in (ptx if isinstance(ptx, bytes) else ptx.encode())
