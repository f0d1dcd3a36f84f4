"""A model family is a declaration: the parts of a decoder-only language model by role, each
block's projections by the way tensor parallelism cuts them, and one attention shape that
every attention site reads. Tensor, sequence, context, pipeline and expert parallelism,
ZeRO-3, recompute, checkpoints and the planner read these, never a family's attribute
names (torchtitan's model specs; picotron's module swapping). A family is a module of nn/
(gpt.py, llama.py) registered in ``FAMILIES``; docs/models.md has the contract."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..device import backend, fp8
from ..autograd.recompute import checkpoint
from ..autograd.tensor import Tensor
from .module import Module
from .packing import Packing, tokens_of


@dataclass(frozen=True)
class AttentionShape:
    """``n_head`` query heads, ``n_kv_head`` key/value heads (each shared by n_head //
    n_kv_head queries: grouped-query attention; 1: multi-query) of ``head_dim`` each. The
    fused projection's output is q | k | v: ``pieces`` wide."""
    n_head: int
    n_kv_head: int
    head_dim: int

    def __post_init__(self):
        if min(self.n_head, self.n_kv_head, self.head_dim) < 1:
            raise ValueError(f"attention needs positive heads and head size, got {self}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head "
                             f"({self.n_kv_head}): each kv head serves a whole group")

    @property
    def pieces(self) -> tuple:
        hd = self.head_dim
        return (self.n_head * hd, self.n_kv_head * hd, self.n_kv_head * hd)

    @property
    def width(self) -> int:
        """The fused q|k|v projection's output width."""
        return sum(self.pieces)

    @property
    def out_width(self) -> int:
        """Attention's output width (the output projection's input)."""
        return self.n_head * self.head_dim

    def split_problem(self, n: int, what: str = "the tensor-parallel size") -> str | None:
        """Why the heads cannot be split ``n`` ways (None: they can)."""
        if self.n_head % n or self.n_kv_head % n:
            both = [d for d in range(1, self.n_kv_head + 1)
                    if self.n_head % d == 0 and self.n_kv_head % d == 0]
            return (f"{what} {n} must divide n_head ({self.n_head}) and n_kv_head "
                    f"({self.n_kv_head}): each rank takes whole kv heads; choose one of "
                    f"{', '.join(map(str, both))}")
        return None

    def split(self, n: int) -> "AttentionShape":
        """The heads one of ``n`` ranks holds (``split_problem`` must be None)."""
        why = self.split_problem(n)
        if why:
            raise ValueError(why)
        return AttentionShape(self.n_head // n, self.n_kv_head // n, self.head_dim)

    def views(self, qkv):
        """q (B, T, n_head, hd), k and v (B, T, n_kv_head, hd): views of qkv's last axis."""
        B, T = qkv.shape[:2]
        q, k, _ = self.pieces
        return (qkv[..., :q].reshape(B, T, self.n_head, self.head_dim),
                qkv[..., q:q + k].reshape(B, T, self.n_kv_head, self.head_dim),
                qkv[..., q + k:].reshape(B, T, self.n_kv_head, self.head_dim))


@dataclass(frozen=True)
class Anatomy:
    """What a family's block and ends are made of, as counts need them (the planner's
    parameters, FLOPs and memory: plan/), declared by each config's ``anatomy()`` without
    building a model. A block: a norm, attention (``attention``'s heads; q|k|v one
    column-parallel projection, with ``qkv_bias``; the output projection, row-parallel, with
    ``out_bias``), a norm, the MLP (``gated``: gate | up one projection, 2 x ``mlp_width``
    wide, their product into down; else up, the GELU, down; biases on both where
    ``mlp_bias``), experts of ``expert_width`` in place of the MLP where the config says.
    ``norm``: "layernorm" (a weight and, with ``norm_bias``, a bias; keeps its mean and
    1/std) or "rmsnorm" (a weight; keeps 1/std). ``rotary``: positions rotate q and k (else
    a learned table of block_size rows is added to the token vectors); ``scaled_embeddings``:
    the token vectors are multiplied by a constant; ``tied``: the head is the token table;
    ``head_norms``: a block's parameters of norms applied to each attention head (Qwen3's q
    and k norms: 2 x head_dim), replicated whole on every tensor-parallel rank."""
    attention: AttentionShape
    mlp_width: int
    gated: bool
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    norm: str
    norm_bias: bool
    rotary: bool
    tied: bool
    scaled_embeddings: bool = False
    expert_width: int = 0
    head_norms: int = 0
    block_norms: int = 2         # norms over the hidden width a block (Gemma 2: 4)

    @property
    def norm_size(self) -> int:
        """One norm's parameters per unit of width (a weight, and a bias)."""
        return 1 + int(self.norm_bias)

    def mlp_parameters(self, C: int, width: int | None = None) -> int:
        """A dense MLP's (or one expert's, ``width``) weights and biases at width C."""
        f = width or self.mlp_width
        up = 2 * f if self.gated else f
        return C * up + f * C + int(self.mlp_bias) * (up + C)

    def column_biases(self) -> int:
        """A dense block's biases on column-parallel projections (split over TP)."""
        up = 2 * self.mlp_width if self.gated else self.mlp_width
        return int(self.qkv_bias) * self.attention.width + int(self.mlp_bias) * up

    def row_biases(self, C: int) -> int:
        """... and on the row-parallel ones (whole on every TP rank)."""
        return (int(self.out_bias) + int(self.mlp_bias)) * C


def count_parameters(cfg) -> int:
    """A family config's parameters, counted from its ``anatomy()`` (the vocabulary
    unpadded): what a run is sized by before anything is allocated, and the planner's count."""
    a, C = cfg.anatomy(), cfg.n_embd
    shape = a.attention
    attn = C * shape.width + shape.out_width * C + int(a.qkv_bias) * shape.width + \
        int(a.out_bias) * C
    moe = C * cfg.experts + (cfg.experts + cfg.shared_experts) * \
        a.mlp_parameters(C, a.expert_width)
    with_experts = sum(1 for i in range(cfg.n_layer) if cfg.is_moe(i))
    blocks = cfg.n_layer * (attn + a.block_norms * a.norm_size * C + a.head_norms) + with_experts * moe + \
        (cfg.n_layer - with_experts) * a.mlp_parameters(C)
    tables = cfg.vocab_size * C + (0 if a.rotary else cfg.block_size * C)
    return blocks + tables + a.norm_size * C + (0 if a.tied else C * cfg.vocab_size)


@dataclass(frozen=True)
class Projection:
    """One linear layer of a block and how tensor parallelism cuts it: ``path`` in the block
    ("attn.c_attn"), ``role`` "column" (outputs split: each of ``pieces``, the widths of the
    fused outputs side by side, split alike) or "row" (inputs split, outputs summed)."""
    path: str
    role: str
    pieces: tuple = ()


def resolve(module, path: str):
    """(owner, attribute, the module at ``path``): "attn.c_attn", "mlp.layers.0"."""
    *head, last = path.split(".")
    owner = module
    for name in head:
        owner = owner[int(name)] if name.isdigit() else getattr(owner, name)
    value = owner[int(last)] if last.isdigit() else getattr(owner, last)
    return owner, last, value


def replace(module, path: str, new) -> None:
    owner, last, _ = resolve(module, path)
    if last.isdigit():
        owner[int(last)] = new
    else:
        setattr(owner, last, new)


class DecoderLM(Module):
    """The decoder-only language model every family builds: tokens -> [positions] -> blocks
    -> norm -> head -> loss. ``PARTS`` names each role's attribute ("tokens", "positions" —
    None where positions are rotary, applied inside attention —, "drop", "norm", "head" —
    None for a head tied to the token table —, "loss"); ``blocks`` holds the blocks, each
    declaring ``projections()`` and ``attention`` (the path of its attention core)."""

    PARTS: dict = {}         # (a part's attribute must not be one of the methods below)
    seq = None               # parallel.sequence.Sequence once a parallel dimension cuts it
    embed_scale = None       # the token vectors are multiplied by it (Gemma: sqrt(n_embd))
    packed = False           # batches are packed rows (nn/packing.py): several documents a row
    _packing = (None, None)  # (the ids, their Packing): read once per batch

    def part(self, role: str):
        name = self.PARTS.get(role)
        return getattr(self, name, None) if name else None

    def set_part(self, role: str, module) -> None:
        setattr(self, self.PARTS[role], module)

    def forward(self, idx, targets=None, ignore_index: int = -100, cache=None):
        """idx (B, T) tokens -> logits (B, T, vocab), and the loss when targets given.
        ``cache``: one dict per block (inference with a KV cache: ``idx`` are the tokens
        after those the cache holds; see hpcdist.sample)."""
        if isinstance(idx, Tensor):
            idx = idx.data
        past = cached_length(cache)
        x = self.embed(idx, past, cached=cache is not None)          # (B, T, C)
        pos = self.layout(idx, past)
        for i, block in enumerate(self.blocks):
            x = self.run_block(block, x, pos) if cache is None else block(x, pos, cache[i])
        return self.head(x, targets, ignore_index)

    # The pieces a pipeline stage runs (parallel/pipeline.py): embed, blocks, head.
    def embed(self, idx, past: int = 0, cached: bool = False) -> Tensor:
        """The token vectors (and a learned table's positions). ``cached``: inference with a
        KV cache, where a rotary family runs past block_size, as transformers does (only a
        learned position table ends there)."""
        B, T = idx.shape
        if past + T > self.config.block_size and (not cached or self.PARTS.get("positions")):
            raise ValueError(f"sequence length {past + T} exceeds block_size "
                             f"{self.config.block_size}")
        if self.seq is not None:            # the batch's length, for every cut module
            self.seq.begin(T)
        packing = self.packing(idx)
        x = self.part("tokens")(idx if packing is None else tokens_of(idx))
        if self.embed_scale is not None:
            x = x * self.embed_scale
        table = self.part("positions")
        if table is not None:
            x = x + table(backend.array_module(idx).arange(past, past + T) if packing is None
                          else packing.device_positions())
        drop = self.part("drop")
        return drop(x) if drop is not None else x                   # (B, T, C)

    def packing(self, idx):
        """The Packing of a packed batch's ids (nn/packing.py), None for a model that is not
        ``packed`` (made once per batch: the embedding and the blocks both read it)."""
        if not self.packed:
            return None
        if self._packing[0] is not idx:
            self._packing = (idx, Packing(idx))
        return self._packing[1]

    def layout(self, idx, past: int = 0):
        """What the blocks' attention takes for a batch: the rows' global positions, or a
        packed batch's Packing (each document attended alone, from position 0)."""
        packing = self.packing(idx)
        return self.positions(idx.shape[1], past) if packing is None else packing

    def positions(self, T: int, past: int = 0):
        """The global positions of the rows attention sees (under context parallelism this
        rank's slice); rotary embeddings rotate q and k by them."""
        pos = backend.xp().arange(past, past + T)
        return pos if self.seq is None else self.seq.context_rows(pos)

    def run_block(self, block, x: Tensor, pos) -> Tensor:
        if self.config.checkpoint_activations and self.training:
            return checkpoint(lambda h: block(h, pos), x)
        return block(x, pos)

    def head(self, x: Tensor, targets=None, ignore_index: int = -100):
        """(logits, loss) of the final norm and the LM head (logits alone without targets)."""
        x = self.part("norm")(x)
        head = self.part("head")
        with fp8.kept_out():                  # (--precision fp8: the head computes in bf16)
            logits = self.part("tokens").attend(x) if head is None else head(x)
        return self.part("loss")(logits, targets, ignore_index)

    @property
    def attention_shape(self) -> AttentionShape:
        return self.config.attention_shape()


def cached_length(cache) -> int:
    """Tokens a KV cache (one dict per block: "k", "v" (B, tokens, kv heads x head size),
    "seen": the tokens it has been fed, where a sliding window keeps fewer) stands for."""
    if not cache or cache[0].get("k") is None:
        return 0
    return cache[0].get("seen", cache[0]["k"].shape[1])


@dataclass(frozen=True)
class Family:
    """Everything a family is, declared once in its module of nn/ and registered: its
    ``--arch`` name and title, its config (a dataclass: fields, defaults, validation; the
    fields marked ``option`` become the family's flags), its model (a DecoderLM), its Hugging
    Face adapter (nn/hf_adapter.py: the model_types it reads, names both ways, config.json),
    one line for ``--arch``'s help, other name sets an export may write (``exports``:
    name -> function of the parameters), its published sizes (``sizes``: name -> the
    config's fields; the trainer's ``--model NAME``) and what the planner plans them with
    (``runs``: name -> the published vocabulary, and GPUs and global batch of a run to plan
    where its command line gives none: ``python -m hpcdist.plan --preset NAME``)."""
    arch: str
    title: str
    config: type
    model: type
    hf: object = None
    about: str = ""
    exports: tuple = ()
    sizes: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)


