"""hpcdist: an MPI-native distributed-training toolkit with a small autograd core."""
from .host import floats, threads

threads.early()          # BLAS threads per rank, before NumPy loads its BLAS (threads.py)
floats.flush_denormals()  # subnormals as zero, inherited by the threads started later

from .device import backend  # noqa: E402
from .autograd import ops  # noqa: E402
from .nn.module import manual_seed  # noqa: E402
from .autograd.tensor import Tensor, is_grad_enabled, no_grad, tensor  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Tensor", "tensor", "no_grad", "is_grad_enabled", "manual_seed", "backend", "ops"]
