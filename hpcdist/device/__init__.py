"""The device layer: the array module (``backend``: NumPy, CuPy or the device double), the
CuPy surface hpcdist may use (``surface``) and its stand-in (``double``), dropout's random
stream (``rng``), and fused kernels that carry their proof (``fused``, ``kernels/``)."""
