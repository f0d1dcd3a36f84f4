"""Instruction data against transformers: a chat template rendered and tokenized as
``apply_chat_template`` does, the answers-only mask as its ``return_assistant_tokens_mask``,
stored in document shards whose rows train the answers alone; bad records one line."""
import json

import numpy as np
import pytest

from hpcdist import data
from hpcdist.data import chat, documents, shards

QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]"
        "['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a "
        "helpful assistant.<|im_end|>\\n' }}{%- endif %}\n{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}{%- elif message.role == "
        "'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content "
        "+ '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}{{- '<|im_start|>' + "
        "message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}\n")
LLAMA = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + "
         "message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message['role'] == "
         "'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
         "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}"
         "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>"
         "assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
FAMILIES = {"qwen": (QWEN, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                     ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
            "llama": (LLAMA, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                      ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"])}
CHATS = [
    [{"role": "user", "content": "what sat on the mat?"},
     {"role": "assistant", "content": "the cat sat on the mat."}],
    [{"role": "system", "content": "answer in few words."},
     {"role": "user", "content": "where is the dog?"},
     {"role": "assistant", "content": "by the river"},
     {"role": "user", "content": "and the owl?"},
     {"role": "assistant", "content": "  on the wall, high up  "}],
    [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}],
]
CORPUS = "\n".join(m["content"] for c in CHATS for m in c) * 30


def folder(tmp_path, family: str, tagged: bool = True):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    template, tokens, special = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=320, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if not tagged:
        template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    fast.chat_template = template
    out = tmp_path / f"{family}{'' if tagged else '-plain'}"
    fast.save_pretrained(out)
    return out, fast


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_ids_and_answer_mask_equal_transformers(tmp_path, family):
    tagged, fast = folder(tmp_path, family)
    plain, _ = folder(tmp_path, family, tagged=False)
    ours, by_prefix = chat.Encoder(str(tagged)), chat.Encoder(str(plain))
    for i, msgs in enumerate(CHATS):
        theirs = fast.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ids, mask = ours.encode({"messages": msgs}, f"chats:{i}")
        assert list(ids) == list(theirs["input_ids"]), (family, i)
        assert list(mask) == list(theirs["assistant_masks"]), (family, i)
        ids2, mask2 = by_prefix.encode({"messages": msgs}, f"chats:{i}")
        assert list(ids2) == list(ids) and list(mask2) == list(mask), (family, i)
        trained = fast.decode([t for t, m in zip(ids, mask) if m])
        assert trained.count(FAMILIES[family][1]["eos_token"]) == \
            sum(m["role"] == "assistant" for m in msgs)       # each answer's end-of-turn
        assert "assistant" not in trained and "user" not in trained   # no role header


def test_prompt_completion_trains_the_completion_and_text_every_token(tmp_path):
    path, fast = folder(tmp_path, "qwen")
    enc = chat.Encoder(str(path))
    ids, mask = enc.encode({"prompt": "where is the dog? ", "completion": "by the river"}, "x")
    prompt = fast("where is the dog? ")["input_ids"]
    assert list(ids[:len(prompt)]) == prompt and not mask[:len(prompt)].any()
    assert fast.decode(ids[mask == 1]) == "by the river<|im_end|>"
    ids, mask = enc.encode({"text": "the cat sat"}, "x")
    assert mask.all() and fast.decode(ids) == "the cat sat<|im_end|>"
    ids, mask = chat.Encoder(str(path), train_on="all").encode({"messages": CHATS[0]}, "x")
    assert mask.all()


def test_prepare_writes_document_shards_whose_rows_train_the_answers(tmp_path):
    path, fast = folder(tmp_path, "llama")
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps({"messages": m})
                                                    for m in CHATS * 4) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({"messages": CHATS[1]}) + "\n")
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp_path / "chats.jsonl"), "--tokenizer", str(path), "--val",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "tok")]) == 0
    train, held = data.make_task("text", data=str(tmp_path / "tok"), block_size=64,
                                 packing="off")
    assert isinstance(train, documents.Documents) and len(train) == 12 and len(held) == 1
    enc = chat.Encoder(str(path))
    for i in range(len(train)):
        ids, mask = enc.encode({"messages": CHATS[i % 3]}, "x")
        x, y = train.batch([i])
        ids, mask = ids[:65], mask[:65]                      # block_size + 1: truncated
        n = len(ids) - 1
        assert list(x[0, :n]) == list(ids[:-1])
        want = np.where(mask[1:] == 1, ids[1:], data.IGNORE)
        assert list(y[0, :n]) == list(want) and (y[0, n:] == data.IGNORE).all()
    x, y = train.batch([1])
    paths = shards.shard_paths(str(tmp_path / "tok"))[0]
    short = documents.Documents(paths, 8, train.vocab_size, train.vocabulary, split="held-out")
    assert train.truncated == 4 and short.truncated == 12 and np.array_equal(short.batch([1])[0], x[:, :8])
    with pytest.raises(ValueError, match="--block-size 8: none of the first 12 documents"):
        documents.Documents(paths, 8, train.vocab_size, train.vocabulary)   # trains nothing


