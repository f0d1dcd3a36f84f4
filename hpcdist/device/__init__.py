"""The device layer: the array module (``backend``: NumPy, CuPy or the GPU stand-in), the
CuPy surface hpcdist may use (``surface``) and its stand-in (``standin``), dropout's random
stream (``rng``), and fused kernels that carry their proof (``fused``, ``kernels/``)."""
