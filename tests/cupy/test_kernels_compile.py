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


WIDE = [(name, dt) for name, op in sorted(fused.registry().items())
        if "copy_vec(" in op.source for dt in op.dtypes]
# read a stream, write a number a row or a column (the stream's checks only)
REDUCES_ONLY = {"cross_entropy_fwd", "colsum_add"}


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("name,dtype", WIDE, ids=[f"{n}-{d}" for n, d in WIDE])
def test_the_16_byte_kernels_compile_to_16_byte_accesses_in_registers(name, dtype, arch):
    """The elementwise, norm and cross-entropy kernels as they run at model widths (VEC
    elements a thread, 16 bytes): each kernel's PTX reads, and writes where it writes a
    stream, global memory with 128-bit accesses; in bf16 no 2-byte words at several offsets
    from one address are left (a stream's, split); its per-thread arrays stay in
    registers (no local memory). A loop over rows around the columns' loop made NVVM split the
    norms' backward stores into scalar ones; this is what caught it."""
    import re
    from cupy_backends.cuda.libs import nvrtc
    from hpcdist.device import backend
    op = fused.registry()[name]
    vec = 16 // backend.dtype(dtype).itemsize
    prog = nvrtc.createProgram(op.code(dtype, {"VEC": vec}), f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}"])
    except nvrtc.NVRTCError:
        pytest.fail(f"{name} {dtype} VEC {vec} does not compile for {arch}:\n"
                    f"{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    wide = r"\.(?:v4\.[a-z]32|v2\.[a-z]64)"            # 4 words or 2 doubles: 16 bytes
    for kernel in op.kernels:
        body = ptx.split(f".entry {kernel}(", 1)[1].split(".entry ", 1)[0]
        assert re.search(r"ld\.global(\.nc)?" + wide, body), f"{kernel}: no 16-byte load"
        assert ".local" not in body, f"{kernel}: its vectors spilled to local memory"
        if kernel in REDUCES_ONLY:
            continue
        assert re.search(r"st\.global" + wide, body), f"{kernel}: no 16-byte store"
        if dtype != "bfloat16":              # (in float and double a mean, a gate or an
            continue                         # index is a word of the stream's size too)
        # a stream left narrow shows as 2-byte words (alone or in pairs and fours) at several
        # offsets from one address ([%rd9], [%rd9+4], ...: the norms' stores, split); a single
        # value (a gate, the target's logit, a gradient added by a last block) has an address
        # of its own
        for op_ in ("st", "ld"):
            offsets = {}
            for base, off in re.findall(
                    op_ + r"\.global(?:\.nc|\.cg)?(?:\.v[24])?\.[bu]16\s+"
                    r"(?:%\w+,\s*|\{[^}]*\},\s*)?\[(%\w+)(?:\+(\d+))?\]", body):
                offsets.setdefault(base, set()).add(int(off or 0))
            split = {b: o for b, o in offsets.items() if len(o) > 1}
            assert not split, f"{kernel}: 2-byte {op_} of one stream at offsets {split}"
