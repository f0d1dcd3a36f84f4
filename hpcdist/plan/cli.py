"""``python -m hpcdist.plan``: the command line (the package's docstring is its help)."""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace

from .. import nn
from ..host.cli import Parser
from ..run.config import add_setting
from . import cpu, lora
from .facts import GB, GPU, HARDWARE, PRESETS
from .model import FEATURES, Model, Settings
from .search import plan
from .table import count, nothing_fits, report


def calibrated(gpu: GPU, settings: Settings, path: str) -> tuple:
    """The card and settings with what our benchmarks measured: a JSON object (or the
    ``calibration`` inside ``bench plan``'s ``bench_plan.json``) with any of ``efficiency``,
    ``nvlink`` / ``network`` as [alpha s, bytes/s], ``layer_overhead_s``, ``byte_cost_s``,
    ``call_overhead_s``, ``ranks_per_core`` (a byte cost counts hpcdist's own layers)."""
    doc = json.load(open(path))
    doc = doc.get("calibration", doc)
    if "efficiency" in doc:
        settings = replace(settings, efficiency=float(doc["efficiency"]))
    for level in ("nvlink", "network"):
        if level in doc:
            alpha, bw = doc[level]
            gpu = replace(gpu, **{level: float(bw), f"{level}_alpha": float(alpha)})
    for key, name in (("layer_overhead_s", "layer_overhead"), ("byte_cost_s", "byte_cost"),
                      ("call_overhead_s", "call_overhead"), ("ranks_per_core", "ranks_per_core")):
        if key in doc:
            settings = replace(settings, **{name: float(doc[key])})
    if settings.byte_cost:
        settings = replace(settings, activations="hpcdist")
    return gpu, settings


class _Parser(Parser):
    def error(self, message):          # one line, exit 2 (argparse prints its usage first)
        print(f"{self.prog}: error: {_family_hint(self.explain(message))}", file=sys.stderr)
        sys.exit(2)


