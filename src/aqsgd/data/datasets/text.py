"""Text datasets: causal-LM chunks and (pair) classification built with a Hugging Face tokenizer, and
the text tasks (``bbc`` and ``wiki`` offline; ``wikitext-2``, ``glue-cola``, ``glue-qnli`` from the hub).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from aqsgd.data.datasets.base import DictDataset, PathLike, _Args, _max
from aqsgd.data.datasets.batching import stratified_split
from aqsgd.data.datasets.hub import _hub_datasets, _hub_split
from aqsgd.data.datasets.pieces import BATCH_CHARS, count, encode, id_dtype, leading, pieces
from aqsgd.data.datasets.ragged import RaggedDataset
from aqsgd.data.sources import SOURCES, require
from aqsgd.errors import DataSourceError, SpecError
from aqsgd.logs import ProgressLog

__all__ = ["document_separator", "lm_chunks", "load_tokenizer", "read_bbc", "read_wiki",
           "text_classification"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# builders from raw data
# --------------------------------------------------------------------------------------------------


def lm_chunks(
    texts: Iterable[str],
    tokenizer: Any,
    seq_len: int,
    *,
    eos_token_id: int | None = None,
    add_eos: bool = True,
    max_chunks: int | None = None,
    batch_texts: int = 256,
    info: Mapping[str, Any] | None = None,
    label: str = "texts",
) -> DictDataset:
    """Causal-LM samples: the tokenized texts concatenated and cut into non-overlapping chunks.

    Each text is tokenized without special tokens and followed by a document separator, unless ``add_eos`` is
    false: ``eos_token_id`` if given, else :func:`document_separator` (``<|endoftext|>``, else the EOS token,
    else the SEP token), the same one ``aqsgd train --train-file`` puts between documents; a tokenizer with
    none of them joins the documents without a separator, with a warning. Empty texts are skipped.
    The stream is cut into ``seq_len``-token chunks; the tokens after the last full chunk are dropped.
    ``max_chunks`` stops tokenizing once that many chunks exist; the result is then exactly the first
    ``max_chunks`` chunks of the full dataset.

    Memory follows the tokens, not the text: the texts are tokenized ``batch_texts`` at a time and at most
    :data:`~aqsgd.data.datasets.pieces.BATCH_CHARS` characters per call, a document longer than
    :data:`~aqsgd.data.datasets.pieces.PIECE_CHARS` in pieces cut where the tokenizer splits anyway (the same
    tokens as in one call, :mod:`aqsgd.data.datasets.pieces`), and the ids are kept as int32 until the chunks
    are cut.

    Items: ``input_ids``, ``attention_mask`` (ones), ``labels`` (= ``input_ids``), each ``[seq_len]``
    int64, and ``sample_id``. The ``labels`` column is the ``input_ids`` tensor itself and ``attention_mask``
    one value broadcast to ``[n, seq_len]``, so the dataset holds 8 bytes per token. Tokenizing that takes
    longer than a few seconds logs its progress (``label`` names the texts there).
    """
    if seq_len < 1:
        raise SpecError(f"seq_len must be >= 1, got {seq_len}")
    if max_chunks is not None and max_chunks < 0:
        raise SpecError(f"max_chunks must be >= 0, got {max_chunks}")
    if add_eos and eos_token_id is None:
        eos_token_id = document_separator(tokenizer)
        if eos_token_id is None:
            log.warning("the tokenizer has no end-of-text, EOS or SEP token: %s are joined without a "
                        "separator (pass eos_token_id=... to give one)", label)
            add_eos = False
    dtype = id_dtype(_vocab_size(tokenizer), eos_token_id if add_eos else 0)
    need = None if max_chunks is None else max_chunks * seq_len
    parts: list[np.ndarray] = []
    total = done = 0
    progress = ProgressLog(log, f"tokenizing {label}", total=len(texts) if isinstance(texts, Sized) else None,
                           unit="documents")
    batch: list[str] = []
    ends: list[bool] = []  # whether each text or piece of the batch ends its document
    chars = 0

    def flush() -> None:
        nonlocal total, done, chars
        flat: list[int] = []
        for ids, end in zip(encode(tokenizer, batch), ends):
            flat.extend(ids)
            if end and add_eos:
                flat.append(eos_token_id)  # type: ignore[arg-type]
        parts.append(np.asarray(flat, dtype=dtype))
        total += len(flat)
        done += sum(ends)
        progress.update(done)
        batch.clear()
        ends.clear()
        chars = 0

    for text in texts:
        if need is not None and total >= need:
            break
        if not text or not text.strip():
            continue
        for piece, last in _marked(pieces(text, tokenizer)):
            batch.append(piece)
            ends.append(last)
            chars += len(piece)
            if len(batch) >= batch_texts or chars >= BATCH_CHARS:
                flush()
                if need is not None and total >= need:  # enough: not the rest of a long document either
                    break
    if batch and (need is None or total < need):
        flush()
    n = total // seq_len
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0 and max_chunks != 0:
        raise SpecError(f"the texts give {total} tokens, fewer than one chunk of seq_len={seq_len}")
    ids = torch.from_numpy(_joined(parts, n * seq_len)).view(n, seq_len)
    meta = {"kind": "causal-lm", "seq_len": seq_len, "tokens": n * seq_len, "eos_token_id": eos_token_id,
            "vocab_size": _vocab_size(tokenizer)}
    meta.update(info or {})
    mask = torch.ones(1, 1, dtype=torch.int64).expand(n, seq_len)
    return DictDataset({"input_ids": ids, "attention_mask": mask, "labels": ids}, info=meta)


def _marked(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """Each item with whether it is the last."""
    prev = next(items)
    for item in items:
        yield prev, False
        prev = item
    yield prev, True


def _joined(parts: list[np.ndarray], n: int) -> np.ndarray:
    """The first ``n`` ids of ``parts`` as one int64 array; each part is released once copied."""
    out = np.empty(n, dtype=np.int64)
    at = 0
    while parts and at < n:
        part = parts.pop(0)
        take = min(len(part), n - at)
        out[at:at + take] = part[:take]
        at += take
    parts.clear()
    return out


def text_classification(
    texts: Sequence[str],
    labels: Sequence[int] | Tensor,
    tokenizer: Any,
    max_length: int,
    *,
    text_pairs: Sequence[str] | None = None,
    label_names: Sequence[str] | None = None,
    info: Mapping[str, Any] | None = None,
    batch_texts: int = 1024,
    label: str = "texts",
    ragged: bool = False,
) -> DictDataset | RaggedDataset:
    """Text (or text-pair) classification samples, padded/truncated to exactly ``max_length`` tokens (with
    ``ragged``: each its own length, see :func:`_ragged_classification`).

    Items: ``input_ids``, ``attention_mask`` and ``token_type_ids`` (if the tokenizer makes them), each
    ``[max_length]`` int64, ``labels`` (scalar int64) and ``sample_id``. The texts are tokenized
    ``batch_texts`` at a time and at most :data:`~aqsgd.data.datasets.pieces.BATCH_CHARS` characters per call
    (the tokenizer's intermediate results of one batch at most in memory). As only the first ``max_length``
    tokens are kept, only a text's beginning is tokenized: a text over ``16 * max_length`` characters is cut
    where the tokenizer splits anyway, past its first ``max_length`` tokens
    (:func:`~aqsgd.data.datasets.pieces.leading`; of a pair, so that the longer text stays the longer, which
    the truncation of pairs looks at), with the same ids as the whole text gives (a tokenizer that truncates
    on the left gets whole texts). Work that takes longer than a few seconds logs its progress (``label``
    names the texts there).
    """
    if max_length < 1:
        raise SpecError(f"max_length must be >= 1, got {max_length}")
    labels_t = torch.as_tensor(labels, dtype=torch.int64).reshape(-1)
    if len(texts) != labels_t.numel() or (text_pairs is not None and len(text_pairs) != len(texts)):
        raise SpecError(f"{len(texts)} texts, {labels_t.numel()} labels"
                        + ("" if text_pairs is None else f", {len(text_pairs)} pairs"))
    if ragged:
        return _ragged_classification(texts, labels_t, tokenizer, max_length, text_pairs=text_pairs,
                                      label_names=label_names, info=info, batch_texts=batch_texts,
                                      label=label)
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise SpecError("the tokenizer has no pad token; set tokenizer.pad_token first")
    progress = ProgressLog(log, f"tokenizing {label}", total=len(texts), unit="texts")
    cut = getattr(tokenizer, "truncation_side", "right") == "right"
    parts: dict[str, list[Tensor]] = {}
    firsts: list[str] = []
    seconds: list[str] = []
    chars = 0

    def flush(done: int) -> None:
        nonlocal chars
        args: tuple[Any, ...] = (firsts,) if text_pairs is None else (firsts, seconds)
        enc = tokenizer(*args, padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt", verbose=False)
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            if k in enc:
                parts.setdefault(k, []).append(enc[k].to(torch.int64))
        firsts.clear()
        seconds.clear()
        chars = 0
        progress.update(done)

    for i, text in enumerate(texts):
        pair = None if text_pairs is None else text_pairs[i]
        if cut:
            text, pair = _beginnings(text, pair, tokenizer, max_length)
        firsts.append(text)
        chars += len(text)
        if pair is not None:
            seconds.append(pair)
            chars += len(pair)
        if len(firsts) >= batch_texts or chars >= BATCH_CHARS:
            flush(i + 1)
    if firsts:
        flush(len(texts))
    if not parts:  # no texts: the columns' names and widths, from an empty call
        enc = tokenizer([""], padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt")
        parts = {k: [enc[k][:0].to(torch.int64)] for k in ("input_ids", "attention_mask", "token_type_ids")
                 if k in enc}
    cols = {k: torch.cat(v) for k, v in parts.items()}
    cols["labels"] = labels_t
    if label_names is not None:
        num_labels = len(label_names)
    else:
        num_labels = int(labels_t.max()) + 1 if len(texts) else 0
    meta = {"kind": "sequence-classification", "max_length": max_length, "num_labels": num_labels,
            "label_names": list(label_names) if label_names is not None else None,
            "pad_token_id": tokenizer.pad_token_id, "vocab_size": _vocab_size(tokenizer)}
    meta.update(info or {})
    return DictDataset(cols, info=meta)


def _ragged_classification(texts: Sequence[str], labels: Tensor, tokenizer: Any, max_length: int, *,
                           text_pairs: Sequence[str] | None, label_names: Sequence[str] | None,
                           info: Mapping[str, Any] | None, batch_texts: int, label: str) -> RaggedDataset:
    """:func:`text_classification` without padding: each text (or pair) tokenized as the tokenizer does it
    for a model (special tokens included), truncated to at most ``max_length`` tokens, in a
    :class:`~aqsgd.data.datasets.ragged.RaggedDataset`: token columns ``input_ids`` and, where the
    tokenizer makes them, ``token_type_ids``; the value column ``labels``. A text is tokenized only as far as
    it is kept, as in the padded form. ``info`` holds ``truncated`` (texts cut to ``max_length``),
    ``dropped`` (texts that give no token at all, left out with a warning) and ``pad_token_id`` (the
    tokenizer's pad id, else its EOS id)."""
    progress = ProgressLog(log, f"tokenizing {label}", total=len(texts), unit="texts")
    cut_right = getattr(tokenizer, "truncation_side", "right") == "right"
    dtype = id_dtype(_vocab_size(tokenizer))
    parts: dict[str, list[np.ndarray]] = {}
    lengths: list[int] = []
    kept: list[int] = []
    counts = {"truncated": 0, "dropped": 0}
    rows: list[int] = []
    firsts: list[str] = []
    seconds: list[str] = []
    cut: list[bool] = []  # whether a text of the batch is known to be longer than what is kept
    chars = 0

    def flush(done: int) -> None:
        nonlocal chars
        args: tuple[Any, ...] = (firsts,) if text_pairs is None else (firsts, seconds)
        enc = tokenizer(*args, truncation=True, max_length=max_length, verbose=False)
        _mark_truncated(tokenizer, args, enc["input_ids"], cut, max_length)
        for j, ids in enumerate(enc["input_ids"]):
            if not ids:
                counts["dropped"] += 1
                continue
            counts["truncated"] += cut[j]
            parts.setdefault("input_ids", []).append(np.asarray(ids, dtype=dtype))
            if "token_type_ids" in enc:
                types = np.asarray(enc["token_type_ids"][j], dtype=np.int8)
                parts.setdefault("token_type_ids", []).append(types)
            lengths.append(len(ids))
            kept.append(rows[j])
        for held in (rows, firsts, seconds, cut):
            held.clear()
        chars = 0
        progress.update(done)

    for i, text in enumerate(texts):
        pair = None if text_pairs is None else text_pairs[i]
        whole = (text, pair)
        if cut_right:
            text, pair = _beginnings(text, pair, tokenizer, max_length)
        rows.append(i)
        firsts.append(text)
        cut.append((text, pair) != whole)
        chars += len(text)
        if pair is not None:
            seconds.append(pair)
            chars += len(pair)
        if len(firsts) >= batch_texts or chars >= BATCH_CHARS:
            flush(i + 1)
    if firsts:
        flush(len(texts))
    if counts["dropped"]:
        log.warning("%s: %d of %d texts give no tokens and are left out", label, counts["dropped"],
                    len(texts))
    if counts["truncated"]:
        log.info("%s: %d of %d texts cut to --max-length %d tokens", label, counts["truncated"], len(texts),
                 max_length)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64), 0)
    tokens = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
    tokens.setdefault("input_ids", torch.zeros(0, dtype=torch.int32))
    num_labels = len(label_names) if label_names is not None else (int(labels.max()) + 1 if len(texts) else 0)
    pad = getattr(tokenizer, "pad_token_id", None)
    meta = {"kind": "sequence-classification", "max_length": max_length, "num_labels": num_labels,
            "label_names": list(label_names) if label_names is not None else None,
            "pad_token_id": pad if pad is not None else getattr(tokenizer, "eos_token_id", None),
            "vocab_size": _vocab_size(tokenizer), **counts}
    meta.update(info or {})
    return RaggedDataset(tokens, offsets, values={"labels": labels[torch.as_tensor(kept, dtype=torch.int64)]},
                         info=meta)


