"""The device layer's error (backend and precision raise it; callers catch it by name)."""


class DeviceError(RuntimeError):
    """The requested device cannot be used (CuPy missing, no GPU visible, no bf16 here)."""
