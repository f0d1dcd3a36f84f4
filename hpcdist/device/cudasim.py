"""Every CUDA kernel executed on the CPU: our kernels' own source through CUDA's execution model.

``RawModule(code)`` compiles a kernel source with g++ against ``cudasim.h`` (blocks one after
another, a block's threads as fibers meeting at ``__syncthreads`` and warp shuffles, every
pointer bounds-checked) and hands out kernels called as CuPy's are: ``kernel(grid, block,
args, shared_mem=...)`` on NumPy arrays, the argument types checked against the signature.
``check(op, dtype)`` runs a ``Fused`` op's own launcher on its self-check cases with the
threads and blocks in index order, reversed and shuffled, against its twin at its tolerance.
What it cannot show (speed, coalescing, races between blocks, CUDA's math library, the
tensor-core GEMM): docs/gpu.md, "hpcdist/device/cudasim.py"."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from .fused import DTYPES

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cudasim.h")
ORDERS = {0: "index order", 1: "reversed", 2: "shuffled"}
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-w"]
_C_TYPES = {"float": np.float32, "double": np.float64, "long long": np.int64, "int": np.int32,
            "unsigned char": np.uint8, "unsigned short": np.uint16, "unsigned": np.uint32,
            "unsigned int": np.uint32, "char": np.int8}
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_POINTER = re.compile(r"\b((?:const\s+)?(?:unsigned\s+char|unsigned\s+short|unsigned\s+int|"
                      r"long\s+long|unsigned|float|double|int|char|T|A|S))\s*\*")
_DYNAMIC = re.compile(r"extern\s+__shared__\s+unsigned\s+char\s+(\w+)\s*\[\s*\]\s*;")


class KernelFault(RuntimeError):
    """A kernel read or wrote outside an array, deadlocked, or shuffled from a dead lane."""


def available() -> str | None:
    """None when g++ is here, else why the model cannot run."""
    return None if shutil.which("g++") else "g++ is not on PATH (apt-get install g++)"


def _params(text: str) -> list:
    """[(C type without const, is pointer, name)] of a kernel's parameter list."""
    out = []
    for p in (p.strip() for p in text.split(",") if p.strip()):
        pointer = "*" in p
        words = p.replace("*", " ").split()
        name, ctype = words[-1], " ".join(w for w in words[:-1] if w != "const")
        out.append((ctype, pointer, name))
    return out


def _wrapper(name: str, params: list) -> str:
    lines, call = [], []
    for i, (ctype, pointer, pname) in enumerate(params):
        if pointer:
            lines.append(f'    Ptr<{ctype}> p{i}(({ctype}*)a[{i}], n[{i}], "{name}\'s {pname}");')
        else:
            lines.append(f"    {ctype} p{i} = *({ctype}*)a[{i}];")
        call.append(f"p{i}")
    return (f'extern "C" int sim_{name}(void** a, const long long* n, const unsigned* d, '
            f"long long shm, int order, unsigned long long seed, char* err, int errlen) {{\n"
            + "\n".join(lines) + "\n"
            f"    dim3 g{{d[0], d[1], d[2]}}, b{{d[3], d[4], d[5]}};\n"
            f'    sim_launch("{name}", g, b, shm, order, seed,\n'
            f'               [&] {{ {name}({", ".join(call)}); }});\n'
            f'    snprintf(err, errlen, "%s", sim_error);\n'
            f"    return sim_failed;\n}}\n")


def translate(code: str) -> tuple[str, dict]:
    """(C++ for g++, {kernel: its parameters}) from CUDA C source as NVRTC takes it."""
    kernels = {m.group(1): _params(m.group(2)) for m in _KERNEL.finditer(code)}
    body = _DYNAMIC.sub(r"Ptr<unsigned char> \1 = sim_dynamic;", code)
    body = body.replace('extern "C" __global__', "__global__")
    body = _POINTER.sub(lambda m: f"Ptr<{' '.join(m.group(1).split())}> ", body)
    wrappers = "".join(_wrapper(k, p) for k, p in kernels.items())
    return f'#include "{HEADER}"\n' + body + "\n" + wrappers, kernels


def _cache_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"hpcdist-cudasim-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _compile(cpp: str) -> str:
    """The shared library of ``cpp`` (built once per source and header, kept in a cache)."""
    why = available()
    if why:
        raise RuntimeError(f"the CUDA execution model needs a C++ compiler: {why}")
    key = hashlib.sha256((cpp + open(HEADER).read() + " ".join(FLAGS)).encode()).hexdigest()[:20]
    lib = os.path.join(_cache_dir(), f"k{key}.so")
    if os.path.exists(lib):
        return lib
    src = os.path.join(_cache_dir(), f"k{key}.{os.getpid()}.cpp")
    with open(src, "w") as f:
        f.write(cpp)
    tmp = lib + f".{os.getpid()}"
    done = subprocess.run(["g++", *FLAGS, "-o", tmp, src], capture_output=True, text=True)
    os.remove(src)
    if done.returncode:
        raise RuntimeError(f"g++ refused the kernel source:\n{done.stderr[-3000:]}")
    os.replace(tmp, lib)
    return lib


