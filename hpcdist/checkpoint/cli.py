"""``python -m hpcdist.checkpoint inspect|verify|export DIR``: checkpoints from the shell.

Exit codes as ``cmp`` and ``diff`` have them: 0 fine, 1 ``verify`` found damage, 2 the tool
could not do what was asked (no checkpoint there, a bad OUT, a full or read-only disk). An
export is written beside OUT and renamed into place: nothing partial is left on failure and
a retry runs. The rest of this design: docs/checkpoints.md, "hpcdist/checkpoint/tools.py"."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

from ..host import folders
from . import CheckpointError, Reader
from .hf_export import DTYPES, export_dtype, export_hf
from .tools import choose, export_names, verify_all
from ..host.cli import Parser


def parser() -> argparse.ArgumentParser:
    from .. import nn
    ap = Parser(prog="python -m hpcdist.checkpoint",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("inspect", "verify"):
        sub.add_parser(cmd).add_argument("dir")
    ex = sub.add_parser("export")
    ex.add_argument("dir")
    ex.add_argument("out")
    other = sorted({name for f in nn.FAMILIES.values() for name, _ in f.exports})
    ex.add_argument("--names", choices=("hpcdist", *other), default="hpcdist",
                    help=".npz names (safetensors always uses Hugging Face's for the family)")
    ex.add_argument("--format", choices=("npz", "safetensors", "peft"), default="npz",
                    help="peft: a LoRA checkpoint's adapters as a PEFT folder "
                         "(PeftModel.from_pretrained reads it)")
    ex.add_argument("--merge", action="store_true",
                    help="with --format safetensors, a LoRA checkpoint: the base with the "
                         "adapters merged in, a Hugging Face folder of the family")
    ex.add_argument("--dtype", choices=sorted(DTYPES), default="",
                    help="with --format safetensors: the weights' dtype (default: the dtype of "
                         "the folder the run started from, else fp32)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an existing export at OUT (refused without it)")
    ex.add_argument(folders.FLAG, dest="others_ok", action="store_true",
                    help="export into a folder OUT that holds files an export does not "
                         "write (refused without it, naming one)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "verify":
            return verify_all(args.dir)
        reader = Reader(choose(args.dir, say=lambda line: print(line, file=sys.stderr)))
        if args.cmd == "inspect":
            return _inspect(reader)
        target = args.out if args.format != "npz" or args.out.endswith(".npz") \
            else args.out + ".npz"                         # (NumPy's savez adds .npz)
        if args.dtype and args.format != "safetensors":
            raise ValueError(f"--dtype is for --format safetensors (a {args.format} export "
                             "keeps the checkpoint's float32)")
        replaced = _existing_export(target, args.format, args.overwrite)
        problem = None if args.format == "npz" or args.others_ok else \
            folders.refusal(target, "OUT", EXPORTED[args.format])
        if problem:
            raise ValueError(problem)
        params = {n[len("param/"):]: reader.tensor(n) for n in sorted(reader.tensors)
                  if n.startswith("param/")}
        meta = reader.manifest.get("meta") or {}
        if replaced:
            print(f"replacing {replaced} (--overwrite)")
        if args.format == "peft":
            return _export_peft(reader, meta, params, args.out)
        params, meta = _lora_export(reader, meta, params, args)
        if args.format == "safetensors":
            vocabulary = reader.scalars.get("vocabulary")
            tensors = _staged(args.out, lambda folder: export_hf(
                folder, params, meta, vocabulary,
                reader.scalars.get("positions"), args.dtype))
            said = " and the tokenizer" if vocabulary and vocabulary.get("kind") in (
                "chars", "tokenizer") else ""
            kind = export_dtype(args.dtype, ((meta.get("source") or {}).get("files") or {})
                                .get("config.json"))
            print(f"wrote {args.out}/model.safetensors ({kind}), config.json, "
                  f"generation_config.json{said}: {len(tensors)} tensors (Hugging Face names; "
                  "transformers.AutoModelForCausalLM.from_pretrained loads the folder)")
            return 0
        if args.names != "hpcdist":
            params = export_names(params, reader.manifest.get("meta") or {}, args.names)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        tmp = f"{target}.tmp{os.getpid()}.npz"
        try:
            np.savez(tmp, **params)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        print(f"wrote {target}: {len(params)} arrays, "
              f"{sum(v.size for v in params.values()):,} parameters ({args.names} names)")
        return 0
    except BrokenPipeError:                            # (__main__ ends quietly)
        raise
    except (CheckpointError, ValueError, OSError) as e:   # (OSError: a full or read-only
        print(f"python -m hpcdist.checkpoint: error: {e}", file=sys.stderr)    # disk)
        return 2


def _lora_export(reader, meta: dict, params: dict, args) -> tuple:
    """(params, meta) to export: a LoRA checkpoint's base with its adapters merged in
    (``--merge``); refusals of --merge on a whole model and of a LoRA checkpoint unmerged."""
    lora_run = "lora" in meta
    if args.merge and not lora_run:
        raise ValueError(f"{reader.folder} trained the whole model, not LoRA adapters: "
                         "--merge is for a LoRA checkpoint")
    if args.merge and args.format != "safetensors":
        raise ValueError("--merge writes a Hugging Face folder: pass --format safetensors")
    if lora_run and not args.merge:
        raise ValueError(f"{reader.folder} holds LoRA adapters: --format peft writes them, "
                         "--format safetensors --merge the merged model")
    if not args.merge:
        return params, meta
    from . import adapters                             # the base with the update added in
    model, _ = adapters.checkpoint_model(meta, params, reader.folder)
    return adapters.merged(model), meta           # (the run's meta has the folder's shape)


def _export_peft(reader, meta: dict, params: dict, out: str) -> int:
    """A LoRA checkpoint's adapters as a PEFT folder (their names from its base's family)."""
    if "lora" not in meta:
        raise ValueError(f"{reader.folder} trained the whole model, not LoRA adapters: "
                         "--format peft is for a LoRA checkpoint")
    from . import adapters, peft
    from ..nn import lora
    model, _ = adapters.checkpoint_model(meta, params, reader.folder)
    tensors = lora.to_peft(model, params)
    _staged(out, lambda folder: adapters.write(folder, adapters.spec_of(meta), tensors,
                                           meta.get("base_folder", "")))
    print(f"wrote {out}/{peft.WEIGHTS} and {peft.CONFIG}: {len(tensors)} tensors "
          "(PEFT's names; peft.PeftModel.from_pretrained(base, OUT) loads the folder)")
    return 0


# What an export writes in its folder (a Hugging Face model folder, a PEFT adapter folder)
EXPORTED = {"safetensors": ("config.json", "generation_config.json", "model.safetensors",
                            "model-*-of-*.safetensors", "model.safetensors.index.json",
                            "tokenizer.json", "tokenizer_config.json",
                            "special_tokens_map.json", "chat_template.jinja", "*.tmp"),
            "peft": ("adapter_config.json", "adapter_model.safetensors", "*.tmp",
                     "*.tmp.*")}


def _existing_export(target: str, fmt: str, overwrite: bool) -> str | None:
    """What an export to ``target`` would replace (None: nothing); refused without
    ``overwrite``."""
    if fmt == "peft":
        found = [n for n in ("adapter_config.json", "adapter_model.safetensors")
                 if os.path.isfile(os.path.join(target, n))]
        what = f"{target} (an adapter folder: {', '.join(found)})" if found else None
    elif fmt == "safetensors":
        found = [n for n in ("model.safetensors", "config.json", "tokenizer.json",
                             "tokenizer_config.json")
                 if os.path.isfile(os.path.join(target, n))]
        what = f"{target} (a model folder: {', '.join(found)})" if found else None
        if os.path.exists(target) and not os.path.isdir(target):
            raise ValueError(f"{target} is a file; a safetensors export is a folder")
    else:
        if os.path.isdir(target):
            raise ValueError(f"{target} is a folder; an .npz export is a file")
        what = target if os.path.exists(target) else None
    if what and not overwrite:
        raise ValueError(f"{what} exists; pass --overwrite to replace it, or another OUT")
    return what


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


def _staged(out: str, write):
    """``write(folder)`` into a folder beside ``out``, then into place: renamed where ``out``
    is new or empty, else file by file (os.replace each, config.json last: a loader never
    finds a config without its weights); the staging folder removed whatever happens."""
    out = out.rstrip("/") or out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stage = f"{out}.partial-{os.getpid()}"
    try:
        result = write(stage)
        if not os.path.isdir(out) or not os.listdir(out):
            if os.path.isdir(out):
                os.rmdir(out)
            os.rename(stage, out)
        else:
            names = sorted(os.listdir(stage), key=lambda n: n == "config.json")
            for name in names:
                os.replace(os.path.join(stage, name), os.path.join(out, name))
        return result
    finally:
        shutil.rmtree(stage, ignore_errors=True)
