"""hpcdist: an MPI-native distributed-training toolkit with a small autograd core."""
from . import backend, ops
from .nn.module import manual_seed
from .tensor import Tensor, is_grad_enabled, no_grad, tensor

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "no_grad", "is_grad_enabled", "manual_seed", "backend", "ops"]