def _mark_truncated(tokenizer: Any, args: tuple[Any, ...], encoded: list[list[int]], cut: list[bool],
                    max_length: int) -> None:
    """Set ``cut[j]`` for the texts of the batch that ``max_length`` truncated: those that filled it are
    tokenized again, whole (as far as they were kept before, which is short), to see whether they had
    more."""
    full = [j for j, ids in enumerate(encoded) if len(ids) >= max_length and not cut[j]]
    if not full:
        return
    again = tuple([texts[j] for j in full] for texts in args)
    whole = tokenizer(*again, truncation=False, verbose=False)["input_ids"]
    for j, ids in zip(full, whole):
        cut[j] = len(ids) > max_length


def _beginnings(text: str, pair: str | None, tokenizer: Any, max_length: int) -> tuple[str, str | None]:
    """``text`` and ``pair`` cut to beginnings that give the same ``max_length``-token truncation as they do
    whole (:func:`~aqsgd.data.datasets.pieces.leading`).

    A single text keeps more than ``max_length`` tokens. A pair's truncation (longest first) takes tokens
    from the longer of the two, so a pair is cut only where the cut keeps which one is the longer: both long,
    the longer one's beginning outnumbers the other's (both counted in pieces; two long texts of exactly
    equal length stay whole); one long, its beginning outnumbers the other text."""
    a, na = leading(text, tokenizer, max_length)
    if pair is None:
        return a, None
    b, nb = leading(pair, tokenizer, max_length)
    if na is None and nb is None:
        return text, pair
    if na is not None and nb is not None:
        whole_a, whole_b = count(text, tokenizer), count(pair, tokenizer)
        if whole_a == whole_b:
            return text, pair
        if whole_a > whole_b:
            return (a if na > nb else leading(text, tokenizer, nb)[0]), b
        return a, (b if nb > na else leading(pair, tokenizer, na)[0])
    if na is not None:
        other = len(encode(tokenizer, [pair])[0])
        return (a if na > other else leading(text, tokenizer, other)[0]), pair
    other = len(encode(tokenizer, [text])[0])
    return text, (b if nb > other else leading(pair, tokenizer, other)[0])  # type: ignore[operator]


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return getattr(tokenizer, "vocab_size", None)


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------