@pytest.mark.parametrize("line, says", [
    ('{"messages": [{"role": "user", "content": "hi"}', "chats.jsonl:2: not a JSON record"),
    ('{"prompt": "hi"}', "chats.jsonl:2: field 'completion' is missing"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}',
     "chats.jsonl:2: messages[0] has the unknown role 'wizard'"),
    ('{"question": "hi"}', "chats.jsonl:2: no field 'messages'"),
])
def test_a_bad_record_is_one_line_naming_the_file_line_and_field(tmp_path, capsys, line, says):
    path, _ = folder(tmp_path, "qwen")
    good = json.dumps({"messages": CHATS[0]})
    (tmp_path / "chats.jsonl").write_text(good + "\n" + line + "\n")
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp_path / "chats.jsonl"), "--tokenizer", str(path),
                 "--out", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "tok").exists()


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    """A tiny random Qwen2 saved by transformers with the Qwen-style chat template."""
    torch = pytest.importorskip("torch")
    import transformers
    tmp = tmp_path_factory.mktemp("qwen")
    path, fast = folder(tmp, "qwen")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, head_dim=8, eos_token_id=fast.eos_token_id)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float64)
    model.save_pretrained(path)
    return path, fast, model


def test_a_row_s_loss_is_transformers_answers_only_loss(qwen_model, tmp_path):
    import torch
    path, fast, theirs = qwen_model
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in CHATS))
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp_path / "c.jsonl"), "--tokenizer", str(path), "--val",
                 str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "tok")]) == 0
    train, _ = data.make_task("text", data=str(tmp_path / "tok"), block_size=100,
                              packing="off")
    from hpcdist.checkpoint import hf
    from hpcdist.device import backend
    backend.set_default_float("float64")
    try:
        ours, _ = hf.load(str(path))
        x, y = train.batch([0, 1])                        # two rows, unequal answers
        _, loss = ours(x, y)
    finally:
        backend.set_default_float("float32")
    with torch.no_grad():
        logits = theirs(torch.tensor(x)).logits.double()   # (the padding after a row: unseen)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            torch.tensor(y).reshape(-1), ignore_index=-100)
    assert float(loss.data) == pytest.approx(float(ref), rel=1e-10)
    # and the mean is over the trained tokens of both rows, not a mean of the rows' means
    per_row = [float(torch.nn.functional.cross_entropy(logits[i], torch.tensor(y[i]),
                                                       ignore_index=-100)) for i in range(2)]
    assert abs(float(ref) - np.mean(per_row)) > 1e-6


def test_sample_chat_equals_transformers_generate(qwen_model):
    import torch
    from types import SimpleNamespace
    from hpcdist import sample
    path, fast, theirs = qwen_model
    args = SimpleNamespace(template="", model=str(path), system="be brief",
                           chat="where is the dog?")
    ids, stop = sample.chat_ids(args, None)
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "where is the dog?"}]
    want = fast.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                    return_dict=True)["input_ids"]
    assert ids == list(want) and stop == fast.convert_tokens_to_ids("<|im_end|>")
    from hpcdist.checkpoint import hf
    model, _ = hf.load(str(path))
    model.eval()
    out = sample.generate(model, ids, 12, stop=stop)
    gen = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                          eos_token_id=stop, pad_token_id=stop)
    assert out == gen[0].tolist()[:len(out)] and len(out) == gen.shape[1]


def test_evaluate_prints_the_answers_loss_per_token_at_any_rank_count(qwen_model, tmp_path):
    import os
    import re
    import subprocess
    import sys
    import torch
    path, fast, theirs = qwen_model
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in CHATS * 2))
    from hpcdist.data.__main__ import main
    assert main(["prepare", str(tmp_path / "c.jsonl"), "--tokenizer", str(path), "--val",
                 str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "tok")]) == 0
    enc = chat.Encoder(str(path))
    total = count = 0.0
    for m in CHATS * 2:                                   # transformers, one by one
        ids, mask = enc.encode({"messages": m}, "x")
        with torch.no_grad():
            logits = theirs(torch.tensor(ids[None, :-1])).logits[0].double()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]),
                                                reduction="none").numpy()
        total += float((nll * mask[1:]).sum())
        count += int(mask[1:].sum())
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    for n, packing in ((1, "bfd"), (2, "bfd"), (2, "off")):
        r = subprocess.run([mpiexec, "-n", str(n), sys.executable, "-m", "hpcdist.evaluate",
                            str(path), "--data", str(tmp_path / "tok"), "--dtype", "fp64",
                            "--block-size", "100", "--batch-size", "2", "--packing", packing],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        m = re.search(r"loss ([0-9.]+) per scored token \(([0-9,]+) tokens\)", r.stdout)
        assert m and int(m.group(2).replace(",", "")) == count, r.stdout
        assert float(m.group(1)) == pytest.approx(total / count, abs=1e-4)


def test_parquet_records_give_the_same_shards_as_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path, _ = folder(tmp_path, "qwen")
    rows = [{"messages": m} for m in CHATS] * 3
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    from hpcdist.data.__main__ import main
    for name in ("c.jsonl", "c.parquet"):
        assert main(["prepare", str(tmp_path / name), "--tokenizer", str(path),
                     "--val-fraction", "0.2", "--out", str(tmp_path / name[2:])]) == 0
    for f in ("train_000000.bin", "train_000000.mask.npy", "val_000000.docs.npy"):
        assert (tmp_path / "jsonl" / f).read_bytes() == (tmp_path / "parquet" / f).read_bytes()
