"""Subnormal floats as zero on the CPU (x86-64: the MXCSR's flush-to-zero and
denormals-are-zero bits), set in the importing thread before NumPy loads its BLAS, so that
every thread started after (BLAS's, numba's, the communicator's) inherits it.

Why: an operation on subnormal inputs or results (|x| < 1.2e-38 in fp32) takes ~100 cycles
instead of one. Softmax probabilities of a sharpening model and the moments of small
gradients fall there as training goes on: a DiLoCo run on 4 ranks slowed from 48 to 72 ms a
step over 400 steps, and stayed at 49-52 ms with this set, with the same held-out loss
(docs/autograd.md, "Subnormals"). PyTorch leaves the choice to the user
(``torch.set_flush_denormal``); we flush by default, as -ffast-math builds of HPC codes do.
``HPCDIST_FLUSH_DENORMALS=0`` keeps IEEE subnormals.
"""
from __future__ import annotations

import ctypes
import os
import platform

FTZ, DAZ = 0x8000, 0x0040            # MXCSR bits: flush results, read inputs as zero
_MXCSR_OFFSET, _FENV_BYTES = 28, 32  # glibc's x86-64 fenv_t: the x87 words, then mxcsr


def flush_denormals() -> bool:
    """Set FTZ and DAZ in this thread; whether it was set (False where the platform is not
    x86-64 Linux with glibc, or HPCDIST_FLUSH_DENORMALS=0)."""
    if os.environ.get("HPCDIST_FLUSH_DENORMALS", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None)
        env = (ctypes.c_ubyte * _FENV_BYTES)()
        if libc.fegetenv(env) != 0:
            return False
        word = int.from_bytes(bytes(env[_MXCSR_OFFSET:_MXCSR_OFFSET + 4]), "little")
        env[_MXCSR_OFFSET:_MXCSR_OFFSET + 4] = list((word | FTZ | DAZ).to_bytes(4, "little"))
        return libc.fesetenv(env) == 0
    except (OSError, AttributeError):
        return False


def flushing() -> bool:
    """Whether subnormal fp32 results are flushed in this thread now."""
    import numpy as np
    return float(np.array([1e-30], np.float32)[0] * np.float32(1e-10)) == 0.0
