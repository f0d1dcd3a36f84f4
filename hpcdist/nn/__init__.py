"""Modules and models: Linear ... GPT."""
from .gpt import GPT, Block, CausalSelfAttention, GPTConfig
from .layers import MLP, Dropout, Embedding, LayerNorm, Linear
from .module import Module, ModuleList, Parameter, manual_seed

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "Dropout", "Embedding",
           "LayerNorm", "Linear", "Module", "ModuleList", "Parameter", "manual_seed"]
