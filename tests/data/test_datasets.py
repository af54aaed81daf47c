"""Dataset builders, splits and the epoch iterator, on tiny in-memory data (no sources needed)."""

from __future__ import annotations

import gzip
import struct
import sys
import types

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from aqsgd.data import datasets as D
from aqsgd.data import document_separator
from aqsgd.data.datasets import (
    DictDataset,
    epoch_batches,
    epoch_order,
    image_classification,
    lm_chunks,
    load_task,
    num_batches,
    stratified_split,
    text_classification,
)
from aqsgd.errors import DataSourceError, SpecError

from .conftest import WORDS

EOS, PAD, CLS, SEP = 2, 0, 3, 4


def ids(text: str) -> list[int]:
    return [WORDS.index(w) + 5 for w in text.split()]


# ---------------------------------------------------------------------------------------- lm_chunks


def test_lm_chunks_concatenates_with_eos_and_cuts(word_tokenizer):
    texts = ["a b c", "d e", "", "   ", "f g h i"]
    ds = lm_chunks(texts, word_tokenizer, 3)
    stream = ids("a b c") + [EOS] + ids("d e") + [EOS] + ids("f g h i") + [EOS]  # 12 tokens
    assert len(ds) == 4
    assert ds.columns["input_ids"].flatten().tolist() == stream
    for i in range(len(ds)):
        item = ds[i]
        assert item["sample_id"] == i
        assert item["input_ids"].shape == (3,) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["labels"], item["input_ids"])
        assert torch.equal(item["attention_mask"], torch.ones(3, dtype=torch.int64))
    assert ds.info["kind"] == "causal-lm" and ds.info["eos_token_id"] == EOS


def test_lm_chunks_drops_the_tail_and_honours_options(word_tokenizer):
    ds = lm_chunks(["a b c d e"], word_tokenizer, 4, add_eos=False)
    assert len(ds) == 1 and ds[0]["input_ids"].tolist() == ids("a b c d")
    ds = lm_chunks(["a b", "c"], word_tokenizer, 2, eos_token_id=99)
    assert ds.columns["input_ids"].flatten().tolist() == ids("a b") + [99, *ids("c")]
    with pytest.raises(SpecError, match="fewer than one chunk"):
        lm_chunks(["a"], word_tokenizer, 8)
    with pytest.raises(SpecError):
        lm_chunks(["a"], word_tokenizer, 0)


def test_lm_chunks_max_chunks_is_a_prefix_of_the_full_dataset(word_tokenizer):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 9))) for _ in range(50)]
    full = lm_chunks(texts, word_tokenizer, 5)
    for k in (0, 1, 3, 7):
        part = lm_chunks(texts, word_tokenizer, 5, max_chunks=k, batch_texts=2)
        assert len(part) == k
        assert torch.equal(part.columns["input_ids"], full.columns["input_ids"][:k])
    assert torch.equal(full.subset(3).columns["input_ids"], full.columns["input_ids"][:3])


def test_lm_chunks_separates_documents_as_the_cli_does(word_tokenizer, caplog):
    """``<|endoftext|>`` first, then EOS, then SEP (document_separator, which ``--train-file`` uses too); a
    tokenizer with none of them joins the documents with a warning instead of refusing them."""

    class Tok:
        def __init__(self, vocab, eos=None, sep=None):
            self.vocab, self.eos_token_id, self.sep_token_id = vocab, eos, sep

        def get_vocab(self):
            return self.vocab

        def __call__(self, batch, **kw):
            return {"input_ids": [[1, 2, 3] for _ in batch]}

    assert document_separator(Tok({"<|endoftext|>": 7}, eos=8, sep=9)) == 7
    assert document_separator(Tok({}, eos=8, sep=9)) == 8
    assert document_separator(Tok({}, sep=9)) == 9
    assert document_separator(Tok({})) is None
    assert lm_chunks(["x", "y"], Tok({}, sep=9), 4).columns["input_ids"].tolist() == [[1, 2, 3, 9],
                                                                                   [1, 2, 3, 9]]
    with caplog.at_level("WARNING"):
        assert len(lm_chunks(["x", "y"], Tok({}), 2)) == 3
    assert "no end-of-text, EOS or SEP token: texts are joined without a separator" in caplog.text
    assert len(lm_chunks(["x", "y"], Tok({}), 2, add_eos=False)) == 3


# ------------------------------------------------------------------------------ text classification