FAMILIES: dict = {}          # arch -> Family: filled by nn/__init__.py
DEFAULT_ARCH = "gpt"         # a run without --arch; a checkpoint or folder naming none


def arch_of(settings) -> str:
    """The family a TrainConfig, a checkpoint's meta dict or a config.json's fields name
    (none named: ``DEFAULT_ARCH``, as older GPT checkpoints are)."""
    get = settings.get if isinstance(settings, dict) else \
        (lambda k, d=None: getattr(settings, k, d))
    return get("arch") or DEFAULT_ARCH


def register(family: Family) -> None:
    FAMILIES[family.arch] = family


def family(arch: str) -> Family:
    """The family ``arch`` (unknown: ValueError naming the known ones)."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown --arch {arch!r}: one of {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def of_model_type(model_type: str | None, where: str) -> Family:
    """The family that reads Hugging Face folders of ``model_type`` (None: the default
    family's first, as GPT-2 folders older than model_type are)."""
    if model_type is None:
        return family(DEFAULT_ARCH)
    for f in FAMILIES.values():
        if f.hf is not None and model_type in f.hf.model_types:
            return f
    known = [t for f in FAMILIES.values() if f.hf is not None for t in f.hf.model_types]
    raise ValueError(f"{where}: model_type {model_type!r} is not a family hpcdist reads "
                     f"({', '.join(known)})")


def options() -> dict:
    """Every family's own settings — the config fields declared with a help text (``option``
    in nn/llama.py), each a flag of the trainer: name -> (type, help, the families that have
    it), in the order the families declare them."""
    import dataclasses
    names = {f.name for fam in FAMILIES.values() for f in dataclasses.fields(fam.config)
             if "help" in f.metadata}
    out = {}
    for arch, fam in FAMILIES.items():
        for f in dataclasses.fields(fam.config):
            if f.name in names:
                kind, text, archs = out.get(f.name, (f.type, "", []))
                out[f.name] = (kind, text or f.metadata.get("help", ""), archs + [arch])
    return out


def size(name: str) -> tuple:
    """(arch, the config's fields) of a published size a family declares (``--model``); an
    unknown name is a ValueError listing the known."""
    for arch, fam in FAMILIES.items():
        if name in fam.sizes:
            return arch, dict(fam.sizes[name])
    known = [n for fam in FAMILIES.values() for n in fam.sizes]
    raise ValueError(f"unknown --model {name!r}: one of {', '.join(known)}")


def option_names() -> set:
    return set(options())


def own_settings(arch: str) -> list:
    """The settings of family ``arch`` that are its own (``option_names``), in its order."""
    import dataclasses
    names = option_names()
    return [f.name for f in dataclasses.fields(family(arch).config) if f.name in names]


def config_of(settings, arch: str | None = None, **given):
    """Family ``arch``'s config (default: ``settings``' arch) from ``settings`` — a
    TrainConfig, or a checkpoint's meta dict — taking every field it sets (None: the
    family's default), with ``given`` on top. Not validated."""
    import dataclasses
    get = settings.get if isinstance(settings, dict) else \
        (lambda k, d=None: getattr(settings, k, d))
    cls = family(arch or arch_of(settings)).config
    values = {f.name: get(f.name) for f in dataclasses.fields(cls) if get(f.name) is not None}
    values.update(given)
    return cls(**values)


def build(arch: str, **fields):
    """The model of family ``arch`` from its config's fields (unknown arch: ValueError)."""
    f = family(arch)
    return f.model(f.config(**fields))
