"""--init-from: a run that starts from a pretrained GPT-2 folder takes its shape from it
(checkpoint/hf.py reads the folder; config.py refuses a shape flag that contradicts it)."""
from __future__ import annotations

from .config import ConfigError, validate


def shape_from_pretrained(cfg, train_set) -> None:
    """--init-from: the model's shape is the folder's; the data must speak its vocabulary."""
    from ..checkpoint import hf
    shape = hf.gpt2_shape(cfg.init_from)
    if shape["vocab_size"] != train_set.vocab_size:
        raise ConfigError(f"--init-from {cfg.init_from} has a vocabulary of "
                          f"{shape['vocab_size']:,}, the data {train_set.vocab_size:,}: "
                          "tokenize the data with the model's tokenizer (python -m "
                          f"hpcdist.data prepare ... --tokenizer {cfg.init_from}/tokenizer.json)")
    if train_set.block_size > shape["block_size"]:
        raise ConfigError(f"--block-size {train_set.block_size} exceeds the {shape['block_size']}"
                          f" positions of --init-from {cfg.init_from}")
    cfg.n_layer, cfg.n_head, cfg.n_embd = shape["n_layer"], shape["n_head"], shape["n_embd"]
    cfg.bias, cfg.tie_weights = True, shape["tie_weights"]
    validate(cfg)