def test_text_classification_pads_and_truncates(word_tokenizer):
    ds = text_classification(["a b", "a b c d e f g h i j k"], [1, 0], word_tokenizer, 6,
                             label_names=["neg", "pos"])
    assert ds.columns["input_ids"].shape == (2, 6)
    assert ds[0]["input_ids"].tolist() == [CLS, *ids("a b"), SEP, PAD, PAD]
    assert ds[0]["attention_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert ds[1]["input_ids"].tolist() == [CLS, *ids("a b c d"), SEP]
    assert ds[1]["attention_mask"].tolist() == [1] * 6
    assert ds[1]["labels"].item() == 0 and ds[1]["sample_id"] == 1
    assert ds.info["num_labels"] == 2 and ds.info["label_names"] == ["neg", "pos"]
    assert ds.info["pad_token_id"] == PAD


def test_text_classification_pairs_have_token_types(word_tokenizer):
    ds = text_classification(["a b"], [0], word_tokenizer, 8, text_pairs=["c"])
    assert ds[0]["input_ids"].tolist() == [CLS, *ids("a b"), SEP, *ids("c"), SEP, PAD, PAD]
    assert ds[0]["token_type_ids"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]


def test_text_classification_rejects_bad_input(word_tokenizer):
    with pytest.raises(SpecError):
        text_classification(["a"], [0, 1], word_tokenizer, 4)
    with pytest.raises(SpecError):
        text_classification(["a"], [0], word_tokenizer, 0)

    class NoPad:
        pad_token_id = None

    with pytest.raises(SpecError, match="pad token"):
        text_classification(["a"], [0], NoPad(), 4)


# ---------------------------------------------------------------------------------------- images


def test_image_classification_normalises_on_access():
    x = torch.tensor([[[0, 255], [51, 102]]], dtype=torch.uint8).repeat(3, 1, 1)  # [3, 2, 2]
    ds = image_classification(x, [7, 8, 9], mean=0.5, std=0.25)
    item = ds[1]
    assert item["pixel_values"].shape == (1, 2, 2) and item["pixel_values"].dtype == torch.float32
    expect = (torch.tensor([[0, 255], [51, 102]]) / 255.0 - 0.5) / 0.25
    assert torch.allclose(item["pixel_values"][0], expect)
    assert item["labels"].item() == 8 and item["sample_id"] == 1
    batch = ds.gather([2, 0])
    assert batch["pixel_values"].shape == (2, 1, 2, 2)
    assert torch.equal(batch["pixel_values"][0], ds[2]["pixel_values"])
    assert batch["sample_ids"].tolist() == [2, 0]
    assert ds.columns["pixel_values"].dtype == torch.uint8  # stored compactly


def test_image_classification_per_channel_and_errors():
    x = np.zeros((2, 3, 4, 4), dtype=np.uint8)
    ds = image_classification(x, np.array([0, 1]), mean=(0.1, 0.2, 0.3), std=(1.0, 2.0, 4.0))
    assert torch.allclose(ds[0]["pixel_values"][:, 0, 0], torch.tensor([-0.1, -0.1, -0.075]))
    with pytest.raises(SpecError):
        image_classification(x.astype(np.float32), [0, 1], mean=0, std=1)
    with pytest.raises(SpecError):
        image_classification(x, [0, 1], mean=(0.1, 0.2), std=1)


def test_read_idx_roundtrip(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBB3I", 0, 8, 3, 2, 3, 4) + arr.tobytes())
    out = D.read_idx(path)
    assert np.array_equal(out, arr) and out.flags.writeable


# ---------------------------------------------------------------------------------------- DictDataset


def test_dict_dataset_checks_and_subset():
    with pytest.raises(SpecError):
        DictDataset({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(SpecError):
        DictDataset({"sample_id": torch.zeros(3)})
    ds = DictDataset({"a": torch.arange(5)}, info={"k": 1})
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.gather([0, 5])
    sub = ds.subset(3)
    assert len(sub) == 3 and [sub[i]["sample_id"] for i in range(3)] == [0, 1, 2]
    assert sub.info == {"k": 1} and len(ds.subset(99)) == 5


# ------------------------------------------------------------------------------------ splits, batches


def test_stratified_split_is_deterministic_disjoint_and_stratified():
    labels = np.repeat(np.arange(3), [50, 30, 20])
    tr, ev = stratified_split(labels, 0.2, seed=7)
    tr2, ev2 = stratified_split(labels, 0.2, seed=7)
    assert np.array_equal(tr, tr2) and np.array_equal(ev, ev2)
    assert sorted(np.concatenate([tr, ev]).tolist()) == list(range(100))
    assert np.bincount(labels[ev]).tolist() == [10, 6, 4]
    tr3, _ = stratified_split(labels, 0.2, seed=8)
    assert not np.array_equal(tr, tr3)
    assert not np.array_equal(np.sort(tr), tr), "the split order is shuffled, not class-sorted"


def test_epoch_order_depends_only_on_seed_and_epoch():
    a = epoch_order(100, seed=3, epoch=1)
    assert torch.equal(a, epoch_order(100, seed=3, epoch=1))
    assert not torch.equal(a, epoch_order(100, seed=3, epoch=2))
    assert not torch.equal(a, epoch_order(100, seed=4, epoch=1))
    assert sorted(a.tolist()) == list(range(100)) and a.dtype == torch.int64
    assert epoch_order(5, seed=0, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    # pinned: numpy's PCG64 stream is the same on every platform and version
    assert epoch_order(8, seed=0, epoch=0).tolist() == D._rng(0, 0).permutation(8).tolist()
    with pytest.raises(SpecError):
        epoch_order(3, seed=-1, epoch=0)


def test_epoch_batches_keep_the_partial_last_batch():
    ds = DictDataset({"x": torch.arange(10) * 10})
    batches = list(epoch_batches(ds, 4, seed=0, epoch=0))
    assert [len(b["sample_ids"]) for b in batches] == [4, 4, 2] == [4, 4, 2][: num_batches(10, 4)]
    ids_ = torch.cat([b["sample_ids"] for b in batches])
    assert sorted(ids_.tolist()) == list(range(10)) and ids_.dtype == torch.int64
    for b in batches:
        assert torch.equal(b["x"], b["sample_ids"] * 10)
    dropped = list(epoch_batches(ds, 4, seed=0, epoch=0, drop_last=True))
    assert [len(b["sample_ids"]) for b in dropped] == [4, 4] and num_batches(10, 4, drop_last=True) == 2
    assert torch.equal(torch.cat([b["sample_ids"] for b in dropped]), ids_[:8])
    again = list(epoch_batches(ds, 4, seed=0, epoch=0))
    assert all(torch.equal(a["sample_ids"], b["sample_ids"]) for a, b in zip(batches, again))
    ordered = list(epoch_batches(ds, 3, seed=0, epoch=0, shuffle=False))
    assert [b["sample_ids"].tolist() for b in ordered] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    with pytest.raises(SpecError):
        list(epoch_batches(ds, 0, seed=0, epoch=0))


def test_epoch_batches_generic_dataset_matches_dict_dataset(word_tokenizer):
    ds = text_classification([" ".join(WORDS[: i + 1]) for i in range(7)], list(range(7)), word_tokenizer, 5)

    class Plain(Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            return ds[i]

    for a, b in zip(epoch_batches(ds, 3, seed=1, epoch=2), epoch_batches(Plain(), 3, seed=1, epoch=2),
                    strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert a["labels"].tolist() == a["sample_ids"].tolist()


# ------------------------------------------------------------------------------------------- tasks


HUB_TASKS = {"wikitext-2": "wiki", "glue-cola": "bbc", "glue-qnli": "bbc", "cifar10": "fashion-mnist"}


def test_task_registry():
    assert set(D.task_names(offline_only=True)) == {"bbc", "wiki", "instruct", "fashion-mnist", "mnist"}
    assert set(D.task_names()) == {"bbc", "wiki", "instruct", "fashion-mnist", "mnist", *HUB_TASKS}
    with pytest.raises(SpecError, match="unknown task"):
        load_task("imagenet")
    with pytest.raises(SpecError, match="unknown split"):
        load_task("bbc", "dev")


@pytest.mark.parametrize("task", sorted(HUB_TASKS))
def test_hub_tasks_offline_name_the_alternative(task, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataSourceError) as e:
        load_task(task, cache_dir=tmp_path)
    assert f"load_task({HUB_TASKS[task]!r})" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_hub_task_without_datasets_package(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataSourceError, match="pip install datasets"):
        load_task("glue-cola", cache_dir=tmp_path)


def test_hub_task_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, **k: pytest.fail("must not reach it")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setattr("aqsgd.data.datasets.hub.HUB_PROBE_TIMEOUT_S", 2.0)
    with pytest.raises(DataSourceError, match="unreachable.*load_task\\('fashion-mnist'\\)"):
        load_task("cifar10", cache_dir=tmp_path)
