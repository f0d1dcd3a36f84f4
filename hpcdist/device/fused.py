"""Fused GPU kernels that carry their proof: each CUDA kernel beside the NumPy twin it must equal.

A ``Fused`` op is one job done in one pass (GELU forward, LayerNorm backward, AdamW over the
whole flat buffer, ...): CUDA C source written for float and double (``T`` and the
accumulator ``A`` are filled in per dtype), a launcher that calls the kernels on CuPy
arrays, and the twin: the same math in xp, which is the definition (hpcdist/device/kernels/
keeps both side by side). Where each runs — the list goes on in docs/gpu.md,
"hpcdist/device/fused.py"."""
from __future__ import annotations

import importlib
import os
import re

import numpy as np

from . import backend

_REGISTRY: dict = {}
_cpu_rule = []                  # kernels/cpu.py's ``wanted``, imported at the first CPU op
_refused: dict = {}             # name -> why it is not used
DTYPES = {"float32": ("float", "float"), "float64": ("double", "double"),
          "bfloat16": ("bf16", "float")}
# bf16 storage, float arithmetic: a kernel reads a bf16 into a float (exact) and rounds once as
# it stores (to nearest even; a NaN stays a NaN), as PyTorch's and llm.c's bf16 kernels do.
# Written out here rather than taken from <cuda_bf16.h>: the same text compiles in NVRTC
# (no include path needed) and in g++ against cudasim.h, so the CPU model runs what the GPU
# runs; two bytes, the layout of ml_dtypes' bfloat16 arrays.
BF16 = r"""
struct bf16 {
    unsigned short w;
    bf16() = default;
    __device__ __forceinline__ bf16(float f) {
        unsigned u = __float_as_uint(f);
        w = (f != f) ? (unsigned short)((u >> 16) | 0x40u)
                     : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    __device__ __forceinline__ operator float() const {
        return __uint_as_float(((unsigned)w) << 16);
    }
};
"""
# tolerance of a bf16 kernel against its twin computed in float32 from the same bf16 inputs:
# one rounding of an output is at most half a bf16 step, 2^-8 of its value; a kernel that
# keeps an intermediate in bf16 between its passes may take one more
BF16_TOLERANCE = 8e-3


_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


def only_kernels(source: str, kernels) -> str:
    """``source`` without the ``extern "C"`` kernels that are not in ``kernels``: ops that
    share a source (flash attention's forward, backward and ring blocks) compile only their
    own, in NVRTC and in cudasim (each kernel inlines its device functions: the forward's
    module compiled every backward too)."""
    keep, out, at = set(kernels), [], 0
    for m in _KERNEL.finditer(source):
        if m.group(1) in keep or m.start() < at:
            continue
        depth, end = 0, source.index("{", m.end())
        while True:                                  # to the brace that closes the body
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            end += 1
            if depth == 0:
                break
        out.append(source[at:m.start()])
        at = end
    return "".join(out) + source[at:]


def cpu_wanted(a) -> bool:
    """Whether the CPU kernels take an op on ``a``: kernels/cpu.py's size and dtype rule,
    found by name at the first CPU op, as each op's CPU kernel is (kernels/cpu.py reads this
    module's registry: neither imports the other at import)."""
    if not _cpu_rule:
        _cpu_rule.append(importlib.import_module(f"{__package__}.kernels.cpu").wanted)
    return _cpu_rule[0](a)