def _dtype(name: str) -> np.dtype:
    from .backend import dtype      # (bfloat16 through ml_dtypes)
    return dtype(name)


class RawModule:
    """CuPy's ``RawModule(code=...)`` for the CPU: ``get_function(name)`` -> a Kernel."""

    def __init__(self, code: str, dtype: str = "float32", order: int = 0, seed: int = 0,
                 types: dict | None = None):
        cpp, self.kernels = translate(code)
        self.lib = ctypes.CDLL(_compile(cpp))
        self.types = {"T": _dtype(dtype), "A": np.dtype(_C_TYPES[DTYPES[dtype][1]]),
                      **{k: np.dtype(v) for k, v in (types or {}).items()}}
        self.order, self.seed = order, seed

    def get_function(self, name: str) -> "Kernel":
        if name not in self.kernels:
            raise AttributeError(f"no kernel {name!r} in this source: {sorted(self.kernels)}")
        return Kernel(self, name)


class Kernel:
    """One kernel, called as CuPy's RawKernel: ``(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: RawModule, name: str):
        self.module, self.name, self.params = module, name, module.kernels[name]
        fn = getattr(module.lib, f"sim_{name}")
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong),
                       ctypes.POINTER(ctypes.c_uint), ctypes.c_longlong, ctypes.c_int,
                       ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn

    def _dtype(self, ctype: str) -> np.dtype:
        return self.module.types.get(ctype) or np.dtype(_C_TYPES[ctype])

    def _argument(self, value, param) -> tuple:
        """(address, elements, the object to keep alive) of one argument, checked as the
        device would read it: an array of the pointer's type, C-contiguous; a NumPy scalar of
        the parameter's exact type (CuPy passes a scalar by its own dtype's size)."""
        ctype, pointer, pname = param
        want = self._dtype(ctype)
        if pointer:
            if not isinstance(value, np.ndarray):
                raise TypeError(f"{self.name}: {pname} takes a {ctype} array, got "
                                f"{type(value).__name__}")
            if value.dtype != want or not value.flags.c_contiguous:
                raise TypeError(f"{self.name}: {pname} takes a C-contiguous {want} array, got "
                                f"{value.dtype}{'' if value.flags.c_contiguous else ' (strided)'}")
            return value.ctypes.data, value.size, value
        if not isinstance(value, np.generic) or value.dtype != want:
            got = value.dtype if isinstance(value, np.generic) else type(value).__name__
            raise TypeError(f"{self.name}: {pname} is a {ctype} ({want}); got {got}")
        box = np.array(value, dtype=want)
        return box.ctypes.data, 1, box

    def __call__(self, grid, block, args, shared_mem: int = 0):
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        held = [self._argument(v, p) for v, p in zip(args, self.params)]
        n = len(held)
        addrs = (ctypes.c_void_p * max(n, 1))(*[h[0] for h in held])
        sizes = (ctypes.c_longlong * max(n, 1))(*[h[1] for h in held])
        dims = (ctypes.c_uint * 6)(*(tuple(grid) + (1,) * (3 - len(grid))),
                                   *(tuple(block) + (1,) * (3 - len(block))))
        err = ctypes.create_string_buffer(1024)
        failed = self.fn(addrs, sizes, dims, int(shared_mem), self.module.order,
                         self.module.seed, err, len(err))
        if failed:
            raise KernelFault(err.value.decode(errors="replace"))


def kernels(op, dtype: str, order: int = 0, seed: int = 0):
    """``k(name, defines=None)`` -> that kernel of ``op``'s source on the CPU model (one
    compile per dtype and set of compile-time constants)."""
    modules: dict = {}

    def get(name, defines=None):
        key = tuple(sorted((defines or {}).items()))
        if key not in modules:
            modules[key] = RawModule(op.code(dtype, defines), dtype, order, seed,
                                     op.ctypes(dtype, defines or {}))
        return modules[key].get_function(name)
    return get


def check(op, dtype: str, orders=tuple(ORDERS), seed: int = 1) -> dict:
    """{order: the largest error against the twin} over ``op``'s self-check cases; raises
    AssertionError past the op's tolerance and KernelFault on a fault."""
    out = {}
    for order in orders:
        worst = op.worst_error(dtype, kernels(op, dtype, order, seed))
        if worst > op.tolerance_for(dtype):
            raise AssertionError(f"{op.name} ({dtype}, threads {ORDERS[order]}): off by "
                                 f"{worst:.2e} (allowed {op.tolerance_for(dtype):.0e})")
        out[order] = worst
    return out
