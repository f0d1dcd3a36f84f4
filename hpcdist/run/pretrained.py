"""--init-from: a run that starts from a pretrained Hugging Face folder (GPT-2, Llama, Mistral,
Mixtral) takes its family and shape from it (checkpoint/hf.py reads the folder; config.py
refuses a shape flag that contradicts it), and its data must speak the folder's tokenizer."""
from __future__ import annotations

from .config import ConfigError, validate


def shape_from_pretrained(cfg, train_set, vocabulary=None) -> None:
    """--init-from: the model's shape is the folder's; the data must speak its vocabulary
    (the same size, and where both have one, the same tokenizer: its fingerprint, as
    --resume compares them)."""
    from ..checkpoint import hf
    shape = hf.shape(cfg.init_from)
    hf.check_weights(cfg.init_from)            # a damaged file: one line, before any work
    if shape["vocab_size"] != train_set.vocab_size:
        raise ConfigError(f"--init-from {cfg.init_from} has a vocabulary of "
                          f"{shape['vocab_size']:,}, the data {train_set.vocab_size:,}: "
                          "tokenize the data with the model's tokenizer (python -m "
                          f"hpcdist.data prepare ... --tokenizer {cfg.init_from}/tokenizer.json)")
    if train_set.block_size > shape["block_size"]:
        raise ConfigError(f"--block-size {train_set.block_size} exceeds the {shape['block_size']}"
                          f" positions of --init-from {cfg.init_from}")
    _same_tokenizer(cfg.init_from, vocabulary)
    for name, value in shape.items():
        if name not in ("vocab_size", "block_size") and hasattr(cfg, name):
            setattr(cfg, name, value)
    cfg.__post_init__()                        # the family's defaults for what it left open
    validate(cfg)
    from .. import nn
    hf.check_layers(cfg.init_from, nn.config_of(cfg, vocab_size=shape["vocab_size"],
                                                 block_size=shape["block_size"]))


def _same_tokenizer(folder: str, vocabulary) -> None:
    """Refuse, naming both, data tokenized by another tokenizer of the same size."""
    from ..checkpoint import hf
    from ..data import vocab
    theirs = hf.folder_vocabulary(folder)
    if theirs is None or vocabulary is None or vocabulary.get("kind") not in ("tokenizer",
                                                                              "chars"):
        return                               # (bare token ids: nothing to compare them by)
    a, b = vocab.fingerprint(theirs), vocab.fingerprint(vocabulary)
    if a != b:
        raise ConfigError(f"--init-from {folder} speaks another tokenizer than the data: the "
                          f"folder's is {a}, the data's {b}; tokenize the data with the "
                          f"folder's (python -m hpcdist.data prepare ... --tokenizer "
                          f"{folder}/tokenizer.json)")
