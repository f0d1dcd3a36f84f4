"""The autograd core: ``Tensor`` and its engine (``tensor``), the ops (``ops/``), activations
recomputed in backward (``recompute``) and activation memory measured (``memtrace``)."""
