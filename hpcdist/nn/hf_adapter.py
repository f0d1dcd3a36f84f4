"""How a family's parameters meet a Hugging Face folder: a table of our name -> their names
and layout, read both ways. A family declares its table, the ``model_type``s it reads, how a
``config.json`` becomes its config and the reverse (``HFAdapter``); checkpoint/hf.py reads
and writes the files and asks the family's adapter for everything else.

Layouts: "same" (their array is ours: norms, token tables, GPT-2's Conv1D weights stored
(in, out)) and "linear" (a torch Linear stores (out, in), our Linear (in, out): transposed).
Several of their tensors can make one of ours (a fused projection such as q | k | v or
gate | up): concatenated along our output axis, and cut back at ``pieces`` on export.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Renamed:
    """Our parameter ``ours`` is their ``theirs`` (one or several, side by side along our
    output axis: widths ``pieces``) in ``layout`` "same" or "linear"; ``instead``: the name to
    read where theirs is absent (a tied head read from the token table)."""
    ours: str
    theirs: tuple
    layout: str = "same"
    pieces: tuple = ()
    instead: str = ""


class HFAdapter:
    """A family's side of a Hugging Face folder. Subclasses set ``model_types`` and write
    ``fields``, ``table`` and ``config_json``."""

    model_types: dict = {}      # model_type -> the architecture transformers builds for it

    def fields(self, c: dict, where: str) -> dict:
        """The family config's fields for a ``config.json`` (``c``); a setting that would
        make other logits than transformers' is a ValueError naming ``where``."""
        raise NotImplementedError

    def table(self, cfg) -> list:
        """A Renamed per parameter of a model of config ``cfg``."""
        raise NotImplementedError

    def config_json(self, cfg) -> dict:
        """config.json of the same model for transformers."""
        raise NotImplementedError

    def lookup(self, theirs: dict, name: str):
        """Their tensor ``name`` (None: absent); a family whose files spell names two ways
        overrides it."""
        return theirs.get(name)

    def to_ours(self, cfg, theirs: dict, names, where: str) -> dict:
        """our name -> array for ``names`` from their tensors (``where``: the folder, for
        the message naming a missing tensor)."""
        table = {r.ours: r for r in self.table(cfg)}
        out = {}
        for name in names:
            r = table.get(name)
            if r is None:
                raise ValueError(f"no Hugging Face name for {name!r}")
            arrays = [self.lookup(theirs, t) for t in r.theirs]
            if any(a is None for a in arrays) and r.instead:
                arrays = [self.lookup(theirs, r.instead)]
            missing = [t for t, a in zip(r.theirs, arrays) if a is None]
            if missing:
                raise ValueError(f"{where} has no {', '.join(missing)} (for {name})")
            arrays = [np.asarray(a) for a in arrays]
            if r.layout == "linear":
                arrays = [a.T if a.ndim == 2 else a for a in arrays]
            value = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-1)
            out[name] = np.ascontiguousarray(value)
        return out

    def to_theirs(self, cfg, params: dict) -> dict:
        """Our parameters under their names and layouts, in float32: each fused one cut at
        its pieces."""
        table = {r.ours: r for r in self.table(cfg)}
        out = {}
        for name, value in params.items():
            r = table.get(name)
            if r is None:
                raise ValueError(f"no Hugging Face name for {name!r}")
            value = np.asarray(value, np.float32)
            widths = r.pieces or (value.shape[-1],)
            at = np.cumsum((0,) + tuple(widths))
            for theirs, lo, hi in zip(r.theirs, at[:-1], at[1:]):
                piece = value[..., lo:hi]
                if r.layout == "linear" and piece.ndim == 2:
                    piece = piece.T
                out[theirs] = np.ascontiguousarray(piece)
        return out


def rope_fields(c: dict, where: str) -> dict:
    """The rotary settings of a ``config.json`` (``rope_theta`` and its scaling, in either
    spelling: ``rope_scaling`` or transformers' newer ``rope_parameters``) as the rotary
    families' config fields; a scaling kind hpcdist does not compute is refused in one line."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta, "rope_type": "default"}
    if kind == "llama3":
        try:
            return {"rope_theta": theta, "rope_type": "llama3",
                    "rope_factor": float(rope["factor"]),
                    "rope_low_freq_factor": float(rope["low_freq_factor"]),
                    "rope_high_freq_factor": float(rope["high_freq_factor"]),
                    "rope_original_context": int(rope["original_max_position_embeddings"])}
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: rotary scaling llama3 needs factor, low_freq_factor, "
                             "high_freq_factor and original_max_position_embeddings") from None
    if kind == "yarn":
        return _yarn_fields(rope, theta, c, where)
    raise ValueError(f"{where}: rotary scaling {kind!r} is not one hpcdist computes (default, "
                     "llama3, yarn): this folder would give other logits than transformers'")


def _yarn_fields(rope: dict, theta: float, c: dict, where: str) -> dict:
    """YaRN's settings (transformers' names): the attention factor where given, else from
    mscale / mscale_all_dim where both are (DeepSeek's form), else 0 (the default's)."""
    if not rope.get("truncate", True):
        raise ValueError(f"{where}: yarn rotary scaling with truncate false is not one "
                         "hpcdist computes")
    try:
        factor = float(rope.get("factor") or int(c["max_position_embeddings"]) /
                       int(rope["original_max_position_embeddings"]))
        original = int(rope.get("original_max_position_embeddings") or
                       c["max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where}: rotary scaling yarn needs factor and "
                         "original_max_position_embeddings") from None
    attention = float(rope.get("attention_factor") or 0.0)
    ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if not attention and ms and ms_all and factor > 1:
        attention = (0.1 * ms * math.log(factor) + 1) / (0.1 * ms_all * math.log(factor) + 1)
    return {"rope_theta": theta, "rope_type": "yarn", "rope_factor": factor,
            "rope_original_context": original,
            "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
            "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
            "rope_attention_factor": attention}


def rope_json(cfg) -> dict:
    """``rope_theta`` and the scaling of a rotary family's config, as config.json has them
    (both spellings: older transformers read rope_scaling, newer rope_parameters)."""
    params = {"rope_theta": float(cfg.rope_theta), "rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        params.update(factor=float(cfg.rope_factor),
                      low_freq_factor=float(cfg.rope_low_freq_factor),
                      high_freq_factor=float(cfg.rope_high_freq_factor),
                      original_max_position_embeddings=int(cfg.rope_original_context))
    if cfg.rope_type == "yarn":
        params.update(factor=float(cfg.rope_factor), beta_fast=float(cfg.rope_beta_fast),
                      beta_slow=float(cfg.rope_beta_slow),
                      original_max_position_embeddings=int(cfg.rope_original_context))
        if cfg.rope_attention_factor:
            params["attention_factor"] = float(cfg.rope_attention_factor)
    scaling = None if cfg.rope_type == "default" else \
        {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": float(cfg.rope_theta), "rope_parameters": params,
            "rope_scaling": scaling}
