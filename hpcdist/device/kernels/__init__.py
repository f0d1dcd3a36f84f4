"""The fused kernels of a GPT step, each beside its NumPy twin (fused.py says how they run).

    GELU_FWD, GELU_BWD          tanh GELU and its derivative, one pass each
    LAYERNORM_FWD, _BWD         a row's mean and 1/std, normalise, scale, shift; the backward's
                                input gradient per row and the weight and bias gradients
    SOFTMAX_CAUSAL_FWD, _BWD    scale, causal mask, softmax of attention scores in one pass;
                                its backward
    CROSS_ENTROPY_FWD, _BWD     per row: log-sum-exp and the target's loss; the gradient
                                softmax - onehot, weighted, in place of the logits' copy
    ADAMW                       AdamW over the whole flat buffer, decoupled decay by a mask
    ATTENTION_FWD, _BWD         causal attention from the fused q|k|v projection
    BIAS_GELU, BIAS_RESIDUAL    a Linear's bias with the GELU, or with the residual stream
    COLSUM_ADD                  a bias's gradient added straight into its buffer
    BF16_GEMM, matmul           bf16 GEMMs on tensor cores (cuBLAS gemmEx); ``matmul`` picks
                                it for a bf16 run, ``configure`` sets TF32 / fp16 accumulation

elementwise.py, rows.py (one CUDA block per row), attention.py and gemm.py hold them; common.py the
block reductions they share.

Twins are the definition; each kernel's self-check compares against its twin on a GPU before
it is used. Every kernel computes in ``A`` (float for float32, double for float64) and checks
its bounds.
"""
from .attention import ATTENTION_BWD, ATTENTION_FWD, attention_bwd_twin, attention_twin
from .common import GELU_C
from .gemm import BF16_GEMM, configure, describe, gemm_twin, matmul
from .elementwise import (ADAMW, BIAS_GELU, BIAS_RESIDUAL, COLSUM_ADD, GELU_BWD, GELU_FWD,
                          adam_step_twin, adamw_twin, bias_gelu_twin, bias_residual_twin,
                          colsum_add_twin, gelu_bwd_twin, gelu_twin)
from .rows import (CROSS_ENTROPY_BWD, CROSS_ENTROPY_FWD, LAYERNORM_BWD, LAYERNORM_FWD,
                   SOFTMAX_CAUSAL_BWD, SOFTMAX_CAUSAL_FWD, cross_entropy_bwd_twin,
                   cross_entropy_twin, layernorm_bwd_twin, layernorm_twin, softmax_causal_bwd_twin,
                   softmax_causal_twin)

__all__ = ["ADAMW", "ATTENTION_BWD", "ATTENTION_FWD", "BF16_GEMM", "BIAS_GELU",
           "BIAS_RESIDUAL", "COLSUM_ADD", "CROSS_ENTROPY_BWD", "CROSS_ENTROPY_FWD",
           "GELU_BWD", "GELU_C", "GELU_FWD", "LAYERNORM_BWD", "LAYERNORM_FWD",
           "SOFTMAX_CAUSAL_BWD", "SOFTMAX_CAUSAL_FWD", "adam_step_twin", "adamw_twin",
           "attention_bwd_twin", "attention_twin", "bias_gelu_twin",
           "bias_residual_twin", "colsum_add_twin", "configure", "describe",
           "cross_entropy_bwd_twin", "cross_entropy_twin", "gelu_bwd_twin", "gelu_twin",
           "gemm_twin", "layernorm_bwd_twin", "layernorm_twin", "matmul",
           "softmax_causal_bwd_twin", "softmax_causal_twin"]
