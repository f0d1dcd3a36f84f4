"""Differentiable ops. Each builds its result and, right beside it, the backward closure.

A backward closure takes the gradient of the result and returns one gradient per parent
(None where a parent needs none). Broadcasting is undone by ``_unbroadcast``. Only xp array
math is used here, so every op runs on NumPy and CuPy alike.
"""
from .core import (_lift, _unbroadcast, _xp, add, sub, mul, div, neg, pow, exp, log, sqrt, tanh,
                   relu, sigmoid, gelu, matmul, _norm_axes, _expand_to, sum, mean, max, reshape,
                   transpose, _has_array_index, getitem, concat, split)
from .linear import linear, linear_gelu, linear_norm, _bias_grad
from .nn import (embedding, attend, softmax, causal_softmax, fused_attention, log_softmax, softcap,
                 cross_entropy, layer_norm, dropout, where, masked_fill, cast,
                 moe_permute, moe_combine)
from .norm_gate_rope import geglu, rms_norm, rotary, swiglu
