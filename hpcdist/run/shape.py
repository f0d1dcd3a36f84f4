"""Where a run's model shape can come from besides its flags: a published size (``--model``,
declared by the families in nn/) and a pretrained Hugging Face folder (``--init-from``); each
fills the settings the command line left open, before the settings are checked."""
from __future__ import annotations

from .. import nn
from .errors import ConfigError


SHAPE = ("arch", "n_layer", "n_head", "n_embd", "bias", "tie_weights", "experts", "top_k",
         *nn.options())


def sized(values: dict) -> None:
    """--model NAME: the family and shape of a published size, where the settings say
    nothing else (a flag or a TOML key given wins; another --arch is refused)."""
    if not values.get("model"):
        return
    try:
        arch, shape = nn.size(values["model"])
    except ValueError as e:
        raise ConfigError(str(e), "model") from None
    if values.get("arch", arch) != arch:
        raise ConfigError(f"--model {values['model']} is a {arch} model, not --arch "
                          f"{values['arch']}: drop one", "arch")
    values["arch"] = arch
    for name, value in shape.items():
        values.setdefault(name, value)


def against_pretrained(values: dict) -> None:
    """--init-from takes its family and shape from the folder, filled in here so that every
    check before step 1 sees them (its experts for --ep, say): a shape setting given beside
    it that says otherwise is refused (one that agrees is fine)."""
    if not values.get("init_from"):
        return
    from ..checkpoint import hf
    try:
        shape = hf.shape(values["init_from"])
    except (OSError, ValueError, KeyError):
        return                                  # prepare() reports the folder itself
    for k in SHAPE:
        if k in values and k in shape and values[k] != shape[k]:
            flag = "--" + k.replace("_", "-")
            raise ConfigError(f"{flag} {values[k]} contradicts --init-from "
                              f"{values['init_from']}, whose {k} is {shape[k]}: the model's "
                              f"shape is the folder's; drop {flag}", k)
    values.update({k: v for k, v in shape.items() if k in SHAPE})
