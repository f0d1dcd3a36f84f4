"""Chat and instruction data: records in, token ids and a loss mask out.

``records(path)``: JSON Lines or Parquet, each record named by file and line (or row). A
record is conversational (``messages``: role/content turns), prompt-completion (``prompt``,
``completion``) or plain ``text``. ``Template(folder)`` renders turns as transformers'
``apply_chat_template`` does (the folder's chat template through jinja2's sandbox, with the
names a template expects); the text is encoded without added special tokens. The mask trains
each assistant turn's content and its end-of-turn token, never its header: the template's
``{% generation %}`` blocks where it has them, else each turn found by rendering the prefixes.
A completion trains alone, a text every token. ``Encoder.encode(record, where)`` gives (ids,
mask); a record it cannot use is a ValueError naming ``where`` and the field.
"""
from __future__ import annotations

import json
import os

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "developer")
OPEN, CLOSE = "\ue000", "\ue001"       # (private-use marks around a generation block's text)


def records(path: str):
    """(where, record) of a JSON Lines or Parquet file, ``where`` as "FILE:LINE"."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install "
                             "'hpcdist[sft]')") from None
        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}:row {i + 1}", row
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: a record is a JSON object, got "
                                 f"{type(rec).__name__}")
            yield f"{path}:{n}", rec


def is_chat_file(path: str) -> bool:
    return path.endswith((".jsonl", ".parquet"))


def kind_of(rec: dict, where: str) -> str:
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of turns")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{where}: messages[{i}] needs 'role' and 'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"{where}: messages[{i}] has the unknown role "
                                 f"{m['role']!r} (known: {', '.join(ROLES)})")
            if not isinstance(m["content"], str):
                raise ValueError(f"{where}: messages[{i}].content must be a string")
        return "messages"
    if "prompt" in rec or "completion" in rec:
        for field in ("prompt", "completion"):
            if not isinstance(rec.get(field), str):
                raise ValueError(f"{where}: field {field!r} is missing or not a string "
                                 "(a prompt-completion record has both)")
        return "prompt"
    if isinstance(rec.get("text"), str):
        return "text"
    raise ValueError(f"{where}: no field 'messages', 'prompt'/'completion' or 'text' (it has "
                     f"{', '.join(sorted(rec)) or 'none'})")


def _token_text(value) -> str | None:
    if isinstance(value, dict):                  # {"content": "<s>", ...} (older configs)
        value = value.get("content")
    return value if isinstance(value, str) else None


class Template:
    """A folder's chat template, rendered as transformers renders it (see the module doc)."""

    def __init__(self, folder: str):
        config = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):             # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default") or next(iter(named.values()), None)
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        if not source:
            raise ValueError(f"{folder}: no chat template (tokenizer_config.json's "
                             "chat_template, or chat_template.jinja); conversational "
                             "records need one")
        self.source = source
        self.tokens = {k: _token_text(config.get(k)) for k in
                       ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.marks_generation = "generation" in source and "endgeneration" in source
        self.template = _environment().from_string(source)

    def render(self, messages, add_generation_prompt: bool = False) -> tuple[str, list]:
        """(text, [(start, end)] of its generation blocks' characters)."""
        raw = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{k: v for k, v in self.tokens.items() if v is not None})
        spans, text, at = [], [], 0
        for piece in raw.split(OPEN):
            if not text:                          # before the first mark
                text.append(piece)
                at = len(piece)
                continue
            inside, _, after = piece.partition(CLOSE)
            spans.append((at, at + len(inside)))
            text += [inside, after]
            at += len(inside) + len(after)
        return "".join(text), spans


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the block's text between two marks
        (``Template.render`` takes them out and keeps where they were)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN + caller() + CLOSE

    def raise_exception(message):
        raise ValueError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


class Encoder:
    """Records -> (ids, mask) with a model folder's tokenizer and template (module doc)."""

    def __init__(self, folder: str, train_on: str = "answers"):
        from tokenizers import Tokenizer
        if train_on not in ("answers", "all"):
            raise ValueError(f"--train-on {train_on!r}: choose answers or all")
        self.folder, self.train_on = folder, train_on
        self.tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        try:
            self.template = Template(folder)
        except ValueError as e:
            self.template, self.missing = None, str(e)
        config = self.template.tokens if self.template else {}
        self.eos = config.get("eos_token")

    def _ids(self, text: str, special: bool = False):
        enc = self.tok.encode(text, add_special_tokens=special)
        return np.asarray(enc.ids, dtype=np.int64), enc.offsets

    def encode(self, rec: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        kind = kind_of(rec, where)
        if kind == "text":
            ids, _ = self._ids(rec["text"] + (self.eos or ""), special=True)
            return ids, np.ones(ids.size, dtype=np.uint8)
        if kind == "prompt":
            prompt, _ = self._ids(rec["prompt"], special=True)
            ids, _ = self._ids(rec["prompt"] + rec["completion"] + (self.eos or ""),
                               special=True)
            if not np.array_equal(ids[:prompt.size], prompt):
                raise ValueError(f"{where}: the prompt's tokens change when the completion "
                                 "follows (a token spans both); end the prompt with a space "
                                 "or newline")
            mask = np.zeros(ids.size, dtype=np.uint8)
            mask[prompt.size:] = 1
            return ids, mask if self.train_on == "answers" else np.ones_like(mask)
        if self.template is None:
            raise ValueError(f"{where}: a conversational record, but {self.missing}")
        msgs = rec["messages"]
        text, spans = self.template.render(msgs)
        if not self.template.marks_generation:
            spans = self._turn_spans(msgs, text, where)
        ids, offsets = self._ids(text)
        mask = np.zeros(ids.size, dtype=np.uint8)
        if self.train_on == "all":
            mask[:] = 1
        else:
            for i, (a, b) in enumerate(offsets):       # a token touching a span is trained
                mask[i] = any(a < e and s < b for s, e in spans)
        if self.train_on == "answers" and not mask.any() and any(
                m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: the template rendered no assistant text to train on")
        return ids, mask

    def _turn_spans(self, msgs, text: str, where: str) -> list:
        """The assistant turns' characters, by rendering the prefixes (module doc)."""
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, _ = self.template.render(msgs[:i], add_generation_prompt=True)
            through, _ = self.template.render(msgs[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ValueError(f"{where}: the chat template renders earlier turns "
                                 f"differently once messages[{i}] follows, so the answer's "
                                 "tokens cannot be found; use a template with {% generation "
                                 "%} blocks, or --train-on all")
            end = len(through.rstrip())
            spans.append((len(before), end))
        return spans
