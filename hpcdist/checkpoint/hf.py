"""Hugging Face folders in: ``config.json``, the weights (``model.safetensors`` or the shards
behind ``model.safetensors.index.json``, read here without torch) and the tokenizer, as a
family's model. Which family reads a folder is its ``model_type``; what its names and
settings mean is that family's adapter (nn/hf_adapter.py, declared in nn/<family>.py):
nothing here names a family."""
from __future__ import annotations

from .. import nn
from .hf_files import check_weights, folder_vocabulary, read_config, read_safetensors, \
    safetensors_header, weight_files

__all__ = ["check_weights", "check_layers", "folder_vocabulary", "family", "shape", "params",
           "load"]


def family(folder: str) -> nn.Family:
    """The family that reads ``folder`` (its config.json's model_type); an unknown one is
    refused in one line."""
    return nn.of_model_type(read_config(folder).get("model_type"), folder)


def shape(folder: str) -> dict:
    """The folder's model as TrainConfig fields: arch and the family's settings (the same
    keys a flag would set)."""
    f = family(folder)
    where = f"{folder}/config.json"
    try:
        fields = f.hf.fields(read_config(folder), where)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a {f.title} config.json ({type(e).__name__}: "
                         f"{e})") from None
    return {"arch": f.arch, **fields}


def check_layers(folder: str, cfg) -> None:
    """Every block the folder's config.json declares has its weights in the folder (read from
    the files' headers alone): a config of 3 layers over weights of 2 is one line before any
    work, not a missing tensor found while the model is built."""
    f = nn.family(cfg.arch)
    names = {n: True for path in weight_files(folder) for n in safetensors_header(path)[0]}
    table = f.hf.table(cfg)
    for i in range(cfg.n_layer):
        rows = [r for r in table if r.ours.startswith(f"blocks.{i}.")]
        if rows and not any(f.hf.lookup(names, t) is not None for r in rows
                            for t in (*r.theirs, *([r.instead] if r.instead else []))):
            raise ValueError(f"{folder}/config.json declares {cfg.n_layer} layers, but the "
                             f"folder's weights hold {i} (none of layer {i}'s, such as "
                             f"{rows[0].theirs[0]}): the config and the weights do not match")


def read_weights(folder: str) -> dict:
    """name -> array of every weight file of the folder (each read once)."""
    out = {}
    for path in weight_files(folder):
        out.update(read_safetensors(path))
    return out


def params(folder: str, cfg, names) -> dict:
    """our name -> array of the folder's weights for the parameter ``names`` of a model of
    config ``cfg`` (its family's)."""
    return nn.family(cfg.arch).hf.to_ours(cfg, read_weights(folder), names, folder)


def config(folder: str, **given):
    """The folder's model config (its family's dataclass), ``given`` on top."""
    s = shape(folder)
    return nn.family(s.pop("arch")).config(**{**s, **given})


def load(folder: str):
    """(the folder's model with its weights, its vocabulary or None), on the active device."""
    cfg = config(folder)
    check_layers(folder, cfg)
    model = nn.family(cfg.arch).model(cfg)
    model.load_state_dict(params(folder, cfg, [n for n, _ in model.named_parameters()]))
    return model, folder_vocabulary(folder)
