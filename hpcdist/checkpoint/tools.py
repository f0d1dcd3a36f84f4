"""What ``python -m hpcdist.checkpoint`` (cli.py) does: choosing a save folder's checkpoint,
verifying every one, and writing a checkpoint's parameters in other names and formats (.npz in
hpcdist's or nanoGPT's names; a Hugging Face folder: hf_export.py).

The rest of this design: docs/checkpoints.md, "hpcdist/checkpoint/tools.py"."""
from __future__ import annotations

import glob
import json
import os
import struct
import sys

import numpy as np

from . import LATEST, MANIFEST, CheckpointError, Reader, _latest_name, newest_verified


def _is_save_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST)) or not os.path.isfile(
        os.path.join(path, MANIFEST))


def choose(path: str, say=None) -> str:
    """The checkpoint a tool reads for ``path``: ``path`` itself, or a save folder's newest
    that verifies; where a newer one is damaged, ``say`` is told which step is used and why."""
    if not _is_save_folder(path):
        return path
    folder, problems = newest_verified(path)
    if folder is None:
        raise CheckpointError(f"{path}: " + ("no checkpoint verifies: " + "; ".join(problems)
                                             if problems else "no checkpoint here"))
    if problems and say is not None:
        say(f"note: using {folder}, the newest checkpoint that verifies, not the newest: "
            + "; ".join(problems))
    return folder


def verify_all(path: str) -> int:
    """``verify``: every checkpoint of a save folder (or the one named), a line each; 1 when
    any is damaged or ``latest`` names none that verifies, naming them."""
    save_folder = _is_save_folder(path)
    folders = sorted(glob.glob(os.path.join(path, "step_*"))) if save_folder else [path]
    if not folders:
        raise CheckpointError(f"{path}: no checkpoint here")
    damaged = []
    for folder in folders:
        try:
            reader = Reader(folder)
            reader.verify()
            for name in reader.tensors:                  # every tensor assembles
                reader.tensor(name)
            m = reader.manifest
            print(f"{folder}: step {m['step']}, {len(m['files'])} files and "
                  f"{len(m['tensors'])} tensors verified")
        except CheckpointError as e:
            damaged.append(os.path.basename(folder))
            print(f"{folder}: DAMAGED: {e}", file=sys.stderr)
    if save_folder:
        for stage in sorted(glob.glob(os.path.join(path, "partial.*"))):
            print(f"note: {stage}: an interrupted save, not a checkpoint (the next run in this "
                  "folder removes it)", file=sys.stderr)
        name = _latest_name(path)                     # a pointer to nothing is damage too
        if name is not None and not os.path.isdir(os.path.join(path, name)):
            print(f"{os.path.join(path, LATEST)} names {name!r}, which does not exist",
                  file=sys.stderr)
            damaged.append(f"'latest' -> {name}")
        good = [f for f in folders if os.path.basename(f) not in damaged]
        if damaged and good:                           # newest_verified's choice, from the above
            chosen = os.path.join(path, name) if name and os.path.join(path, name) in good \
                else good[-1]
            print(f"note: a resume or a tool would use {chosen}", file=sys.stderr)
    if damaged:
        steps = [d for d in damaged if not d.startswith("'latest'")]
        print(f"python -m hpcdist.checkpoint: error: {len(steps)} of {len(folders)} "
              f"checkpoint(s) damaged: {', '.join(damaged)}", file=sys.stderr)
        return 1
    return 0


_SAFETENSORS_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
                       "int32": "I32", "bfloat16": "BF16"}


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None,
                      dtypes: dict | None = None) -> None:
    """The safetensors format: an 8-byte little-endian header length, a JSON header (name ->
    dtype, shape, [begin, end) in the data), then the tensors' little-endian bytes, C order;
    written atomically. ``dtypes``: a tensor's safetensors dtype where its array holds the
    bits alone (BF16 as uint16)."""
    header, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        kind = (dtypes or {}).get(name) or _SAFETENSORS_DTYPES.get(t.dtype.name)
        if kind is None:
            raise ValueError(f"{name}: no safetensors dtype for {t.dtype}")
        header[name] = {"dtype": kind, "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                 # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).astype(
                tensors[name].dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def export_names(params: dict, meta: dict, names: str) -> dict:
    """The parameters under another project's names (``--names``): one the checkpoint's
    family declares (nn.Family.exports), else a one-line refusal."""
    from .. import nn
    f = nn.family(nn.arch_of(meta))
    exports = dict(f.exports)
    if names not in exports:
        raise ValueError(f"--names {names}: a {f.title} checkpoint exports "
                         f"{', '.join(['hpcdist', *exports])} names")
    return exports[names](params)
