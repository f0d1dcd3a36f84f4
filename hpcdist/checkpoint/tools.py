"""``python -m hpcdist.checkpoint inspect|verify|export DIR``: checkpoints from the shell.

    inspect DIR        step, the layout that wrote it, every tensor (shape, dtype, pieces),
                       every file (size, checksum verified)
    verify DIR         every file's SHA-256 and every tensor assembled; exit 1 on a problem
    export DIR OUT     the whole model as one .npz of named arrays (NumPy alone loads it);
                       ``--names nanogpt`` uses nanoGPT's names and (out, in) linear weights,
                       so ``GPT.load_state_dict`` of a nanoGPT model of the same shape takes it

DIR is a checkpoint folder (``runs/ck/step_00000600``) or a save directory (its ``latest``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

from . import LATEST, CheckpointError, Reader, find_resume


def _folder(path: str) -> str:
    if os.path.isfile(os.path.join(path, LATEST)) or not os.path.isfile(
            os.path.join(path, "manifest.json")):
        folder, _ = find_resume(path)
        if folder is None:
            raise CheckpointError(f"{path}: no checkpoint here")
        return folder
    return path


# hpcdist name -> (nanoGPT name, transpose?): our Linear stores (in, out), torch (out, in)
_NANOGPT = [
    (r"wte\.weight", "transformer.wte.weight", False),
    (r"wpe\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln_(\d)\.(weight|bias)", r"transformer.h.\1.ln_\2.\3", False),
    (r"blocks\.(\d+)\.attn\.c_attn\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"blocks\.(\d+)\.attn\.c_attn\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"blocks\.(\d+)\.attn\.c_proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"blocks\.(\d+)\.attn\.c_proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.0\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.mlp\.layers\.1\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"lm_head\.weight", "lm_head.weight", True),
]


def nanogpt_names(params: dict) -> dict:
    """Our parameters under nanoGPT's names and layouts; a tied head becomes lm_head.weight."""
    out = {}
    for name, value in params.items():
        for pattern, target, transpose in _NANOGPT:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, target, name)] = value.T.copy() if transpose else value
                break
        else:
            raise ValueError(f"no nanoGPT name for {name!r}")
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])      # tied
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdist.checkpoint",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("inspect", "verify"):
        sub.add_parser(cmd).add_argument("dir")
    ex = sub.add_parser("export")
    ex.add_argument("dir")
    ex.add_argument("out")
    ex.add_argument("--names", choices=("hpcdist", "nanogpt"), default="hpcdist")
    args = ap.parse_args(argv)
    try:
        folder = _folder(args.dir)
        reader = Reader(folder)
        if args.cmd == "inspect":
            return _inspect(reader)
        if args.cmd == "verify":
            reader.verify()
            for name in reader.tensors:
                reader.tensor(name)
            print(f"{folder}: {len(reader.manifest['files'])} files and "
                  f"{len(reader.tensors)} tensors verified")
            return 0
        params = {n[len("param/"):]: reader.tensor(n) for n in sorted(reader.tensors)
                  if n.startswith("param/")}
        if args.names == "nanogpt":
            params = nanogpt_names(params)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        np.savez(args.out, **params)
        print(f"wrote {args.out}: {len(params)} arrays, "
              f"{sum(v.size for v in params.values()):,} parameters ({args.names} names)")
        return 0
    except (CheckpointError, ValueError) as e:
        print(f"python -m hpcdist.checkpoint: error: {e}", file=sys.stderr)
        return 1


def _inspect(reader) -> int:
    m = reader.manifest
    sc = reader.scalars
    print(f"{reader.folder}: step {m['step']}, written by {m['world']} ranks, layout "
          f"{sc.get('layout')}, {m['format']}")
    print(f"sampler: epoch {sc['sampler']['epoch']}, {sc['sampler']['position']} global batches "
          f"of {sc['sampler']['global_batch']}; optimizer step {sc.get('opt_step_count')}")
    print(f"{'tensor':50s} {'shape':>16s} {'dtype':>8s} {'pieces':>6s}")
    for name, t in sorted(m["tensors"].items()):
        print(f"{name:50s} {str(tuple(t['shape'])):>16s} {t['dtype']:>8s} "
              f"{len(t['pieces']):6d}")
    reader.verify()
    for name, f in sorted(m["files"].items()):
        print(f"{name}: {f['bytes']:,} bytes, sha256 {f['sha256'][:16]}... verified")
    return 0