def load_tokenizer(spec: Any, cache_dir: PathLike | None = None) -> Any:
    """A Hugging Face tokenizer from a source name (``minilm``, ``smollm2``, ``gpt2-tokenizer``), a folder
    path, or a tokenizer object (returned unchanged). Source names are prepared on first use."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    from transformers import AutoTokenizer

    path = require(spec, cache_dir) if isinstance(spec, str) and spec in SOURCES else Path(spec)
    if not Path(path).is_dir():
        raise DataSourceError(f"tokenizer folder {path} does not exist")
    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------------------------------
# offline text tasks
# --------------------------------------------------------------------------------------------------


def bbc_articles(root: Path) -> Iterator[tuple[int, str, str]]:
    """(class index, class name, raw text) of each article of the prepared BBC source, in (class, file name)
    order; a file that is not UTF-8 is read as Latin-1."""
    for label, cls in enumerate(sorted(p.name for p in root.iterdir() if p.is_dir())):
        for f in sorted((root / cls).glob("*.txt")):
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            yield label, cls, text


def read_bbc(root: Path) -> tuple[list[str], list[int], list[str]]:
    """(texts, labels, class names) of the prepared BBC source, in (class, file name) order."""
    texts: list[str] = []
    labels: list[int] = []
    for label, _, text in bbc_articles(root):
        texts.append(" ".join(text.split()))
        labels.append(label)
    return texts, labels, sorted(p.name for p in root.iterdir() if p.is_dir())


def read_wiki(root: Path) -> list[str]:
    """The lead sections of the prepared ``wiki`` source, in file order (empty ones skipped)."""
    data = json.loads((root / "summaries_en-us.json").read_text(encoding="utf-8"))
    rows = data.values() if isinstance(data, dict) else data
    return [str(r["extract"]).strip() for r in rows if str(r.get("extract", "")).strip()]


def _load_bbc(a: _Args) -> DictDataset:
    texts, labels, classes = read_bbc(require("bbc", a.cache_dir))
    frac = 0.2 if a.eval_fraction is None else a.eval_fraction
    tr, ev = stratified_split(labels, frac, a.seed)
    idx = tr if a.split == "train" else ev
    idx = idx[: _max(len(idx), a.max_samples)]
    tok = load_tokenizer(a.tokenizer or "minilm", a.cache_dir)
    return text_classification([texts[i] for i in idx], [labels[i] for i in idx], tok, a.max_length,
                               label_names=classes)


def _load_wiki(a: _Args) -> DictDataset:
    articles = read_wiki(require("wiki", a.cache_dir))
    frac = 0.1 if a.eval_fraction is None else a.eval_fraction
    n_eval = math.ceil(len(articles) * frac)
    texts = articles[: len(articles) - n_eval] if a.split == "train" else articles[len(articles) - n_eval:]
    tok = load_tokenizer(a.tokenizer or "smollm2", a.cache_dir)
    return lm_chunks(texts, tok, a.seq_len, max_chunks=a.max_samples)


def document_separator(tokenizer: Any) -> int | None:
    """The token put between documents in a causal-LM stream: ``<|endoftext|>`` when the vocabulary has it
    (GPT-2, SmolLM2, Qwen), else the EOS token, else the SEP token (an encoder's tokenizer); None if the
    tokenizer has none of them."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for found in (vocab.get("<|endoftext|>"), getattr(tokenizer, "eos_token_id", None),
                  getattr(tokenizer, "sep_token_id", None)):
        if found is not None:
            return int(found)
    return None