class Fused:
    """One fused op. ``source``: CUDA C with ``T``/``A``; ``kernels``: the ``extern "C"``
    functions it defines; ``launch(mod, *args)``: runs them (``mod(name)`` -> RawKernel) and
    returns the outputs; ``twin(*args)``: the same outputs in xp; ``launches``: how many
    kernels one call starts (or a function of the call's arguments); ``cases(xp, rng)``:
    inputs for the self-check; ``tolerance``: the largest error allowed, relative to the
    twin's largest output; ``library``: the library call its launcher makes besides its
    kernels (cuBLAS), if any; ``cpu``: its CPU kernel, the twin's signature, named
    "module.function" in device/kernels/ (or (that, arguments): a function made by one),
    imported at its first use."""

    def __init__(self, name, source, kernels, launch, twin, cases, *, launches=1,
                 tolerance=1e-5, compare=None, dtypes=tuple(DTYPES), library=None,
                 may_skip=lambda args: False, ctypes=lambda dtype, defines: {}, cpu=None):
        self.name, self.source, self.kernels = name, source, kernels
        self.library = library
        self.dtypes = dtypes            # the dtypes it is written for (others: the twin)
        self.launch, self.twin, self.cases = launch, twin, cases
        self.launches, self.tolerance = launches, tolerance
        self.compare = compare      # the first outputs the check compares (the rest: what a
                                    # path keeps for its own backward, None on the other)
        self.may_skip = may_skip    # may_skip(case): the launch may leave a compared output
                                    # as None there (a path that has no use for it)
        self.ctypes = ctypes        # ctypes(dtype, defines): {a typedef of the source: its
                                    # NumPy dtype} for what kernel arguments name (cudasim)
        self._cpu_spec, self._cpu = cpu, None
        self._modules: dict = {}
        self._functions: dict = {}        # (dtype, defines, kernel) -> its compiled handle
        self._checked: dict = {}          # dtype -> passed the self-check
        self._cpu_checked: dict = {}      # dtype -> the CPU kernel passed it
        _REGISTRY[name] = self

    @property
    def cpu(self):
        """Its CPU kernel (None: the twin runs on the CPU)."""
        if self._cpu is None and self._cpu_spec is not None:
            path, *args = self._cpu_spec if isinstance(self._cpu_spec, tuple) else \
                (self._cpu_spec,)
            module, fn = path.rsplit(".", 1)
            made = getattr(importlib.import_module(f"{__package__}.kernels.{module}"), fn)
            self._cpu = made(*args) if args else made
        return self._cpu

    @cpu.setter
    def cpu(self, fn) -> None:                   # (tests put a wrong one in its place)
        self._cpu, self._cpu_spec = fn, None

    def code(self, dtype: str, defines: dict | None = None) -> str:
        """The source for ``dtype``; ``defines``: compile-time constants of one variant (a
        head size, a kind of arithmetic), each a ``#define`` ahead of the source."""
        t, a = DTYPES[dtype]
        macros = "".join(f"#define {k} {v}\n" for k, v in sorted((defines or {}).items()))
        return (BF16 if dtype == "bfloat16" else "") + f"typedef {t} T;\ntypedef {a} A;\n" + \
            macros + only_kernels(self.source, self.kernels)

    def tolerance_for(self, dtype: str) -> float:
        return max(self.tolerance, BF16_TOLERANCE) if dtype == "bfloat16" else self.tolerance

    def __call__(self, *args):
        label = backend.device_label()
        if label == "cpu" or not enabled():      # (the CPU first: it pays for no lookups)
            if self.cpu is not None and label == "cpu" and cpu_wanted(args[0]) \
                    and enabled() and self._cpu_ok(dtype_name(args[0].dtype)):
                return self.cpu(*args)
            return self.twin(*args)
        dtype = dtype_name(args[0].dtype)
        if label == "standin":
            from . import standin
            if dtype not in self.dtypes:          # (a GPU runs the twin op by op too)
                return self.twin(*args)
            with standin.one_launch(self.count(args)):
                return self.twin(*args)
        if label != "gpu" or dtype not in self.dtypes:
            return self.twin(*args)
        if dtype not in self._checked:
            self._checked[dtype] = self.self_check(dtype)
        if not self._checked[dtype]:
            return self.twin(*args)
        return self.launch(lambda kernel, defines=None: self._kernel(dtype, kernel, defines),
                           *args)

    def native(self, dtype) -> bool:
        """Whether this op takes arrays of ``dtype`` as they are on this device (a kernel for
        it on a GPU or the GPU stand-in; the CPU's 2-byte floats go through float32)."""
        return backend.device_label() != "cpu" and np.dtype(dtype).name in self.dtypes

    def count(self, args) -> int:
        """Kernels one call on ``args`` starts (``launches``: a number, or a function of
        the call's arguments where a launch depends on them)."""
        return self.launches(*args) if callable(self.launches) else self.launches

    def ready(self, dtype: str) -> bool:
        """Whether the GPU kernel runs for ``dtype`` (its self-check, run now if it has not)."""
        if backend.device_label() != "gpu" or not enabled() or dtype not in self.dtypes:
            return False
        if dtype not in self._checked:
            self._checked[dtype] = self.self_check(dtype)
        return self._checked[dtype]

    def _kernel(self, dtype: str, kernel: str, defines: dict | None = None):
        """The compiled ``kernel`` for ``dtype`` and ``defines``, kept: CuPy's get_function
        asks the driver for a new handle each call (and a kernel's shared-memory opt-in,
        flash.py's, was set again on each)."""
        key = (dtype, tuple(sorted(defines.items())) if defines else (), kernel)
        fn = self._functions.get(key)
        if fn is None:
            mod = self._modules.get(key[:2])
            if mod is None:
                mod = self._modules[key[:2]] = backend.xp().RawModule(
                    code=self.code(dtype, defines))
            fn = self._functions[key] = mod.get_function(kernel)
        return fn

    def worst_error(self, dtype: str, kernel=None, run=None) -> float:
        """The largest error of the launch (its kernels from ``kernel(name)``), or of
        ``run(*args)``, against the twin over every case, on ``backend.xp()`` arrays. Both
        sides run at the arrays' own precision: inside a bf16-emulated run (matmul operands
        rounded to bf16) the twin's GEMMs would round and the kernel's not, and a right
        kernel be refused (on an H100 attention fell back to op by op in bf16 so)."""
        run = run or (lambda *a: self.launch(kernel, *a))
        emulated = backend.bf16_emulated()
        backend.reset_precision()
        try:
            return max((self._case_error(run, args) for args in
                        self.cases(backend.xp(), np.random.default_rng(0), backend.dtype(dtype))),
                       default=0.0)
        finally:
            backend.reset_precision(emulated)

    def _case_error(self, run, args) -> float:
        want = _tuple(self.twin(*[_widened(a) for a in args]))[:self.compare]
        got = _tuple(run(*[_copy(a) for a in args]))[:self.compare]
        worst = 0.0
        for w, g in zip(want, got):
            if g is None and self.may_skip(args):
                continue
            w, g = backend.to_numpy(w), backend.to_numpy(g)
            if w.shape != g.shape:
                raise ValueError(f"shape {g.shape}, the twin's {w.shape}")
            worst = max(worst, _error(w, g))
        return worst

    def _cpu_ok(self, dtype: str) -> bool:
        """Whether the CPU kernel passed ``self_check`` for ``dtype`` (run on first use; one
        that fails to compile or to agree is refused as "<name> (cpu)" and the twin runs)."""
        ok = self._cpu_checked.get(dtype)
        if ok is None:
            ok = self._cpu_checked[dtype] = self.self_check(dtype, run=self.cpu)
        return ok

    def self_check(self, dtype: str, run=None) -> bool:
        """Run the kernel (the CPU kernel ``run`` when given) and the twin on every case;
        True when all agree, else the reason is kept in ``refusals()``."""
        name = self.name if run is None else self.name + " (cpu)"
        try:
            worst = self.worst_error(dtype, lambda k, d=None: self._kernel(dtype, k, d), run=run)
        except Exception as e:                         # compile or launch failure
            _refused[name] = f"{type(e).__name__}: {e}"[:200]
            return False
        if worst > self.tolerance_for(dtype):
            _refused[name] = (f"{dtype}: off by {worst:.2e} (allowed "
                              f"{self.tolerance_for(dtype):.0e})")
            return False
        return True


