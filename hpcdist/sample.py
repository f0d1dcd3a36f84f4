"""Generate text from a model: ``python -m hpcdist.sample CKPT_OR_HF_DIR --prompt TEXT``.

CKPT_OR_HF_DIR is an hpcdist save folder or checkpoint (any layout wrote it: the tensors are
assembled from its pieces) or a Hugging Face folder of a family hpcdist reads (the MODEL
line below lists them: config.json + model.safetensors, or its shards, and its tokenizer).
The prompt is encoded with the vocabulary the checkpoint kept (its
characters or its tokenizer), and tokens are drawn one at a time with a KV cache: each new
token runs through the model alone, attending to the cached keys and values of all before it.

The rest of this design: docs/training.md, "hpcdist/sample.py"."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .device import backend
from . import checkpoint, nn
from .data import vocab
from .autograd.tensor import no_grad
from .nn.moe import load_balance_bias
from .host.cli import Parser


def load(path: str, adapter: str = ""):
    """(the model in eval mode, vocabulary dict or None) of a save folder, a checkpoint or a
    Hugging Face folder (GPT-2, Llama, Mistral, Mixtral), with the PEFT ``adapter`` folder's
    LoRA adapters on it where given; a LoRA checkpoint's base is its folder, read again."""
    if any(os.path.isfile(os.path.join(path, name)) for name in (
            "config.json", "model.safetensors", "model.safetensors.index.json")):
        from .checkpoint import adapters, hf, peft
        if adapter:
            spec, tensors = peft.read(adapter)
            model, v = adapters.adapted(path, spec, tensors=tensors, where=adapter)
        else:
            model, v = hf.load(path)
        return model.eval(), v
    if adapter:
        raise ValueError(f"--adapter goes on a Hugging Face model folder; {path} is a "
                         "checkpoint (a LoRA checkpoint holds its adapters already)")
    from .checkpoint.tools import choose
    reader = checkpoint.Reader(choose(path, say=lambda line: print(line, file=sys.stderr)))
    meta = reader.manifest.get("meta") or {}
    params = {n[len("param/"):]: reader.tensor(n) for n in reader.tensors
              if n.startswith("param/")}
    if "lora" in meta:                                # adapters on a Hugging Face base
        from .checkpoint import adapters
        model, v = adapters.checkpoint_model(meta, params, reader.folder)
        return model.eval(), reader.scalars.get("vocabulary") or v
    family = nn.family(nn.arch_of(meta))
    vocab_size, _ = params[family.model.PARTS["tokens"] + ".weight"].shape
    dtype = "float64" if meta.get("dtype") == "fp64" else "float32"
    backend.set_default_float(dtype)
    table = family.model.PARTS.get("positions")
    block = params[table + ".weight"].shape[0] if table else \
        int(reader.scalars.get("positions") or meta.get("block_size", 1024))
    model = family.model(nn.config_of(meta, family.arch, block_size=block,
                                      vocab_size=vocab_size))
    model.load_state_dict(params)
    if "moe_bias" in reader.scalars:                  # the sigmoid router's balancing bias
        load_balance_bias(model, reader.scalars["moe_bias"])
    return model.eval(), reader.scalars.get("vocabulary")


def choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng) -> int:
    """The next token from one row of logits (greedy at temperature 0)."""
    logits = logits.astype(np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if top_k and top_k < logits.size:
        kth = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    if 0 < top_p < 1:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p     # the smallest set reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def generate(model, ids, n: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, *, seed: int = 0, stop=None, say=None, each=None) -> list:
    """``ids`` followed by ``n`` new tokens (fewer if ``stop`` is drawn), each new token run
    through the model alone against the KV cache, as transformers' ``generate`` does.

    Past ``block_size``: a family with rotary positions continues with the cache (positions
    have no table; transformers goes on alike), a sliding window keeping the cache to the
    window; a learned position table ends there, so each token past it sees the last
    block - 1 (a prompt longer than the block is cropped to them). ``say`` is told once of
    either; ``each(token)`` is called with every new token as it is drawn."""
    xp, rng = backend.xp(), np.random.default_rng(seed)
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("an empty prompt: give at least one token")
    block = model.config.block_size
    learned = model.PARTS.get("positions") is not None     # (a table of block rows)
    cfg = model.config
    window = cfg.feed_window() if hasattr(cfg, "feed_window") else \
        getattr(cfg, "sliding_window", 0) or 0
    said = set()

    def note(key, line):
        if say is not None and key not in said:
            said.add(key)
            say(line)

    def run(tokens, cache):
        return model(xp.asarray(np.array([tokens])), cache=cache)

    with no_grad():
        cache = [{} for _ in model.blocks]
        if learned and len(ids) > block:
            note("prompt", f"the prompt's {len(ids)} tokens are more than the model's {block} "
                           f"positions: it continues from the last {block - 1}")
        first = ids[-(block - 1):] if learned and len(ids) > block else ids
        if window and len(first) > window:           # (past the window: a row a call)
            logits = run(first[:window], cache)
            for t in first[window:]:
                logits = run([t], cache)
        else:
            logits = run(first, cache)
        fed = len(first)
        for i in range(n):
            nxt = choose(backend.to_numpy(logits.data[0, -1]), temperature, top_k, top_p, rng)
            ids.append(nxt)
            if each is not None:
                each(nxt)
            if (stop is not None and nxt == stop) or i == n - 1:
                break
            if learned and fed >= block:              # a learned table ends: the last block
                note("crop", f"past the model's {block} positions (a learned position "
                             f"table): each new token sees the last {block - 1}")
                cache = [{} for _ in model.blocks]
                window_ids = ids[-(block - 1):]
                logits, fed = run(window_ids, cache), len(window_ids)
            else:                                     # one token through the cache
                logits, fed = run([ids[-1]], cache), fed + 1
    return ids


def main(argv=None) -> int:
    ap = Parser(prog="python -m hpcdist.sample",
                description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__.split("\n\n", 1)[1])
    kinds = [c.replace("ForCausalLM", "").replace("LMHeadModel", "") for f in
             nn.FAMILIES.values() for c in f.hf.model_types.values()]
    ap.add_argument("model", help="a save folder, a checkpoint, or a Hugging Face model folder "
                                  f"({', '.join(kinds)})")
    ap.add_argument("--prompt", default="", help="text to continue (default: the end-of-text "
                                                 "token, or the first token)")
    ap.add_argument("--ids", default="", help="the prompt as comma-separated token ids")
    ap.add_argument("--chat", default="", help="a user turn: rendered with the chat template "
                    "and its generation prompt; the answer alone is printed, ending at the "
                    "template's end-of-turn token")
    ap.add_argument("--system", default="", help="with --chat: a system turn before it")
    ap.add_argument("--template", default="", help="with --chat: the model folder whose chat "
                    "template and tokenizer to use (default: MODEL, where it is a Hugging "
                    "Face folder; a checkpoint names the folder it started from)")
    ap.add_argument("--adapter", default="", help="a PEFT LoRA adapter folder on MODEL (a "
                    "Hugging Face folder): adapter_config.json + adapter_model.safetensors")
    ap.add_argument("--tokens", type=int, default=100, help="tokens to generate (default 100)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep probability p")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | gpu | auto")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks (run under mpirun -n TP): heads and vocabulary "
                         "split, as in training")
    args = ap.parse_args(argv)
    for bad in (not 0 <= args.temperature < float("inf") and f"--temperature must be a "
                f"number >= 0 (0: greedy), got {args.temperature}",
                args.prompt and args.ids and "--prompt and --ids are both the prompt: give "
                "one", args.top_k < 0 and f"--top-k must be >= 0, got {args.top_k}",
                not 0 < args.top_p <= 1 and f"--top-p must be in (0, 1], got {args.top_p}",
                args.tokens < 0 and f"--tokens must be >= 0, got {args.tokens}"):
        if bad:
            ap.error(bad)
    rank = 0
    try:
        model, v, rank = build(args)
        tok = vocab.Tokenizer(v) if v is not None and v.get("kind") in ("chars", "tokenizer") \
            else None
        ids, stop, answer = prompt_of(args, model, tok)
        stream = Stream(tok, ids if answer is None else [], stop if answer is not None
                        else None) if rank == 0 else None   # (every rank draws the same)
        generate(model, ids, args.tokens, args.temperature, args.top_k, args.top_p,
                 seed=args.seed, stop=stop, each=stream and stream.add,
                 say=lambda line: print(f"note: {line}", file=sys.stderr)
                 if rank == 0 else None)
        if stream is not None:
            stream.end()
    except (OSError, ValueError, KeyError, checkpoint.CheckpointError,
            backend.DeviceError) as e:
        print(f"python -m hpcdist.sample: error: {e}", file=sys.stderr)
        return 2
    return 0