# --------------------------------------------------------------------------------------------------
# hub-backed text tasks
# --------------------------------------------------------------------------------------------------


def _load_wikitext2(a: _Args) -> DictDataset:
    datasets = _hub_datasets("wikitext-2", "wiki")
    ds = datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1",
                               split=_hub_split(a.split, "validation"))
    tok = load_tokenizer(a.tokenizer or "gpt2-tokenizer", a.cache_dir)
    # WikiText lines keep their newlines: concatenate them as they are (no separator), like run_clm.
    return lm_chunks(list(ds["text"]), tok, a.seq_len, add_eos=False, max_chunks=a.max_samples)


def _load_glue(a: _Args, config: str, fields: tuple[str, ...], label_names: list[str]) -> DictDataset:
    datasets = _hub_datasets(f"glue-{config}", "bbc")
    ds = datasets.load_dataset("nyu-mll/glue", config, split=_hub_split(a.split, "validation"))
    ds = ds.select(range(_max(len(ds), a.max_samples)))
    tok = load_tokenizer(a.tokenizer or "minilm", a.cache_dir)
    pairs = list(ds[fields[1]]) if len(fields) > 1 else None
    return text_classification(list(ds[fields[0]]), list(ds["label"]), tok, a.max_length, text_pairs=pairs,
                               label_names=label_names)
