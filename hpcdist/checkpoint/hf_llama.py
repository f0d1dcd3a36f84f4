"""Hugging Face Llama, Mistral and Mixtral folders in and out: ``config.json``, the weights
(``model.safetensors`` or shards behind ``model.safetensors.index.json``) and the tokenizer,
as hpcdist's Llama family (nn/llama.py) — its fused q|k|v and gate|up projections made from
(and cut back into) their separate ones, our (in, out) layout against torch's (out, in)."""
from __future__ import annotations

import os

import numpy as np

from .hf_files import folder_vocabulary, read_config, read_safetensors, weight_files

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "mixtral": "MixtralForCausalLM"}


def _theta(c: dict) -> float:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if kind not in ("default", None):
        raise ValueError(f"rotary scaling {kind!r} (Llama 3.1's long-context form and its "
                         "kin) is not implemented: hpcdist's rotary embeddings are the plain "
                         "ones; this folder would give other logits")
    return float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))


def llama_shape(folder: str) -> dict:
    """LlamaConfig's fields for the folder's config.json (llama, mistral, mixtral)."""
    c = read_config(folder)
    kind = c.get("model_type")
    if kind not in ARCHS:
        raise ValueError(f"{folder}: model_type {kind!r}; the Llama family reads "
                         f"{', '.join(sorted(ARCHS))} (GPT-2 folders: model_type gpt2)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: activation {c['hidden_act']!r}; Llama's SwiGLU is silu")
    C, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    if int(c.get("head_dim") or C // nh) != C // nh:
        raise ValueError(f"{folder}: head_dim {c['head_dim']} is not hidden_size / heads "
                         f"({C // nh}): hpcdist's heads split the width")
    block = int(c.get("max_position_embeddings", 2048))
    if kind in ("mistral", "mixtral") and c.get("sliding_window"):
        block = min(block, int(c["sliding_window"]))     # within the window, all of it seen
    out = {"n_layer": int(c["num_hidden_layers"]), "n_head": nh, "n_embd": C,
           "n_kv_head": int(c.get("num_key_value_heads") or nh),
           "ffn_hidden": int(c["intermediate_size"]), "vocab_size": int(c["vocab_size"]),
           "block_size": block, "rope_theta": _theta(c),
           "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
           "tie_weights": bool(c.get("tie_word_embeddings", False)),
           "bias": bool(c.get("attention_bias", False))}
    if c.get("mlp_bias"):
        raise ValueError(f"{folder}: mlp_bias is set; hpcdist's Llama has one bias setting "
                         "(the attention's)")
    if kind == "mixtral":
        out.update(experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                   aux_loss_coef=float(c.get("router_aux_loss_coef", 0.02)))
    return out


def read_weights(folder: str) -> dict:
    """name -> array of the folder's weights: model.safetensors, or the shards its index
    names (each read once)."""
    out = {}
    for path in weight_files(folder):
        out.update(read_safetensors(path))
    return out


def _layer_names(i: int, experts: int) -> dict:
    """Our name -> (their names, how they join): a fused weight is theirs transposed and
    concatenated along our output axis."""
    L = f"model.layers.{i}."
    a = L + "self_attn."
    out = {f"blocks.{i}.attn_norm.weight": [L + "input_layernorm.weight"],
           f"blocks.{i}.mlp_norm.weight": [L + "post_attention_layernorm.weight"],
           f"blocks.{i}.attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight",
                                           a + "v_proj.weight"],
           f"blocks.{i}.attn.qkv.bias": [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
           f"blocks.{i}.attn.proj.weight": [a + "o_proj.weight"],
           f"blocks.{i}.attn.proj.bias": [a + "o_proj.bias"]}
    if not experts:
        m = L + "mlp."
        out.update({f"blocks.{i}.mlp.gate_up.weight": [m + "gate_proj.weight", m + "up_proj.weight"],
                    f"blocks.{i}.mlp.down.weight": [m + "down_proj.weight"]})
        return out
    m = L + "block_sparse_moe."
    out[f"blocks.{i}.mlp.router.weight"] = [m + "gate.weight"]
    for e in range(experts):
        x = f"{m}experts.{e}."
        out[f"blocks.{i}.mlp.experts.{e}.gate_up.weight"] = [x + "w1.weight", x + "w3.weight"]
        out[f"blocks.{i}.mlp.experts.{e}.down.weight"] = [x + "w2.weight"]
    return out


def name_map(n_layer: int, experts: int = 0) -> dict:
    """Our parameter name -> the Hugging Face names it is made of."""
    out = {"embed_tokens.weight": ["model.embed_tokens.weight"],
           "norm.weight": ["model.norm.weight"], "lm_head.weight": ["lm_head.weight"]}
    for i in range(n_layer):
        out.update(_layer_names(i, experts))
    return out


_KEEP = ("embed_tokens.weight",)          # the same layout on both sides: (vocab, width)


def llama_params(folder: str, names, n_layer: int, experts: int = 0) -> dict:
    """hpcdist name -> array for the parameter ``names`` of a Llama of the folder's shape."""
    theirs = read_weights(folder)
    table = name_map(n_layer, experts)
    out = {}
    for name in names:
        parts = table.get(name)
        if parts is None:
            raise ValueError(f"no Hugging Face name for {name!r}")
        if name == "lm_head.weight" and parts[0] not in theirs:
            parts = ["model.embed_tokens.weight"]              # tied in the folder
        missing = [p for p in parts if p not in theirs]
        if missing:
            raise ValueError(f"{folder} has no {', '.join(missing)} (for {name})")
        arrays = [np.asarray(theirs[p]) for p in parts]
        if name.endswith("norm.weight") or name in _KEEP:
            out[name] = np.ascontiguousarray(arrays[0])
        elif arrays[0].ndim == 1:                               # biases: side by side
            out[name] = np.ascontiguousarray(np.concatenate(arrays))
        else:                                                   # (out, in) -> ours (in, out)
            out[name] = np.ascontiguousarray(np.concatenate([a.T for a in arrays], axis=1))
    return out


def load_llama(folder: str):
    """(nn.Llama with the folder's weights, its vocabulary or None), on the active device."""
    from .. import nn
    shape = llama_shape(folder)
    model = nn.Llama(nn.LlamaConfig(**shape))
    names = [n for n, _ in model.named_parameters()]
    model.load_state_dict(llama_params(folder, names, shape["n_layer"],
                                       shape.get("experts", 0)))
    return model, folder_vocabulary(folder)


def hf_llama_names(params: dict, meta: dict) -> dict:
    """Our parameters under Hugging Face's names and (out, in) layouts, in float32: each
    fused projection cut back into its pieces."""
    nh, C = int(meta["n_head"]), int(meta["n_embd"])
    nkv, hd = int(meta.get("n_kv_head") or nh), C // nh
    table = name_map(int(meta["n_layer"]), int(meta.get("experts", 0) or 0))
    out = {}
    for name, value in params.items():
        value = np.asarray(value, np.float32)
        parts = table[name]
        if name.endswith("norm.weight") or name in _KEEP:
            out[parts[0]] = np.ascontiguousarray(value)
            continue
        if len(parts) == 1:
            out[parts[0]] = np.ascontiguousarray(value.T if value.ndim == 2 else value)
            continue
        widths = [nh * hd, nkv * hd, nkv * hd] if len(parts) == 3 else \
            [value.shape[-1] // 2] * 2
        at = np.cumsum([0] + widths)
        for p, lo, hi in zip(parts, at[:-1], at[1:]):
            piece = value[..., lo:hi]
            out[p] = np.ascontiguousarray(piece.T if piece.ndim == 2 else piece)
    return out


def hf_llama_config(params: dict, meta: dict) -> dict:
    """config.json of the same model for transformers (Llama, or Mixtral with experts)."""
    experts = int(meta.get("experts", 0) or 0)
    vocab, C = params["embed_tokens.weight"].shape
    nh = int(meta["n_head"])
    first = "blocks.0.mlp.experts.0.down.weight" if experts else "blocks.0.mlp.down.weight"
    config = {"architectures": [ARCHS["mixtral" if experts else "llama"]],
              "model_type": "mixtral" if experts else "llama", "vocab_size": int(vocab),
              "hidden_size": int(C), "intermediate_size": int(params[first].shape[0]),
              "num_hidden_layers": int(meta["n_layer"]), "num_attention_heads": nh,
              "num_key_value_heads": int(meta.get("n_kv_head") or nh), "head_dim": int(C) // nh,
              "hidden_act": "silu", "max_position_embeddings": int(meta["block_size"]),
              "rms_norm_eps": float(meta.get("norm_eps", 1e-5)),
              "rope_theta": float(meta.get("rope_theta", 10000.0)),
              "rope_parameters": {"rope_theta": float(meta.get("rope_theta", 10000.0)),
                                  "rope_type": "default"},
              "attention_bias": bool(meta.get("bias", False)), "mlp_bias": False,
              "tie_word_embeddings": bool(meta.get("tie_weights", False)),
              "attention_dropout": 0.0, "torch_dtype": "float32"}
    if experts:
        config.update(num_local_experts=experts, num_experts_per_tok=int(meta["top_k"]),
                      router_aux_loss_coef=float(meta.get("aux_loss_coef", 0.02)),
                      sliding_window=None)
    return config
