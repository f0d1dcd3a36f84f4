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


VARIANTS = [(name, dt, hs) for name, op in sorted(fused.registry().items())
            if name.startswith(("flash_fwd", "flash_bwd")) for dt in op.dtypes for hs in (64, 128)]


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("name,dtype,hs", VARIANTS, ids=[f"{n}-{d}-{h}" for n, d, h in VARIANTS])
def test_each_kind_of_tiled_attention_compiles(name, dtype, hs, arch):
    """The tiled attention as it runs: compiled per head size and kind of arithmetic (FMA,
    bf16's and TF32's mma.sync), not only the source's defaults."""
    from cupy_backends.cuda.libs import nvrtc
    from hpcdist.device.kernels import flash
    kind = "bf16" if name.endswith("bf16") else "tf32" if name.endswith("tf32") else "exact"
    op = fused.registry()[name]
    prog = nvrtc.createProgram(op.code(dtype, flash._defines(kind, hs)), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}"])
    except nvrtc.NVRTCError:
        pytest.fail(f"{name} {dtype} head {hs} does not compile for {arch}:\n"
                    f"{nvrtc.getProgramLog(prog)}")
