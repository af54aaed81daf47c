"""The user's own data as aqsgd datasets: local files (:func:`load_text_files`) or a Hugging Face hub data set
(:func:`load_hub_dataset`), read the way Hugging Face's ``run_clm.py`` / ``run_glue.py`` examples read them.

* **Formats** (:data:`SUPPORTED_EXTENSIONS`, chosen by the file's extension; see :func:`read_records`):
  ``.jsonl``, ``.json``, ``.csv``, ``.tsv``, ``.txt`` (column ``text``: one document per line, or per
  paragraph, or the whole file, as ``txt_unit`` says) and ``.parquet`` (needs ``pyarrow``).
* **Task**: a label column makes the data sequence classification (``label_column``, or ``label`` where the
  training data have that column); without one the data are causal-LM text.
* **Classification**: labels may be strings or integers. The classes are the sorted distinct labels of the
  training data and a label's id is its index among them (integer labels 0..K-1 keep their values). The text
  (and the optional second text, ``text_pair_column``) is tokenized and padded/truncated to ``max_length``
  (:func:`~aqsgd.data.datasets.text.text_classification`).
* **Causal LM**: the documents (blank ones skipped) are tokenized, joined with the document separator
  (``<|endoftext|>``, else EOS, else SEP) and cut into ``max_length``-token chunks
  (:func:`~aqsgd.data.datasets.text.lm_chunks`).
* **Evaluation data**: the evaluation file (or the hub data set's ``validation``/``test`` split) when there is
  one, else a seeded hold-out of ``eval_split`` of the training rows: stratified by label for classification,
  a seeded choice of documents (before chunking) for causal LM.
* **Sample ids**: both splits keep the file's row order, so the same files, seed and options give the same
  datasets in the same order on every process; ``max_*_samples`` keep the first N samples (chunks for LM).

Bad input raises a one-line :class:`~aqsgd.errors.DataFileError` that names the option, the file, the problem
and, where it has one, the line (``record`` of a ``.json`` list, ``row`` of a column table, ``.parquet`` file
or hub split), e.g. ``--train-file data/train.csv: no column 'text'; the columns are: sentence, label``.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aqsgd.data.datasets.base import DictDataset, PathLike
from aqsgd.data.datasets.batching import _rng, stratified_split
from aqsgd.data.datasets.hub import _hub_probe
from aqsgd.data.datasets.records import (
    SUPPORTED_EXTENSIONS,
    Records,
    _combine,
    _describe,
    _error,
    _first_line,
    _sha256,
    data_fingerprint,
    read_records,
)
from aqsgd.data.datasets.text import lm_chunks, load_tokenizer, text_classification
from aqsgd.errors import SpecError

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "Records",
    "data_fingerprint",
    "load_hub_dataset",
    "load_text_files",
    "read_records",
]

_INT = re.compile(r"-?(0|[1-9][0-9]*)")  # an integer written the one canonical way ("01" and "+1" are text)
_SHOWN_LABELS = 20  # how many training labels an "unknown label" message lists

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------------


def load_text_files(
    train_file: PathLike,
    eval_file: PathLike | None = None,
    *,
    tokenizer: Any = None,
    tokenizer_for: Callable[[str], Any] | None = None,
    max_length: int,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str | None = None,
    eval_split: float = 0.1,
    seed: int = 0,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    txt_unit: str = "line",
) -> tuple[DictDataset, DictDataset]:
    """The (train, eval) datasets of the user's data files (any of :data:`SUPPORTED_EXTENSIONS`).

    Args:
        train_file: the training data (``--train-file``).
        eval_file: the evaluation data (``--eval-file``); without it, ``eval_split`` of the training rows are
            held out (seeded; stratified by label for classification, documents before chunking for LM).
        tokenizer: a Hugging Face tokenizer, a tokenizer folder or a source name
            (:func:`~aqsgd.data.datasets.text.load_tokenizer`). A tokenizer without a pad token gets its EOS
            token as pad for classification, on a copy (the caller's tokenizer is not changed);
            ``info["pad_token_id"]`` says which id pads.
        tokenizer_for: instead of ``tokenizer``, ``tokenizer_for(kind)`` gives the tokenizer once the data's
            kind (``causal-lm`` / ``sequence-classification``) is known, e.g. that of the kind's default
            model.
        max_length: tokens per sample: padded/truncated length (classification) or chunk length (LM).
        text_column: the column holding the text.
        text_pair_column: the column holding the second text of sentence-pair classification.
        label_column: the column holding the class label (strings or integers); must exist when given.
            ``None``: ``label`` where the training data have it, else the data are causal-LM text.
        eval_split: share of the training rows held out for evaluation when there is no ``eval_file``.
        seed: seed of the hold-out.
        max_train_samples, max_eval_samples: keep only the first N samples (LM: chunks) of each split;
            ``None`` keeps all.
        txt_unit: how a ``.txt`` file is cut into documents (:data:`~aqsgd.data.datasets.records.TXT_UNITS`):
            ``line`` (one per line), ``paragraph`` (lines up to a blank line) or ``file`` (the whole file).

    Both datasets' ``info`` hold ``kind`` (``causal-lm`` / ``sequence-classification``), ``num_labels`` and
    ``label_names`` (``None`` for LM), ``source`` (``files``), ``train_file``, ``eval_file``, the columns,
    ``fingerprint`` (:func:`data_fingerprint` of the training file, and of the evaluation file if given,
    combined with ``txt_unit`` where a ``.txt`` file is read otherwise than by line: the same file read as
    other documents gives other samples), ``fingerprints`` (per file), ``txt_unit`` (``None`` without a
    ``.txt`` file), ``rows_read`` (rows read per file), ``rows`` (source rows in this split),
    ``split``, ``seed``, ``eval_split`` (``None`` with an evaluation file), plus the builders' metadata.

    Raises a one-line :class:`~aqsgd.errors.DataFileError` for bad data, a
    :class:`~aqsgd.errors.SpecError` for a bad argument.
    """
    train = read_records(train_file, option="--train-file", txt_unit=txt_unit)
    evals = None if eval_file is None else read_records(eval_file, option="--eval-file", txt_unit=txt_unit)
    digests = {"train": _sha256(train_file)}
    if eval_file is not None:
        digests["eval"] = _sha256(eval_file)
    fingerprint = digests["train"] if eval_file is None else _combine(list(digests.values()))
    has_txt = any(str(f).lower().endswith(".txt") for f in (train_file, eval_file) if f is not None)
    if has_txt and txt_unit != "line":  # by line, as files were always read: the fingerprint stays the bytes'
        fingerprint = _combine([fingerprint, f"txt_unit={txt_unit}"])
    info = {
        "source": "files",
        "train_file": str(train_file),
        "eval_file": None if eval_file is None else str(eval_file),
        "fingerprint": fingerprint,
        "fingerprints": digests,
        "txt_unit": txt_unit if has_txt else None,
    }
    return _logged(train, evals, tokenizer=tokenizer, tokenizer_for=tokenizer_for, max_length=max_length,
                   text_column=text_column, text_pair_column=text_pair_column, label_column=label_column,
                   eval_split=eval_split, seed=seed, max_train_samples=max_train_samples,
                   max_eval_samples=max_eval_samples, info=info)


def load_hub_dataset(
    spec: str,
    *,
    tokenizer: Any = None,
    tokenizer_for: Callable[[str], Any] | None = None,
    max_length: int,
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str | None = None,
    eval_split: float = 0.1,
    seed: int = 0,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
) -> tuple[DictDataset, DictDataset]:
    """The (train, eval) datasets of a Hugging Face hub data set ``spec``, ``NAME[:CONFIG]`` (``--dataset``).

    Loads with ``datasets.load_dataset(NAME, CONFIG)`` once the hub is known to be usable (the same quick
    probe as the hub tasks; a one-line :class:`~aqsgd.errors.DataSourceError` naming ``--dataset NAME``
    otherwise). Trains on the ``train`` split and evaluates on ``validation``, else ``test``, else a seeded
    hold-out of ``eval_split`` of ``train``. Columns, labels, tokenization and the other arguments work as in
    :func:`load_text_files`; a label column with a ``ClassLabel`` feature keeps its ids and class names.
    ``info`` holds ``source`` (``hub``), ``dataset``, ``train_split``, ``eval_split_name`` (``None`` for a
    hold-out) and a ``fingerprint`` made from the splits' own fingerprints (``None`` if they have none).
    """
    name, _, config = spec.partition(":")
    if not name.strip():
        raise SpecError(f"--dataset wants NAME or NAME:CONFIG, got {spec!r}")
    hint = "offline alternative: save the data as .jsonl, .csv or .parquet and pass `--train-file`"
    datasets = _hub_probe(f"--dataset {spec}", hint)
    try:
        splits = datasets.load_dataset(name, config or None)
    except Exception as e:  # not found, a config needed, a network error: all end the same way
        raise _error("--dataset", spec, f"datasets.load_dataset failed: {type(e).__name__}: {_first_line(e)}"
                     ) from e
    names = list(splits)
    if "train" not in names:
        raise _error("--dataset", spec, f"no 'train' split; the splits are: {', '.join(names) or '(none)'}")
    eval_name = next((s for s in ("validation", "test") if s in names), None)
    train_ds = splits["train"]
    label = label_column
    if label is None and "label" in train_ds.column_names:
        label = "label"
    wanted = [c for c in dict.fromkeys((text_column, text_pair_column, label)) if c is not None]
    train = _hub_records(train_ds, spec, "train", wanted)
    evals = None if eval_name is None else _hub_records(splits[eval_name], spec, eval_name, wanted)
    feature = getattr(train_ds, "features", {}).get(label) if label is not None else None
    class_names = list(feature.names) if type(feature).__name__ == "ClassLabel" else None
    fps = [getattr(train_ds, "_fingerprint", None)]
    if eval_name is not None:
        fps.append(getattr(splits[eval_name], "_fingerprint", None))
    info = {
        "source": "hub",
        "dataset": spec,
        "train_split": "train",
        "eval_split_name": eval_name,
        "fingerprint": _combine([spec, *fps]) if all(isinstance(f, str) for f in fps) else None,
    }
    return _logged(train, evals, tokenizer=tokenizer, tokenizer_for=tokenizer_for, max_length=max_length,
                   text_column=text_column, text_pair_column=text_pair_column, label_column=label,
                   eval_split=eval_split, seed=seed, max_train_samples=max_train_samples,
                   max_eval_samples=max_eval_samples, info=info, class_names=class_names)


def _hub_records(ds: Any, spec: str, split: str, wanted: Sequence[str]) -> Records:
    names = list(ds.column_names)
    columns = {c: list(ds[c]) for c in wanted if c in names}
    return Records(f"{spec} ({split} split)", "--dataset", columns, range(1, len(ds) + 1), unit="row",
                   column_names=names)


# --------------------------------------------------------------------------------------------------
# from records to datasets
# --------------------------------------------------------------------------------------------------


def _logged(train: Records, evals: Records | None, **kw: Any) -> tuple[DictDataset, DictDataset]:
    """:func:`_build`, with what was read and what it became in the log (tokenizing a large file takes a
    while)."""
    log.info("%s %s: %s%s; tokenizing", train.option, train.source, train.read_as,
             "" if evals is None else f" (evaluation: {evals.read_as})")
    out = _build(train, evals, **kw)
    log.info("data: %d training and %d evaluation samples (%s)", len(out[0]), len(out[1]),
             out[0].info.get("kind"))
    return out


def _build(train: Records, evals: Records | None, *, tokenizer: Any,
           tokenizer_for: Callable[[str], Any] | None, max_length: int, text_column: str,
           text_pair_column: str | None, label_column: str | None, eval_split: float, seed: int,
           max_train_samples: int | None, max_eval_samples: int | None, info: Mapping[str, Any],
           class_names: Sequence[str] | None = None) -> tuple[DictDataset, DictDataset]:
    if not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise SpecError(f"max_length must be an integer >= 1, got {max_length!r}")
    for arg, value in (("max_train_samples", max_train_samples), ("max_eval_samples", max_eval_samples)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise SpecError(f"{arg} must be an integer >= 1 or None (all), got {value!r}")
    if evals is None and not 0.0 < eval_split < 1.0:
        raise SpecError(f"eval_split must be in (0, 1), got {eval_split}")
    if seed < 0:
        raise SpecError(f"seed must be >= 0, got {seed}")
    if label_column is None and "label" in train.column_names:
        label_column = "label"
    common = {
        **info,
        "text_column": text_column,
        "text_pair_column": text_pair_column,
        "label_column": label_column,
        "seed": seed,
        "eval_split": eval_split if evals is None else None,
        "rows_read": {"train": len(train), "eval": None if evals is None else len(evals)},
    }
    if (tokenizer is None) == (tokenizer_for is None):
        raise SpecError("give a tokenizer or tokenizer_for (not both)")
    for name in (text_column, label_column):  # bad columns are reported before a tokenizer is loaded
        if name is not None:
            train.column(name)
    if tokenizer_for is not None:
        tokenizer = tokenizer_for("causal-lm" if label_column is None else "sequence-classification")
    tok = load_tokenizer(tokenizer)
    if label_column is None:
        return _build_lm(train, evals, tok, max_length, text_column, text_pair_column, eval_split, seed,
                         max_train_samples, max_eval_samples, common)
    return _build_classification(train, evals, tok, max_length, text_column, text_pair_column, label_column,
                                 eval_split, seed, max_train_samples, max_eval_samples, common, class_names)


def _build_lm(train: Records, evals: Records | None, tok: Any, max_length: int, text_column: str,
              text_pair_column: str | None, eval_split: float, seed: int, max_train: int | None,
              max_eval: int | None, common: dict[str, Any]) -> tuple[DictDataset, DictDataset]:
    if text_pair_column is not None:
        raise train.error(f"--text-pair-column {text_pair_column!r} is for sentence-pair classification, but "
                          "the data have no label column (no 'label'; name one with --label-column)")
    docs = _documents(train, text_column)
    if evals is None:
        n = len(docs)
        k = round(n * eval_split)
        if k == 0:
            raise train.error(f"too few documents to hold out eval_split={eval_split} of {n} for evaluation; "
                              "give --eval-file or raise --eval-split")
        if k == n:
            raise train.error(f"holding out eval_split={eval_split} of {n} documents leaves none to train "
                              "on; lower --eval-split")
        order = _rng(seed, 0).permutation(n)
        train_docs = [docs[i] for i in np.sort(order[k:])]
        eval_docs = [docs[i] for i in np.sort(order[:k])]
        eval_what = f"the held-out evaluation documents ({k})"
    else:
        train_docs = docs
        eval_docs = _documents(evals, text_column)
        eval_what = f"the documents ({len(eval_docs)})"
    meta = {**common, "kind": "causal-lm", "num_labels": None, "label_names": None}
    train_ds = _chunks(train, f"the training documents ({len(train_docs)})", train_docs, tok, max_length,
                       max_train, {**meta, "split": "train", "rows": len(train_docs)})
    eval_ds = _chunks(train if evals is None else evals, eval_what, eval_docs, tok, max_length, max_eval,
                      {**meta, "split": "eval", "rows": len(eval_docs)})
    return train_ds, eval_ds


def _documents(records: Records, column: str) -> list[str]:
    docs = [t for t in _texts(records, column) if t.strip()]
    if not docs:
        raise records.error(f"no text: every {column!r} value is blank")
    return docs


def _chunks(records: Records, what: str, docs: list[str], tok: Any, max_length: int, max_chunks: int | None,
            info: dict[str, Any]) -> DictDataset:
    try:  # documents separated as from Python (lm_chunks: <|endoftext|>, else EOS, else SEP)
        return lm_chunks(docs, tok, max_length, max_chunks=max_chunks, info=info,
                         label=f"{what} of {records.option} {records.source}")
    except SpecError as e:
        found = re.search(r"give (\d+) tokens", str(e))
        tokens = f"{found.group(1)} tokens, " if found else ""
        raise records.error(f"{what} give {tokens}not one chunk of --max-length {max_length} tokens; "
                            "give more text or lower --max-length") from None


def _build_classification(train: Records, evals: Records | None, tok: Any, max_length: int, text_column: str,
                          text_pair_column: str | None, label_column: str, eval_split: float, seed: int,
                          max_train: int | None, max_eval: int | None, common: dict[str, Any],
                          class_names: Sequence[str] | None) -> tuple[DictDataset, DictDataset]:
    texts, pairs = _example_texts(train, text_column, text_pair_column)
    keys = [_label_key(train, i, v, label_column) for i, v in enumerate(train.column(label_column))]
    if class_names is not None:  # a hub ClassLabel: ids as they are, names from the feature
        vocab: list[Any] = list(range(len(class_names)))
        names = [str(c) for c in class_names]
        for i, key in enumerate(keys):
            if not isinstance(key, int) or not 0 <= key < len(vocab):
                raise train.error(f"{train.where(i)}: label {key!r} is not one of the {len(vocab)} classes "
                                  f"of the {label_column!r} ClassLabel")
    else:
        vocab = _vocabulary(keys)
        names = [str(c) for c in vocab]
        if len(vocab) < 2:
            raise train.error(f"the {label_column!r} column holds a single label ({names[0]!r}); "
                              "classification needs two or more")
    index = {c: i for i, c in enumerate(vocab)}
    as_str = not all(isinstance(c, int) for c in vocab)
    ids = np.asarray([index[str(k) if as_str else k] for k in keys], dtype=np.int64)
    if evals is None:
        tr, ev = stratified_split(ids, eval_split, seed)
        tr, ev = np.sort(tr), np.sort(ev)
        if len(ev) == 0:
            raise train.error(f"too few rows to hold out eval_split={eval_split} of {len(ids)} for "
                              "evaluation (stratified by label); give --eval-file or raise --eval-split")
        if len(tr) == 0:
            raise train.error(f"holding out eval_split={eval_split} of {len(ids)} rows leaves none to train "
                              "on; lower --eval-split")
        train_part = (texts, pairs, ids, tr)
        eval_part = (texts, pairs, ids, ev)
    else:
        e_texts, e_pairs = _example_texts(evals, text_column, text_pair_column)
        e_ids = np.empty(len(evals), dtype=np.int64)
        for i, v in enumerate(evals.column(label_column)):
            key = _label_key(evals, i, v, label_column)
            found = index.get(str(key) if as_str else key)
            if found is None:
                shown = ", ".join(names[:_SHOWN_LABELS]) + (", ..." if len(names) > _SHOWN_LABELS else "")
                raise evals.error(f"{evals.where(i)}: label {key!r} does not occur in the training data "
                                  f"(its labels are: {shown})")
            e_ids[i] = found
        train_part = (texts, pairs, ids, np.arange(len(ids)))
        eval_part = (e_texts, e_pairs, e_ids, np.arange(len(e_ids)))
    tok = _with_pad_token(tok)
    meta = {**common, "kind": "sequence-classification", "num_labels": len(names), "label_names": names}
    out = []
    for split, (t, p, y, idx), cap in (("train", train_part, max_train), ("eval", eval_part, max_eval)):
        rows = len(idx)
        idx = idx[:cap] if cap is not None else idx
        labels = torch.from_numpy(np.ascontiguousarray(y[idx]))
        out.append(text_classification([t[i] for i in idx], labels, tok, max_length,
                                       text_pairs=None if p is None else [p[i] for i in idx],
                                       label_names=names, info={**meta, "split": split, "rows": rows},
                                       label=f"the {split} texts of {train.option} {train.source}"))
    return out[0], out[1]


def _example_texts(records: Records, column: str, pair_column: str | None
                   ) -> tuple[list[str], list[str] | None]:
    texts = _texts(records, column)
    pairs = None if pair_column is None else _texts(records, pair_column)
    if not any(t.strip() for t in texts):
        raise records.error(f"no text: every {column!r} value is blank")
    return texts, pairs


def _texts(records: Records, column: str) -> list[str]:
    values = records.column(column)
    for i, v in enumerate(values):
        if v is None:
            raise records.error(f"{records.where(i)} has no {column!r} value (null or missing)")
        if not isinstance(v, str):
            raise records.error(f"{records.where(i)}: the {column!r} value is {_describe(v)}, not a string")
        limit = records.text_limit
        if limit is not None and len(v) > limit:
            raise records.error(f"{records.where(i)}: the {column!r} value is {len(v):,} characters long, "
                                f"over the limit of {limit:,} for one text; split long documents into "
                                "paragraphs")
    return values


def _label_key(records: Records, row: int, value: Any, column: str) -> int | str:
    """A label as a class key: integers (and integer-valued floats, and strings that spell an integer) as
    ``int``, other strings stripped, booleans as ``false``/``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if float(value).is_integer():
            return int(value)
        raise records.error(f"{records.where(row)}: label {value!r} is not a class (regression targets are "
                            "not supported)")
    if isinstance(value, str):
        s = value.strip()
        if not s:
            raise records.error(f"{records.where(row)} has an empty {column!r} label")
        return int(s) if _INT.fullmatch(s) else s
    if value is None:
        raise records.error(f"{records.where(row)} has no {column!r} label (null or missing)")
    raise records.error(f"{records.where(row)}: the {column!r} label is {_describe(value)}, not a string or "
                        "an integer")


def _vocabulary(keys: Sequence[int | str]) -> list[Any]:
    """The sorted distinct labels: integers in numeric order, or (when any label is text) all as strings."""
    distinct = set(keys)
    if all(isinstance(k, int) for k in distinct):
        return sorted(distinct)
    return sorted({str(k) for k in distinct})


def _with_pad_token(tok: Any) -> Any:
    """``tok``, or a copy of it that pads with its EOS token when it has no pad token (decoder LMs)."""
    if getattr(tok, "pad_token_id", None) is not None:
        return tok
    eos = getattr(tok, "eos_token", None)
    if eos is None:
        raise SpecError("the tokenizer has neither a pad nor an EOS token to pad with; set its pad_token")
    tok = copy.deepcopy(tok)
    tok.pad_token = eos
    return tok


