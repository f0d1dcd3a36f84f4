"""Modules and models: Linear ... GPT, Llama; families (nn/family.py) by name in FAMILIES."""
from .family import FAMILIES, AttentionShape, DecoderLM, Projection, build, register
from .gpt import GPT, Block, CausalSelfAttention, GPTConfig
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear
from .llama import Llama, LlamaConfig, RMSNorm, SwiGLU
from .module import Module, ModuleList, Parameter, manual_seed

register("gpt", GPTConfig, GPT)
register("llama", LlamaConfig, Llama)

__all__ = ["FAMILIES", "AttentionShape", "DecoderLM", "Projection", "build", "register",
           "GPT", "GPTConfig", "Llama", "LlamaConfig", "RMSNorm", "SwiGLU", "Block", "CausalSelfAttention", "MLP", "Dropout", "Embedding",
           "LayerNorm", "Linear", "Module", "ModuleList", "Parameter", "manual_seed"]