class Stream:
    """The output as it is drawn: the prompt, then each new token's text printed as soon as
    it decodes to whole characters (a token ending inside a UTF-8 character waits for the
    next). Each piece is decoded after the token before it, so that a tokenizer which drops
    a leading space at the start of a text (SentencePiece's) keeps it mid-text: the pieces
    join to the whole output's decoding, at O(1) work a token (vLLM's incremental
    detokenizing). Without a vocabulary, the ids comma-separated. ``drop``: an end token
    not printed (a --chat answer's)."""

    def __init__(self, tok, prompt: list, drop=None):
        self.tok, self.drop, self.ids = tok, drop, list(prompt)
        self.start, self.read = max(0, len(prompt) - 1), len(prompt)   # context, then new
        if prompt:
            self._write(tok.decode(prompt) if tok is not None else
                        ",".join(str(i) for i in prompt))

    def add(self, token: int) -> None:
        if token == self.drop:
            return
        self.ids.append(token)
        if self.tok is None:
            self._write(("," if len(self.ids) > 1 else "") + str(token))
            return
        new = self._new()
        if new and not new.endswith("\ufffd"):           # (a character cut in two: wait)
            self._write(new)
            self.start, self.read = self.read, len(self.ids)

    def end(self) -> None:
        if self.tok is not None:                         # what never decoded whole
            self._write(self._new())
        self._write("\n")

    def _new(self) -> str:
        """The text of the tokens not yet printed, decoded after the one before them."""
        context = self.tok.decode(self.ids[self.start:self.read])
        return self.tok.decode(self.ids[self.start:])[len(context):]

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def prompt_of(args, model, tok) -> tuple[list, int | None, int | None]:
    """(the prompt's ids, the id that stops generation or None, where the answer starts: a
    --chat answer is printed alone, else None)."""
    if args.chat:
        if args.ids or args.prompt:
            raise ValueError("--chat is the prompt: drop --prompt / --ids")
        ids, stop = chat_ids(args, tok)
        return ids, stop, len(ids)
    if args.ids:
        return prompt_ids(args.ids, model.config.vocab_size), None, None
    if tok is not None:
        return (tok.encode(args.prompt) if args.prompt else [tok.eot or 0]), None, None
    if args.prompt:
        raise ValueError(f"{args.model} keeps no vocabulary to encode --prompt with: pass "
                         "--ids")
    return [0], None, None


def chat_ids(args, tok) -> tuple[list, int | None]:
    """(the ids of --chat's conversation rendered with the generation prompt, the template's
    end-of-turn id) — as transformers' apply_chat_template(add_generation_prompt=True)."""
    from .data.chat import Template
    folder = args.template or args.model
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise ValueError(f"--chat needs a model folder with a chat template: {folder} has no "
                         "tokenizer.json (pass --template FOLDER, the folder the run started "
                         "from)")
    template = Template(folder)
    msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.chat}]
    text, _ = template.render(msgs, add_generation_prompt=True)
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    if tok is not None and tok.kind == "tokenizer" and \
            tok.hf.get_vocab_size() != hf.get_vocab_size():
        raise ValueError(f"--template {folder}'s tokenizer has {hf.get_vocab_size():,} tokens, "
                         f"the model's {tok.hf.get_vocab_size():,}: another tokenizer")
    eos = template.tokens.get("eos_token")
    return hf.encode(text, add_special_tokens=False).ids, \
        (hf.token_to_id(eos) if eos else None)


def prompt_ids(text: str, vocab_size: int) -> list:
    """--ids: comma-separated token ids, each one of the model's (ValueError in one line)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--ids takes comma-separated token ids (e.g. 3,1,4), got {text!r}") \
            from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--ids {bad[0]} is not a token id of this model: it has "
                         f"{vocab_size:,} (0 to {vocab_size - 1:,})")
    return ids


def build(args):
    """(model, vocabulary, this rank) for the command line: the whole model, or its
    tensor-parallel shards over every rank of the job (``--tp``)."""
    if args.tp == 1:
        backend.init(args.device)
        model, v = load(args.model, args.adapter)
        return model, v, 0
    from .checkpoint import adapters
    from .comm import Communicator
    from .nn import lora
    from .parallel.tp import apply_tensor_parallel
    comm = Communicator()
    if comm.size != args.tp:
        raise ValueError(f"--tp {args.tp} runs on {args.tp} ranks: mpirun -n {args.tp} "
                         f"(this job has {comm.size})")
    backend.init(args.device, comm.local_rank)
    model, v = load(args.model, args.adapter)
    if lora.adapters(model):                          # merged first: then cut as any model
        merged = nn.family(model.config.arch).model(model.config)
        merged.load_state_dict(adapters.merged(model))
        model = merged
    return apply_tensor_parallel(model, comm).eval(), v, comm.rank


if __name__ == "__main__":
    sys.exit(main())