def _family_hint(message: str) -> str:
    """An invalid --model / --preset that names a family: say that a family is --arch."""
    m = re.match(r"argument --preset/--model: invalid choice: '([^']*)'", message)
    if m and m[1] in nn.FAMILIES:
        return (f"--model {m[1]}: --model (--preset) names a published model "
                f"({', '.join(sorted(PRESETS)[:4])}, ...: --help lists them); a family is "
                f"--arch {m[1]} with its shape (--layers, --hidden, --heads, ...)")
    return message


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The package docstring as written, and every option's default."""

    def _get_help_string(self, action):
        if action.required or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    doc = sys.modules[__package__].__doc__
    ap = _Parser(prog="python -m hpcdist.plan", description=doc.split("\n\n")[0],
                 formatter_class=_Help, epilog=doc.split("\n\n", 1)[1])
    add = ap.add_argument
    add("--preset", "--model", dest="preset", choices=sorted(PRESETS), metavar="NAME",
        help="a published model's shape (its family's, nn/<family>.py) and vocabulary, and "
             "where the command line gives none a run to plan: GPUs, batch, card; one of "
             f"{', '.join(PRESETS)}")
    add("--arch", default=nn.DEFAULT_ARCH, choices=list(nn.FAMILIES),
        help="the model family (nn/<family>.py; its own settings below)")
    add("--layers", type=int, help="transformer blocks (required without --preset)")
    add("--hidden", type=int, help="model width (required without --preset)")
    add("--heads", type=int, help="attention heads (required without --preset)")
    add("--tie-weights", action=argparse.BooleanOptionalAction, default=None,
        help="the head is the token table (default: the family's)")
    add("--bias", action=argparse.BooleanOptionalAction, default=None,
        help="the family's biases (default: the family's)")
    for name, (kind, text, archs) in nn.options().items():
        add_setting(ap, name, kind, f"{', '.join(archs)}: {text} (default: the family's)")
    add("--seq", type=int, default=2048, help="sequence length")
    add("--vocab", type=int, default=51200, help="vocabulary size")
    add("--vocab-multiple", type=int, default=64,
        help="the token table and head padded to a multiple of this x TP (train's "
             "--vocab-multiple: 64 on a GPU; 1: as given)")
    add("--experts", type=int, default=0, help="routed experts per MoE layer (0: dense)")
    add("--top-k", type=int, default=2, help="experts each token is sent to")
    add("--expert-hidden", type=int, default=0, help="an expert's MLP width (0: 4 x hidden)")
    add("--moe-every", type=int, default=1, help="an MoE MLP in every n-th block")
    add("--global-batch", type=int, help="sequences per step (required without --preset)")
    add("--gpus", type=int, help="GPUs in all (required without --preset)")
    add("--gpus-per-node", type=int, default=8, help="GPUs per node")
    add("--gpu", default="a100-80g", choices=sorted(HARDWARE) + ["custom", "cpu"],
        help="the card (cpu: CPU nodes like this one, measured here: plan/cpu.py)")
    add("--peak-tflops", type=float, help="custom: dense TFLOP/s of --dtype")
    add("--memory-gb", type=float, help="custom: memory per GPU")
    add("--nvlink-gbs", type=float, help="custom: NVLink GB/s each way")
    add("--network-gbs", type=float, help="custom: network GB/s per GPU")
    add("--efficiency", type=float, default=Settings.efficiency,
        help="fraction of the peak the layers' matmuls reach")
    add("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="compute precision")
    lora.add_flags(add)
    add("--tp-across-nodes", action="store_true", help="consider TP groups that leave a node")
    add("--no-sequence-parallel", action="store_true",
        help="leave sequence parallelism out (a framework without it)")
    add("--max-cp", type=int, default=max(Settings.cp_sizes),
        help="the largest context-parallel size considered (1: none)")
    add("--features", default="all", choices=sorted(FEATURES),
        help="what the framework offers: all of hpcdist's, or megatron-2021 (no ZeRO, no "
             "sequence or context parallelism, even splits, 1F1B and interleaved only)")
    add("--calibrate", help="JSON of measured efficiency, links and overheads (bench plan's "
                            "runs/bench/bench_plan.json)")
    add("--top", type=int, help="meshes in the table (default 10), layouts in --json (default: "
                                "all)")
    add("--json", action="store_true", help="every layout that fits, ranked, as JSON")
    add("--wide", action="store_true", help="every column of the table (the default is narrow)")
    add("--diloco", type=int, metavar="H", help="also say when DiLoCo (replica groups a node "
        "each, meeting every H steps) would pay off against the best layout's DDP, at this "
        "network bandwidth and slower ones")
    return ap


# a family config's fields as the planner's flags (the rest: the family's own, same names)
_PLAN_NAMES = {"n_layer": "layers", "n_embd": "hidden", "n_head": "heads", "block_size": "seq",
               "vocab_size": "vocab"}


def _in_planner_words(message: str) -> str:
    """A family config's refusal with the planner's flags for its fields (n_embd: --hidden)."""
    for name, flag in _PLAN_NAMES.items():
        message = re.sub(rf"\b{name}\b", "--" + flag, message)
    return message


def _with_preset(ap, args, argv) -> None:
    """--preset's shape (its family's SIZES) and run in ``args`` where the command line said
    nothing."""
    given = {a.split("=")[0].replace("--no-", "--")
             for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    if args.preset:
        arch, shape = nn.size(args.preset)
        values = {"arch": arch, **{_PLAN_NAMES.get(k, k): v for k, v in shape.items()},
                  **{"global_batch" if k == "batch" else k: v
                     for k, v in PRESETS[args.preset].items()}}
        for name, value in values.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads",
                                                     "global_batch", "gpus")
               if getattr(args, n) is None]
    if missing:
        ap.error(f"{', '.join(missing)} required (or --preset NAME: {', '.join(sorted(PRESETS))})")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "vocab_multiple", "global_batch",
                 "gpus", "gpus_per_node"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    own = set(nn.own_settings(args.arch))
    foreign = [n for n in nn.options() if getattr(args, n) is not None and n not in own]
    if foreign:
        title = nn.family(args.arch).title
        ap.error(f"{', '.join('--' + n.replace('_', '-') for n in foreign)}: not a setting of "
                 f"the {title} family (--arch {args.arch}); the families that have it: "
                 f"{', '.join(nn.options()[foreign[0]][2])}")


