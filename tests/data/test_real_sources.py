"""Loads from the real prepared sources. Each test skips unless its source is prepared in the cache
(``$AQSGD_CACHE`` or ``~/.cache/aqsgd``): run ``aqsgd data prepare NAME`` once to enable it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aqsgd.data import epoch_batches, load_task, locate, stratified_split
from aqsgd.data.datasets import read_bbc, read_wiki


def need(*names: str) -> None:
    for name in names:
        if locate(name) is None:
            pytest.skip(f"source {name!r} is not prepared; run `aqsgd data prepare {name}`")


def test_bbc_task():
    need("bbc", "minilm")
    texts, labels, classes = read_bbc(locate("bbc"))
    assert len(texts) == 2225 and classes == ["business", "entertainment", "politics", "sports", "tech"]
    tr, ev = stratified_split(labels, 0.2, seed=0)
    assert len(tr) + len(ev) == 2225 and abs(len(ev) - 445) <= 3 and not set(tr) & set(ev)
    ds = load_task("bbc", "train", max_samples=24, max_length=64)
    assert len(ds) == 24 and ds.columns["input_ids"].shape == (24, 64)
    assert set(ds.columns) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert ds.info["num_labels"] == 5 and ds.info["task"] == "bbc" and ds.info["vocab_size"] == 30522
    assert ds.columns["labels"].tolist() == [labels[i] for i in tr[:24]]
    again = load_task("bbc", "train", max_samples=24, max_length=64)
    assert torch.equal(ds.columns["input_ids"], again.columns["input_ids"])
    other = load_task("bbc", "eval", max_samples=8, max_length=64, seed=1)
    assert other.info["split"] == "eval" and len(other) == 8


def test_wiki_task_smollm2_tokenizer():
    need("wiki", "smollm2")
    articles = read_wiki(locate("wiki"))
    assert len(articles) > 10_000
    ds = load_task("wiki", "train", seq_len=64, max_samples=16)
    assert ds.columns["input_ids"].shape == (16, 64) and ds.info["vocab_size"] == 49152
    sep = ds.info["eos_token_id"]
    assert sep == 0  # <|endoftext|> separates documents
    flat = ds.columns["input_ids"].flatten().tolist()
    first = flat.index(sep)
    from aqsgd.data import load_tokenizer

    tok = load_tokenizer("smollm2")
    assert tok.decode(flat[:first]) == articles[0][: len(tok.decode(flat[:first]))]
    ev = load_task("wiki", "eval", seq_len=64, max_samples=4)
    assert not torch.equal(ev.columns["input_ids"], ds.columns["input_ids"][:4])


def test_wiki_task_gpt2_tokenizer():
    need("wiki", "gpt2-tokenizer")
    ds = load_task("wiki", "eval", seq_len=32, max_samples=4, tokenizer="gpt2-tokenizer")
    assert ds.columns["input_ids"].shape == (4, 32) and ds.info["vocab_size"] == 50257
    assert ds.info["eos_token_id"] == 50256


@pytest.mark.parametrize("task,mean", [("fashion-mnist", 0.2860), ("mnist", 0.1307)])
def test_image_tasks(task, mean):
    need(task)
    train, ev = load_task(task, "train"), load_task(task, "test")
    assert (len(train), len(ev)) == (60_000, 10_000)
    batch = next(epoch_batches(train, 2000, seed=0, epoch=0))
    x = batch["pixel_values"]
    assert x.shape == (2000, 1, 28, 28) and x.dtype == torch.float32
    assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1
    assert sorted(torch.unique(batch["labels"]).tolist()) == list(range(10))
    raw = train.columns["pixel_values"][:2000].float() / 255
    assert abs(raw.mean().item() - mean) < 0.02
    small = load_task(task, "eval", max_samples=5)
    assert len(small) == 5 and small[4]["sample_id"] == 4
    assert torch.equal(small.columns["labels"], ev.columns["labels"][:5])


def test_minilm_classifier_forward():
    need("minilm", "bbc")
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(locate("minilm")), num_labels=5)
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    ds = load_task("bbc", "eval", max_samples=2, max_length=32)
    batch = next(epoch_batches(ds, 2, seed=0, epoch=0))
    sample_ids = batch.pop("sample_ids")
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (2, 5) and torch.isfinite(out.loss) and sample_ids.tolist() in ([0, 1], [1, 0])


def test_smollm2_causal_lm():
    need("smollm2")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = str(locate("smollm2"))
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == \
        ("llama", 30, 576, 49152)
    assert getattr(config, "quantization_config", None) is None
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    ids = torch.cat([ids, ids], dim=1)[:, :8]
    assert ids.shape == (1, 8)
    with torch.no_grad():
        logits = model(ids[:, :5]).logits
        full = model(ids).logits
    assert full.shape == (1, 8, 49152) and torch.isfinite(full).all()
    assert tok.decode(logits[0, -1].argmax()).strip() == "Paris"  # the weights are really pretrained
    assert np.allclose(logits[0].numpy(), full[0, :5].numpy(), atol=1e-4)  # causal masking
