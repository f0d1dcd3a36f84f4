"""Packed rows (nn/packing.py, data/documents.py PackedDocuments): the loss of a packed row
is the sum of its documents' losses computed one by one, and so are the gradients, in fp64
to 1e-12, for learned positions (GPT-2), rotary (Llama), per-head q/k norms (Qwen3) and
GQA; best-fit decreasing packs as tightly as it says."""
import numpy as np
import pytest

from hpcdist import nn
from hpcdist.data import documents
from hpcdist.device import backend
from hpcdist.nn import packing

VOCAB, T = 48, 40


@pytest.fixture
def fp64():
    backend.set_default_float("float64")
    yield
    backend.set_default_float("float32")


def _folder(tmp_path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for prefix, n in (("train", sizes), ("val", [5])):
        w = documents.DocumentWriter(str(tmp_path), prefix, 10 ** 6, 0, VOCAB)
        for size in n:
            ids, mask = rng.integers(0, VOCAB, size), rng.random(size) < 0.6
            w.add(ids, mask)
            if prefix == "train":
                docs.append((ids, mask))
        w.flush()
    return [str(tmp_path / "train_000000.bin")], docs


MODELS = {
    "gpt": dict(arch="gpt", n_layer=2, n_head=2, n_embd=16),
    "llama-gqa": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16),
    "qwen3": dict(arch="qwen3", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=8),
}


def _sum_loss(model, x, y):
    _, loss = model(x, y)
    n = int((y != -100).sum())
    return loss * float(n), n


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_row_s_loss_and_gradients_are_its_documents_one_by_one(fp64, tmp_path, name):
    paths, docs = _folder(tmp_path, [3, 17, 9, 25, 2, 12, 40, 41, 60, 7, 30, 5, 11])
    rows = documents.PackedDocuments(paths, T, VOCAB, {"kind": "tokens", "size": VOCAB})
    nn.manual_seed(3)
    kw = dict(MODELS[name])
    model = nn.build(kw.pop("arch"), block_size=T, vocab_size=VOCAB, **kw)
    params = dict(model.named_parameters())
    model.packed = True
    x, y = rows.batch(np.arange(len(rows)))
    assert (x >> packing.SHIFT).any()                       # several documents a row
    loss, n = _sum_loss(model, x, y)
    loss.backward()
    packed = {k: p.grad.copy() for k, p in params.items()}
    model.packed = False
    for p in params.values():
        p.grad = None
    total, count = 0.0, 0
    for ids, mask in docs:                                   # each document alone
        ids, mask = ids[:T + 1], mask[:T + 1]
        if len(ids) < 2:
            continue
        yy = np.where(mask[1:], ids[1:], -100)[None]
        if not (yy != -100).any():
            continue
        part, k = _sum_loss(model, ids[None, :-1], yy)
        part.backward()
        total, count = total + float(part.data), count + k
    assert n == count
    assert float(loss.data) == pytest.approx(total, rel=1e-12)
    for k, p in params.items():
        np.testing.assert_allclose(packed[k], p.grad, rtol=1e-10, atol=1e-13, err_msg=k)


def test_best_fit_decreasing_fills_rows_and_counts_what_it_saves(tmp_path):
    sizes = [41, 30, 11, 21, 10, 20, 5, 36, 4, 3, 2, 1]      # positions: n - 1 (at most T)
    paths, _ = _folder(tmp_path, sizes)
    rows = documents.PackedDocuments(paths, T, VOCAB, {"kind": "tokens", "size": VOCAB})
    used = [min(s, T + 1) - 1 for s in sizes]
    assert rows.positions_used == sum(used)
    fill = [sum(used[d] for d in r) for r in rows.rows]
    assert max(fill) <= T and sorted(d for r in rows.rows for d in r) == \
        [d for d, u in enumerate(used) if u > 0]
    assert len(rows) == -(-sum(used) // T)                   # as few rows as the tokens need
    assert rows.padding < rows.unpacked_padding
    x, y = rows.batch([0])
    starts = x >> packing.SHIFT
    assert (packing.tokens_of(x) < VOCAB).all() and (starts[0] <= np.arange(T)).all()
