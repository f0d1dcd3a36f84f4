"""The fused kernels of a GPT step, each beside its NumPy twin (fused.py says how they run):
GELU (and bias + GELU), LayerNorm, scale + causal mask + softmax, causal attention from the
fused q|k|v projection (tiled: flash.py), cross-entropy with its gradient, the gradient's norm
(grad_norm.py) and AdamW over the flat buffer, bias + residual, a bias's gradient added into
its buffer (forward and backward), bf16 GEMMs on tensor cores (gemm.py), the mixture of
experts' permutation and combine (moe.py), RMSNorm (rmsnorm.py), SwiGLU and GeGLU (swiglu.py)
and rotary embeddings (rotary.py). elementwise.py, colsum.py, adamw.py, rows.py,
attention.py, gemm.py and moe.py hold the rest.

The rest of this design: docs/gpu.md, "hpcdist/device/kernels/__init__.py"."""
from . import attention_kinds
from .attention import attention_bwd, attention_bwd_twin, attention_fwd, attention_twin
from .flash import FLASH_BWD, FLASH_FWD, flash_bwd_twin, flash_twin
from .cudnn_attention import CUDNN_BWD, CUDNN_FWD
from .flash_blocks import FLASH_BLOCK_BWD, FLASH_BLOCK_FWD, block_bwd_twin, block_twin
from .rmsnorm import (RESIDUAL_RMSNORM, RMSNORM_BWD, RMSNORM_FWD, rmsnorm_bwd_twin,
                      rmsnorm_twin)
from .rotary import ROTARY, rotary_tables, rotary_twin
from .swiglu import (GEGLU_BWD, GEGLU_FWD, SWIGLU_BWD, SWIGLU_FWD, geglu_bwd_twin, geglu_twin,
                     swiglu_bwd_twin, swiglu_twin)
from .common import GELU_C
from .gemm import (BF16_GEMM, FROM_BF16, ROUND_BF16, TO_BF16, configure, describe, gemm_twin, matmul,
                   operand, product, use_workspace)
from .operands import linear_operands
from .gemm_add import GEMM_ADD, GEMM_ADD_TF32, device_gemm, gemm_add_twin, matmul_add
from .gemm_epilogue import (GEMM_BGRAD, GEMM_BGRAD_TF32, GEMM_BIAS, GEMM_BIAS_GELU,
                            GEMM_BIAS_GELU_TF32, GEMM_BIAS_TF32, GEMM_DGELU_BGRAD,
                            GEMM_DGELU_BGRAD_TF32, bias_product, gelu_grad_product,
                            gelu_product, weight_bias_grads)
from .elementwise import (ADD, BIAS_GELU, BIAS_RESIDUAL, GELU_BWD, GELU_FWD, WIDEN, add_twin,
                          bias_gelu_twin, bias_residual_twin, gelu_bwd_twin, gelu_twin,
                          widen_twin)
from .colsum import COLSUM_ADD, colsum_add_twin
from .adamw import (ADAMW, ADAMW_LOW, ADAMW_LOW_SCHED, ADAMW_SCHED, LR_SCHEDULE, adam_step_twin,
                    adamw_twin, clip_factor)
from .grad_norm import GRAD_NORM
from .layernorm import (LAYERNORM_BWD, LAYERNORM_FWD, RESIDUAL_LAYERNORM, layernorm_bwd_twin,
                        layernorm_twin)
from .rows import (CROSS_ENTROPY_BWD, CROSS_ENTROPY_FWD, CROSS_ENTROPY_MEAN, SOFTMAX_CAUSAL_BWD, SOFTMAX_CAUSAL_FWD,
                   cross_entropy_bwd_twin, cross_entropy_twin, softmax_causal_bwd_twin,
                   softmax_causal_twin)
from .fp8_quant import FP8_AMAX, FP8_QUANTIZE, FP8_ROUND
from .fp8_gemm import FP8_CODES, FP8_GEMM
from .gelu_colsum import GELU_BWD_COLSUM
from .moe import (MOE_COMBINE, MOE_COMBINE_BWD, MOE_PERMUTE, combine_bwd_twin, combine_twin,
                  permute_twin)
from .. import backend as _backend, graphs as _graphs
from . import cpu as _cpu

# The CPU kernels each op runs are declared with it (``Fused(..., cpu=...)``); the engine's
# own two (the GEMM over the rank's threads, the row scatter-add) and cuBLAS's workspace for
# a captured graph are handed over here, by the calls that take them.
_backend.install_cpu_kernels(_cpu.gemm, _cpu.scatter_rows, device_gemm)
_graphs.before_capture(use_workspace)

__all__ = ["ADAMW", "ADAMW_LOW", "GRAD_NORM", "clip_factor", "FP8_AMAX", "FP8_CODES", "FP8_GEMM", "FP8_QUANTIZE", "FP8_ROUND", "GELU_BWD_COLSUM", "ADAMW_LOW_SCHED", "ADAMW_SCHED", "LR_SCHEDULE", "ADD", "add_twin", "WIDEN", "widen_twin", "BF16_GEMM", "CUDNN_BWD", "CUDNN_FWD", "FLASH_BWD", "FLASH_FWD",
           "FLASH_BLOCK_BWD", "FLASH_BLOCK_FWD", "block_bwd_twin", "block_twin",
           "RMSNORM_BWD", "RMSNORM_FWD", "RESIDUAL_RMSNORM", "RESIDUAL_LAYERNORM", "ROTARY", "GEGLU_BWD", "GEGLU_FWD", "geglu_bwd_twin", "geglu_twin", "SWIGLU_BWD", "SWIGLU_FWD", "rmsnorm_bwd_twin",
           "rmsnorm_twin", "rotary_tables", "rotary_twin", "swiglu_bwd_twin", "swiglu_twin", "BIAS_GELU", "MOE_COMBINE",
           "MOE_COMBINE_BWD", "MOE_PERMUTE", "combine_bwd_twin", "combine_twin", "permute_twin",
           "BIAS_RESIDUAL", "COLSUM_ADD", "CROSS_ENTROPY_BWD", "CROSS_ENTROPY_FWD", "CROSS_ENTROPY_MEAN",
           "GELU_BWD", "GELU_C", "GELU_FWD", "LAYERNORM_BWD", "LAYERNORM_FWD",
           "FROM_BF16", "ROUND_BF16", "SOFTMAX_CAUSAL_BWD", "operand", "linear_operands", "product", "SOFTMAX_CAUSAL_FWD", "TO_BF16", "adam_step_twin", "adamw_twin",
           "attention_bwd", "attention_bwd_twin", "attention_fwd", "attention_twin",
           "bias_gelu_twin", "flash_bwd_twin", "flash_twin",
           "bias_residual_twin", "colsum_add_twin", "configure", "describe",
           "cross_entropy_bwd_twin", "cross_entropy_twin", "gelu_bwd_twin", "gelu_twin",
           "GEMM_ADD", "GEMM_ADD_TF32", "GEMM_BGRAD", "GEMM_BGRAD_TF32", "GEMM_BIAS", "GEMM_BIAS_GELU",
           "GEMM_BIAS_GELU_TF32", "GEMM_BIAS_TF32", "GEMM_DGELU_BGRAD",
           "GEMM_DGELU_BGRAD_TF32", "bias_product", "gelu_grad_product", "gelu_product",
           "weight_bias_grads", "gemm_add_twin", "gemm_twin", "layernorm_bwd_twin",
           "layernorm_twin", "matmul", "matmul_add",
           "softmax_causal_bwd_twin", "softmax_causal_twin"]
