"""Tokenizing in bounded pieces: long documents in pieces cut where the tokenizer splits anyway, only the
beginning of a text of which only the first ``max_length`` tokens are kept, and compact LM datasets. The ids
are always those of the whole text tokenized in one call, which is how they were made before."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from aqsgd.data import locate
from aqsgd.data.datasets import lm_chunks, load_tokenizer, read_wiki, text_classification
from aqsgd.data.datasets import pieces as P

_WORDS = ("the of and a to in is was for on that by with as at from his he it an were are which this be or "
          "first also new had café naïve 2024 3.14 e-mail O'Brien 日本語 🙂 (note) [1] x=y").split()
_SEPS = (" ", "\n", "\n\n", "  ", ", ", ". ", ".\n", "\t", " \n", "\n    ")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")


def prose(n: int, seed: int) -> str:
    """``n`` characters of words, punctuation, numbers, newlines, blank lines, indents and runs of spaces."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n:
        word, sep = rng.choice(_WORDS), rng.choices(_SEPS, weights=(60, 6, 2, 2, 5, 5, 3, 1, 1, 2))[0]
        out.append(word + sep)
        size += len(word) + len(sep)
    return "".join(out)[:n]


def _trained(normalizer=None, pre_tokenizer=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([prose(30_000, s) for s in range(4)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenizers():
    """Byte-level BPE as GPT-2's (splits at spaces and newlines), as Llama 3's (punctuation keeps the
    newlines after it), and a SentencePiece-like BPE without pre-tokenizer that marks the start of every
    text (it splits nowhere: every check fails and texts stay whole)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    return {
        "gpt2": _trained(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "llama3": _trained(pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        "sentencepiece": _trained(normalizer=normalizers.Sequence([normalizers.Prepend("▁"),
                                                                   normalizers.Replace(" ", "▁")])),
    }


class Recorder:
    """A tokenizer that records how many characters each call was given."""

    def __init__(self, tok):
        self.__dict__.update(tok=tok, calls=[])

    def __call__(self, *args, **kw):
        texts = [t for a in args for t in (a if isinstance(a, list) else [a])]
        self.calls.append([len(t) for t in texts])
        return self.tok(*args, **kw)

    def __len__(self):
        return len(self.tok)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __setattr__(self, name, value):
        setattr(self.tok, name, value)


def one_call_stream(tok, docs, eos):
    """The LM token stream as made before: each document tokenized whole, then the separator."""
    out: list[int] = []
    for doc in docs:
        if doc.strip():
            out += tok(doc, add_special_tokens=False)["input_ids"] + [eos]
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama3", "sentencepiece"])
def test_pieces_join_to_the_tokens_of_the_whole_text(tokenizers, name):
    tok = tokenizers[name]
    text = prose(40_000, 7)
    parts = list(P.pieces(text, tok, size=500))
    assert "".join(parts) == text and all(parts)
    joined = [i for ids in P.encode(tok, parts) for i in ids]
    assert joined == P.encode(tok, [text])[0]
    if name == "sentencepiece":  # a marker at every text's start: no seam passes the check
        assert parts == [text]
    else:
        assert len(parts) > 80 and max(map(len, parts)) <= 500


def test_lm_chunks_of_long_documents_are_the_one_call_tokens(tokenizers, monkeypatch):
    monkeypatch.setattr(P, "PIECE_CHARS", 700)  # many pieces in every long document
    docs = [prose(n, seed) for seed, n in enumerate((50, 5_000, 30, 12_000, 0, 2_500, 900, 20_000))]
    for name, tok in tokenizers.items():
        eos = tok.eos_token_id
        ds = lm_chunks(docs, tok, 1, batch_texts=3)
        assert ds.columns["input_ids"].flatten().tolist() == one_call_stream(tok, docs, eos), name


def test_a_long_document_is_tokenized_in_bounded_calls(tokenizers):
    tok = Recorder(tokenizers["gpt2"])
    doc = prose(300_000, 3)
    ds = lm_chunks(["a short one", doc, "and another"], tok, 8)
    assert max(max(c) for c in tok.calls) <= P.PIECE_CHARS  # never the whole 300,000 characters
    assert max(sum(c) for c in tok.calls) <= P.BATCH_CHARS + P.PIECE_CHARS
    stream = one_call_stream(tokenizers["gpt2"], ["a short one", doc, "and another"], tok.eos_token_id)
    assert ds.columns["input_ids"].flatten().tolist() == stream[:len(stream) // 8 * 8]


def test_max_chunks_stops_inside_a_long_document(tokenizers):
    tok = Recorder(tokenizers["gpt2"])
    doc = prose(2_000_000, 4)
    part = lm_chunks([doc], tok, 8, max_chunks=3)
    assert sum(sum(c) for c in tok.calls) < 2 * P.BATCH_CHARS  # not the whole 2 MB
    whole = tokenizers["gpt2"](doc[:50_000], add_special_tokens=False)["input_ids"]
    assert part.columns["input_ids"].flatten().tolist() == whole[:24]


def test_lm_dataset_holds_its_ids_once(word_tokenizer):
    ds = lm_chunks(["a b c d e f g", "h i j"], word_tokenizer, 4)
    ids = ds.columns["input_ids"]
    assert ds.columns["labels"] is ids and ids.dtype == torch.int64
    mask = ds.columns["attention_mask"]
    assert mask.shape == ids.shape and mask.stride() == (0, 0) and mask.untyped_storage().nbytes() == 8
    for i in range(len(ds)):
        item = ds[i]
        assert item["attention_mask"].tolist() == [1] * 4 and item["labels"].equal(item["input_ids"])
    batch = ds.gather([1, 0])
    assert batch["attention_mask"].equal(torch.ones(2, 4, dtype=torch.int64))
    copy = pickle.loads(pickle.dumps(ds))  # as the stage processes of a distributed run receive it
    assert all(copy.columns[k].equal(v) for k, v in ds.columns.items())


def test_ids_are_kept_as_int32_where_the_vocabulary_fits():
    assert P.id_dtype(49_152, 0) is np.int32
    assert P.id_dtype(None, 2) is np.int64 and P.id_dtype(2**31, 0) is np.int64


# ------------------------------------------------------------------------------ classification


def test_classification_tokenizes_only_the_beginning_of_long_texts(tokenizers):
    raw = tokenizers["gpt2"]
    tok = Recorder(raw)
    texts = [prose(100_000, s) for s in range(3)] + ["short", prose(2_000, 9)]
    ds = text_classification(texts, [0, 1, 0, 1, 0], tok, 16)
    assert max(max(c) for c in tok.calls) <= 1024  # 16 * 16 characters at first, never the 100,000
    direct = raw(texts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    for k in ("input_ids", "attention_mask"):
        assert ds.columns[k].equal(direct[k]), k


@pytest.mark.parametrize("max_length", [9, 10])  # an odd and an even number of tokens for the two texts
def test_pairs_are_cut_only_as_far_as_the_truncation_allows(tokenizers, max_length):
    """Longest-first truncation takes from the longer text of a pair: each case of which one is long."""
    tok = tokenizers["gpt2"]
    long_a, long_b = prose(900, 1), prose(700, 2)
    cases = [
        (long_a, long_b),  # both long: the longer one's beginning must stay the longer
        (long_b, long_a),
        (long_a, long_a[::-1].replace("\n", " ")),  # both long, close in length
        (long_a, "a few words"),  # one long
        ("a few words", long_b),
        (long_a, "x" * 1_500),  # the other has no seam: whole, and longer than the long one's beginning
        ("x" * 1_500, long_b),
        ("short", "pair"),
        (long_a, long_a),  # exactly as long: both stay whole
    ]
    texts, pairs = [a for a, _ in cases], [b for _, b in cases]
    ds = text_classification(texts, [0] * len(cases), tok, max_length, text_pairs=pairs)
    direct = tok(texts, pairs, padding="max_length", truncation=True, max_length=max_length,
                 return_tensors="pt")
    for k in ("input_ids", "attention_mask"):
        assert ds.columns[k].equal(direct[k]), k


def test_pairs_and_words_with_a_word_tokenizer(word_tokenizer):
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    texts = [" ".join(rng.choice(letters) for _ in range(n)) for n in (150, 3, 220, 120, 180, 200)]
    pairs = [" ".join(rng.choice(letters) for _ in range(n)) for n in (180, 200, 2, 120, 180, 150)]
    for max_length in (7, 8):
        ds = text_classification(texts, [0] * 6, word_tokenizer, max_length, text_pairs=pairs)
        direct = word_tokenizer(texts, pairs, padding="max_length", truncation=True, max_length=max_length,
                                return_tensors="pt")
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            assert ds.columns[k].equal(direct[k]), (max_length, k)


def test_a_tokenizer_that_truncates_on_the_left_gets_whole_texts(tokenizers):
    import copy

    tok = copy.deepcopy(tokenizers["gpt2"])
    tok.truncation_side = "left"
    rec = Recorder(tok)
    texts = [prose(5_000, 1), "short"]
    ds = text_classification(texts, [0, 1], rec, 12)
    assert max(max(c) for c in rec.calls) == 5_000
    direct = tok(texts, padding="max_length", truncation=True, max_length=12, return_tensors="pt")
    assert ds.columns["input_ids"].equal(direct["input_ids"])


# ------------------------------------------------------------------------------ real tokenizers


@pytest.mark.parametrize("name", ["smollm2", "gpt2-tokenizer"])
def test_real_tokenizers_give_the_one_call_ids(name, monkeypatch):
    if locate(name) is None or locate("wiki") is None:
        pytest.skip(f"sources {name!r} and 'wiki' are not prepared; run `aqsgd data prepare {name} wiki`")
    tok = load_tokenizer(name)
    articles = read_wiki(locate("wiki"))
    doc = "\n".join(articles[:150]) + " " + " ".join(articles[150:300])  # over one piece: both kinds of seam
    assert len(doc) > P.PIECE_CHARS
    docs = [doc, *articles[300:340]]
    ds = lm_chunks(docs, tok, 1)
    assert ds.columns["input_ids"].flatten().tolist() == one_call_stream(tok, docs, ds.info["eos_token_id"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    texts = [doc, *articles[300:310]]
    cls = text_classification(texts, [0] * len(texts), tok, 16)
    direct = tok(texts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    assert cls.columns["input_ids"].equal(direct["input_ids"])
