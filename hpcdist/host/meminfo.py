"""The memory this host has available, as the kernel counts it."""
from __future__ import annotations


def host_available() -> float | None:
    """MemAvailable of this host in bytes (None where /proc/meminfo says nothing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
