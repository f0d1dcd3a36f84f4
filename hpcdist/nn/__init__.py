"""Modules and models: Linear ... GPT, Llama, Qwen2, Qwen3, Gemma, Gemma 2; families (nn/family.py) by name in
FAMILIES, each registered here from the one file that declares it."""
from .family import (DEFAULT_ARCH, FAMILIES, AttentionShape, DecoderLM, Family, Projection, build, config_of,
                     arch_of, family, of_model_type, option_names, options, size, own_settings, register)
from .gemma import GEMMA, Gemma, GemmaConfig
from .gemma2 import GEMMA2, Gemma2, Gemma2Config
from .gpt import GPT, GPT_FAMILY, Block, CausalSelfAttention, GPTConfig
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear, RMSNorm, SwiGLU
from .llama import LLAMA, Llama, LlamaConfig
from .module import Module, ModuleList, Parameter, manual_seed
from .qwen2 import QWEN2, Qwen2, Qwen2Config
from .qwen3 import QWEN3, Qwen3, Qwen3Config

for _family in (GPT_FAMILY, LLAMA, QWEN2, QWEN3, GEMMA, GEMMA2):
    register(_family)

__all__ = ["DEFAULT_ARCH", "FAMILIES", "arch_of", "AttentionShape", "DecoderLM", "Family", "Projection", "build",
           "config_of", "family", "of_model_type", "option_names", "options", "size", "own_settings", "register", "GPT", "GPTConfig", "Llama",
           "LlamaConfig", "Qwen2", "Qwen2Config", "Qwen3", "Qwen3Config", "Gemma", "GemmaConfig", "Gemma2", "Gemma2Config", "RMSNorm", "SwiGLU",
           "Block", "CausalSelfAttention", "MLP", "Dropout", "Embedding", "LayerNorm", "Linear",
           "Module", "ModuleList", "Parameter", "manual_seed"]