def _error(want, got) -> float:
    """Largest |got - want| relative to the largest finite |want| (at least 1); equal
    infinities and NaN against NaN agree, a NaN or inf on one side only is inf."""
    want, got = want.astype(np.float64), got.astype(np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):                # inf - inf where both are inf
        diff = np.where(same, 0.0, np.abs(got - want))
    finite = np.abs(want[np.isfinite(want)])
    err = float(diff.max(initial=0.0)) / max(1.0, float(finite.max(initial=0.0)))
    return err if np.isfinite(err) else float("inf")


def _copy(a):
    """A copy in a's own layout (a transposed view stays one: the launch is checked on the
    operands its cases name)."""
    return a.copy(order="K") if hasattr(a, "copy") and hasattr(a, "dtype") else a


def _widened(a):
    """A copy for the twin: bf16 arrays as float32 (the twin computes in float32 what the
    kernel computes in float from the same bf16 values; both are then compared)."""
    if getattr(a, "dtype", None) is not None and a.dtype.name == "bfloat16" and a.ndim:
        return a.astype(np.float32)
    return _copy(a)


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """``dtype.name``, kept per dtype: NumPy works it out at every call (2 us for float32,
    paid at every kernel launch a host-bound step makes)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = dtype.name
    return name


def enabled() -> bool:
    return os.environ.get("HPCDIST_FUSED", "1") != "0"


def refuse(name: str, why: str) -> None:
    """Keep why ``name`` (a kernel or a library call) was not used, for ``refusals()``."""
    _refused[name] = why[:200]


def refusals() -> dict:
    """{kernel: why} for every kernel a self-check refused in this process."""
    return dict(_refused)


def registry() -> dict:
    return dict(_REGISTRY)


def sources() -> dict:
    """{(name, dtype): CUDA source} of every kernel (the compile check's input)."""
    return {(name, dt): f.code(dt) for name, f in _REGISTRY.items() for dt in f.dtypes}


def grid(n: int, block: int = 256) -> tuple:
    """(blocks,), (threads,) covering ``n`` elements, one per thread."""
    return (max(1, -(-n // block)),), (block,)


ROW_THREADS = 256                 # threads per row in the row kernels (a multiple of 32)