def model_of(args) -> Model:
    """The planner's model of the command line (``ValueError``: a setting the family's
    config refuses)."""
    settings = tuple((n, getattr(args, n)) for n in nn.own_settings(args.arch)
                     if getattr(args, n) is not None)
    model = Model(args.layers, args.hidden, args.heads, args.seq, args.vocab,
                  experts=args.experts, top_k=args.top_k, expert_hidden=args.expert_hidden,
                  moe_every=args.moe_every, arch=args.arch, settings=settings,
                  tied=args.tie_weights, bias=args.bias, vocab_multiple=args.vocab_multiple)
    model.config                                    # (refuses what the family refuses)
    return model


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _with_preset(ap, args, argv)
    if args.gpu == "custom":
        if not (args.peak_tflops and args.memory_gb and args.nvlink_gbs and args.network_gbs):
            ap.error("--gpu custom needs --peak-tflops, --memory-gb, --nvlink-gbs, --network-gbs")
        gpu = GPU("custom", {args.dtype: args.peak_tflops * 1e12}, args.memory_gb * GB,
                  args.nvlink_gbs * GB, args.network_gbs * GB)
    elif args.gpu == "cpu":
        gpu, args.dtype = cpu.target(args), "fp32"
    else:
        gpu = HARDWARE[args.gpu]
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        ap.error(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    settings = Settings(efficiency=args.efficiency, dtype=args.dtype,
                        tp_across_nodes=args.tp_across_nodes, **lora.settings(args, ap),
                        **FEATURES[args.features])
    settings = replace(settings, cp_sizes=tuple(c for c in settings.cp_sizes if c <= args.max_cp))
    if args.no_sequence_parallel:
        settings = replace(settings, sequence_parallel=False)
    if args.calibrate:
        gpu, settings = calibrated(gpu, settings, args.calibrate)
    if args.experts < 0 or (args.experts and not 1 <= args.top_k <= args.experts) or \
            args.expert_hidden < 0 or args.moe_every < 1:
        ap.error("--experts >= 0, --top-k between 1 and the experts, --expert-hidden >= 0, "
                 "--moe-every >= 1")
    try:
        model = model_of(args)
    except ValueError as e:
        ap.error(_in_planner_words(str(e)))
    fits, refused = plan(model, gpu, args.gpus, args.gpus_per_node, args.global_batch,
                         settings)
    if args.json:
        print(json.dumps([e.row() for e in fits[:args.top]], indent=1))
        if not fits:
            print(nothing_fits(refused), file=sys.stderr)
        return 0 if fits else 1
    heads = f"{model.heads} heads" + (f", {model.kv_heads} kv head" +
                                        ("s" if model.kv_heads > 1 else "")
                                        if model.kv_heads != model.heads else "")
    print(f"{model.family.title} {model.layers} layers x {model.hidden} hidden ({heads}), "
          f"{count(model.parameters)} parameters" + (
              f" ({model.experts} experts top-{model.top_k} in {model.moe_layers} blocks: "
              f"{count(model.active_parameters)} active)" if model.experts else "") +
          f", seq {model.seq}, global batch "
          f"{args.global_batch} on {args.gpus} x {gpu.name} ({args.gpus_per_node} per node); "
          f"{len(fits)} layouts fit, {len(refused)} refused")
    if not fits:
        print(nothing_fits(refused))
        return 1
    report(fits, args.top or 10, args.wide)
    print(command(model, fits, args.gpus, args.gpus_per_node, settings,
                  "cpu" if args.gpu == "cpu" else "gpu"))
    if args.diloco:
        print(diloco_advice(model, fits, gpu, args.gpus, args.gpus_per_node,
                            args.global_batch, settings=settings, H=args.diloco))
    return 0


def diloco_advice(model, fits, gpu, gpus: int, per_node: int, batch: int, *, settings,
                  H: int) -> str:
    """The step of the fastest layout with data parallelism across nodes (and no pipeline),
    at this network and slower ones: the share DDP computes (its gradient exchange,
    alpha-beta) against DiLoCo's, whose groups (a node each) exchange the same bytes once
    every H steps (its loss per token is the papers' question, not this one:
    docs/diloco.md)."""
    from .steptime import estimate
    across = [e for e in fits if e.layout.pp == 1 and
              e.layout.tp * e.layout.cp * e.layout.dp > per_node]
    if gpus <= per_node or not across:
        return ("DiLoCo: no fitting layout without a pipeline has data parallelism across "
                "nodes here; DiLoCo's groups (a node each) need it")
    L = across[0].layout
    lines = [f"DiLoCo with H = {H} (--strategy diloco --inner-steps {H}) against the fastest "
             f"layout with DP across nodes (TP {L.tp} x DP {L.dp}"
             + (f" x CP {L.cp}" if L.cp > 1 else "") + "), by the network's bandwidth per GPU:",
             "  network GB/s   DDP exchange s   DDP computing   DiLoCo computing"]
    for factor in (1, 10, 100, 1000):
        g = replace(gpu, network=gpu.network / factor)
        e = estimate(model, L, g, gpus, per_node, batch, settings=settings)
        work = e.step_s - e.parts["dp"]
        lines.append(f"  {g.network / GB:12.2f} {e.parts['dp']:16.3f} {work / e.step_s:15.0%} "
                     f"{work / (work + e.parts['dp'] / H):18.0%}")
    return "\n".join(lines + ["  (it pays off where DDP computes little of its step; "
                               "DiLoCo's loss at equal tokens is measured in docs/diloco.md)"])


def train_args(model: Model, L, settings: Settings) -> list:
    """hpcdist.train's options for layout ``L`` (the data: token shards named DATA)."""
    a = ["--task", "text", "--data", "DATA", "--n-layer", model.layers, "--n-embd",
         model.hidden, "--n-head", model.heads, "--block-size", model.seq]
    a += ["--arch", model.arch]
    defaults = model.family.config()
    for name, value in model.settings:            # the family's own, where not its default
        if value != getattr(defaults, name):
            a += ["--" + name.replace("_", "-"),
                  f"{value:.12g}" if isinstance(value, float) else value]
    if model.head_tied != defaults.tie_weights:
        a += ["--tie-weights" if model.head_tied else "--no-tie-weights"]
    if model.config.bias != defaults.bias:
        a += ["--bias" if model.config.bias else "--no-bias"]
    if settings.dtype != "fp32":
        a += ["--precision", settings.dtype]
    if L.pp > 1:
        a += ["--pp", L.pp, "--batch-size", L.micro_batch * L.micro_batches,
              "--micro-batches", L.micro_batches, "--schedule", L.schedule]
        a += ["--virtual-stages", L.virtual] if L.virtual > 1 else []
        a += ["--pp-split", ",".join(map(str, L.split))] if L.split else []
    else:
        a += ["--batch-size", L.micro_batch]
        a += ["--grad-accum", L.micro_batches] if L.micro_batches > 1 else []
    a += ["--tp", L.tp] if L.tp > 1 else []
    a += ["--sequence-parallel"] if L.sp else []
    a += ["--cp", L.cp, "--cp-impl", L.cp_impl] if L.cp > 1 else []
    a += ["--zero", L.zero] if L.zero else []
    a += ["--shard-group", "node"] if L.shard else []
    if model.experts:
        a += ["--experts", model.experts, "--top-k", model.top_k]
        a += ["--expert-hidden", model.expert_hidden] if model.expert_hidden else []
        a += ["--moe-every", model.moe_every] if model.moe_every > 1 else []
        a += ["--ep", L.ep] if L.ep > 1 else []
    a += ["--checkpoint-activations"] if L.recompute else []
    return [str(x) for x in a + lora.train_flags(settings)]


def command(model: Model, fits: list, gpus: int, per_node: int, settings: Settings,
            device: str = "gpu") -> str:
    """The fastest layout as the command that runs it: mpirun on one node, the multi-node
    job template's sbatch line beyond (DATA: token shards from python -m hpcdist.data
    prepare). Where hpcdist.train refuses the fastest, it is printed with the reason, and
    the fastest layout the trainer runs follows."""
    from ..run.config import ConfigError, parse_config
    lines = []
    for i, e in enumerate(fits):
        args = train_args(model, e.layout, settings)
        try:
            parse_config(args)
        except ConfigError as err:
            if i == 0:
                reason = str(err).split("; ")[0]           # its advice is for another layout
                lines += [f"the fastest layout, which hpcdist.train does not take yet ({reason}):",
                          "  " + _launch(args, gpus, per_node, device)]
            continue
        what = "run it" if i == 0 else (f"run it: the fastest layout hpcdist.train takes (number "
                                        f"{i + 1} by step time, {e.step_s:.2f} s)")
        return "\n".join(lines + [f"{what} (DATA: token shards, python -m hpcdist.data prepare):",
                                  "  " + _launch(args, gpus, per_node, device)])
    return "\n".join(lines + ["no fitting layout is one hpcdist.train runs yet"])


def _launch(args: list, gpus: int, per_node: int, device: str = "gpu") -> str:
    if gpus <= per_node:
        return f"mpirun -n {gpus} python -m hpcdist.train --device {device} {' '.join(args)}"
    if device == "cpu":
        return (f"sbatch -N {gpus // per_node} --ntasks-per-node={per_node} "
                "jobs/train-cpu.sbatch " + " ".join(args))
    return (f"sbatch -N {gpus // per_node} --ntasks-per-node={per_node} "
            f"--gpus-per-node={per_node} jobs/train-gpu-multinode.sbatch " + " ".join(args))
