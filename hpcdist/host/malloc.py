"""glibc's malloc, told to keep large freed blocks (the device layer calls ``tune`` once, at
import: backend.MALLOC_TUNED)."""
from __future__ import annotations

import os


def tune() -> bool:
    """Keep freed large NumPy temporaries in the heap instead of returning them to the OS.

    glibc serves allocations above 128 KiB with fresh mmap pages and trims the heap top on
    free, so every activation-sized temporary is page-faulted in again: measured here, GELU on
    a (64, 11, 256) float32 array took 1.43 ms with the defaults and 0.22 ms with these
    settings, and the default GPT step went from 1.75x to 1.06x PyTorch's time
    (``python -m hpcdist.bench autograd``). PyTorch's own CPU allocator avoids the same cost.
    Set HPCDIST_MALLOC_TUNE=0 to leave malloc alone. No-op off glibc.
    """
    if os.environ.get("HPCDIST_MALLOC_TUNE", "1") == "0":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)      # mmap only above 64 MiB
        ok &= libc.mallopt(M_TRIM_THRESHOLD, 512 << 20)    # trim only past 512 MiB free
        return bool(ok)
    except (OSError, AttributeError):
        return False
