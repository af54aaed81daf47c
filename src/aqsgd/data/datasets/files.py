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
* **Instruction data** (:mod:`aqsgd.data.datasets.instruct`, a
  :class:`~aqsgd.data.datasets.ragged.RaggedDataset` of examples of their own lengths, the loss on the answers
  only): the training data have a messages column (``messages_column``, default ``messages``: a list of
  ``{"role", "content"}`` turns, rendered with the tokenizer's chat template or ``chat_template``), else both
  a prompt and a response column (``prompt_column`` / ``response_column``, defaults ``prompt`` and
  ``response``; ``prompt`` + ``response`` + EOS, or the two turns rendered with ``chat_template`` where one is
  given). A column option given names a column that must exist; found columns take precedence over a
  ``label`` column found, a ``label_column`` given over columns found (both given: an error). Lists survive
  ``.jsonl``, ``.json`` and ``.parquet`` cells; a ``messages`` cell of a ``.csv``/``.tsv`` file is a JSON
  string of the list. Each example keeps its first ``max_length`` tokens (``info["truncated"]`` counts those
  cut, ``info["dropped"]`` those left without a response token, and both are logged).
* **Evaluation data**: the evaluation file (or the hub data set's ``validation``/``test`` split) when there is
  one, else a seeded hold-out of ``eval_split`` of the training rows: stratified by label for classification,
  a seeded choice of documents (before chunking) for causal LM, of whole examples for instruction data.
* **Sample ids**: both splits keep the file's row order, so the same files, seed and options give the same
  datasets in the same order on every process; ``max_*_samples`` keep the first N samples (chunks for LM).

Bad input raises a one-line :class:`~aqsgd.errors.DataFileError` that names the option, the file, the problem
and, where it has one, the line (``record`` of a ``.json`` list, ``row`` of a column table, ``.parquet`` file
or hub split), e.g. ``--train-file data/train.csv: no column 'text'; the columns are: sentence, label``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aqsgd.data.datasets.base import DictDataset, PathLike
from aqsgd.data.datasets.batching import _rng, stratified_split
from aqsgd.data.datasets.hub import _hub_probe
from aqsgd.data.datasets.instruct import chat_dataset, prompt_response_dataset, read_chat_template
from aqsgd.data.datasets.ragged import RaggedDataset
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
    prompt_column: str | None = None,
    response_column: str | None = None,
    messages_column: str | None = None,
    chat_template: PathLike | None = None,
) -> tuple[DictDataset | RaggedDataset, DictDataset | RaggedDataset]:
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
        prompt_column, response_column, messages_column: the columns of instruction data (see the module
            docstring); ``None``: ``prompt`` and ``response``, or ``messages``, where the training data have
            them.
        chat_template: a Jinja chat template file (``--chat-template``) for instruction data: renders the
            ``messages`` instead of the tokenizer's own template, and prompt/response pairs as a user and an
            assistant turn. Its contents join the ``fingerprint``.

    Both datasets' ``info`` hold ``kind`` (``causal-lm`` / ``sequence-classification``), ``num_labels`` and
    ``label_names`` (``None`` for LM), ``source`` (``files``), ``train_file``, ``eval_file``, the columns,
    ``fingerprint`` (:func:`data_fingerprint` of the training file, and of the evaluation file if given,
    combined with ``txt_unit`` where a ``.txt`` file is read otherwise than by line: the same file read as
    other documents gives other samples), ``fingerprints`` (per file), ``txt_unit`` (``None`` without a
    ``.txt`` file), ``rows_read`` (rows read per file), ``rows`` (source rows in this split),
    ``split``, ``seed``, ``eval_split`` (``None`` with an evaluation file), plus the builders' metadata
    (for instruction data: ``format``, the columns, ``chat_template``, ``truncated``, ``dropped``).

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
                   max_eval_samples=max_eval_samples, info=info,
                   instruct=_Instruct(prompt_column, response_column, messages_column, chat_template))


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
    prompt_column: str | None = None,
    response_column: str | None = None,
    messages_column: str | None = None,
    chat_template: PathLike | None = None,
) -> tuple[DictDataset | RaggedDataset, DictDataset | RaggedDataset]:
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
    instruct = _Instruct(prompt_column, response_column, messages_column, chat_template)
    label = label_column
    if label is None and "label" in train_ds.column_names and not instruct.applies(train_ds.column_names):
        label = "label"
    wanted = [c for c in dict.fromkeys((text_column, text_pair_column, label, *instruct.names()))
              if c is not None]
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
                   max_eval_samples=max_eval_samples, info=info, class_names=class_names, instruct=instruct)


def _hub_records(ds: Any, spec: str, split: str, wanted: Sequence[str]) -> Records:
    names = list(ds.column_names)
    columns = {c: list(ds[c]) for c in wanted if c in names}
    return Records(f"{spec} ({split} split)", "--dataset", columns, range(1, len(ds) + 1), unit="row",
                   column_names=names)


# --------------------------------------------------------------------------------------------------
# from records to datasets
# --------------------------------------------------------------------------------------------------


def _logged(train: Records, evals: Records | None, **kw: Any
            ) -> tuple[DictDataset | RaggedDataset, DictDataset | RaggedDataset]:
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
           class_names: Sequence[str] | None = None, instruct: _Instruct | None = None
           ) -> tuple[DictDataset | RaggedDataset, DictDataset | RaggedDataset]:
    if not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise SpecError(f"max_length must be an integer >= 1, got {max_length!r}")
    for arg, value in (("max_train_samples", max_train_samples), ("max_eval_samples", max_eval_samples)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise SpecError(f"{arg} must be an integer >= 1 or None (all), got {value!r}")
    if evals is None and not 0.0 < eval_split < 1.0:
        raise SpecError(f"eval_split must be in (0, 1), got {eval_split}")
    if seed < 0:
        raise SpecError(f"seed must be >= 0, got {seed}")
    instruct = instruct or _Instruct()
    fmt = instruct.format(train, label_column, text_pair_column)
    template = None if instruct.chat_template is None else read_chat_template(instruct.chat_template)
    if template is not None:
        info = _with_template(info, template.text)
    if label_column is None and "label" in train.column_names and fmt is None:
        label_column = "label"
    common = {
        **info,
        "text_column": text_column if fmt is None else None,
        "text_pair_column": text_pair_column,
        "label_column": label_column,
        "seed": seed,
        "eval_split": eval_split if evals is None else None,
        "rows_read": {"train": len(train), "eval": None if evals is None else len(evals)},
    }
    if (tokenizer is None) == (tokenizer_for is None):
        raise SpecError("give a tokenizer or tokenizer_for (not both)")
    for name in (() if fmt is not None else (text_column, label_column)):  # before a tokenizer is loaded
        if name is not None:
            train.column(name)
    if tokenizer_for is not None:
        tokenizer = tokenizer_for("causal-lm" if label_column is None else "sequence-classification")
    tok = load_tokenizer(tokenizer)
    if fmt is not None:
        return _build_instruct(train, evals, tok, max_length, fmt, template, eval_split, seed,
                               max_train_samples, max_eval_samples, common)
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
        kept, held = _held_out(train, len(docs), eval_split, seed, "documents")
        train_docs = [docs[i] for i in kept]
        eval_docs = [docs[i] for i in held]
        eval_what = f"the held-out evaluation documents ({len(held)})"
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


@dataclasses.dataclass(frozen=True)
class _Instruct:
    """The options of instruction data: the columns given (None: the default name, where the data have that
    column) and the chat template file."""

    prompt_column: str | None = None
    response_column: str | None = None
    messages_column: str | None = None
    chat_template: PathLike | None = None

    def names(self) -> tuple[str, ...]:
        """The columns instruction data may be read from (a hub split is read only for the columns needed)."""
        return (self.prompt_column or "prompt", self.response_column or "response",
                self.messages_column or "messages")

    def applies(self, names: Sequence[str]) -> bool:
        """Whether data with the columns ``names`` are instruction data (a column given, or found)."""
        given = (self.prompt_column, self.response_column, self.messages_column)
        found = "messages" in names or {"prompt", "response"} <= set(names)
        return found or any(c is not None for c in given)

    def format(self, train: Records, label_column: str | None, text_pair_column: str | None
               ) -> tuple[str, ...] | None:
        """``("messages", column)``, ``("prompt-response", prompt, response)`` or None (not instruction data),
        by the rule of the module docstring; the columns it names exist."""
        pair_given = self.prompt_column is not None or self.response_column is not None
        given = self.messages_column is not None or pair_given
        if self.messages_column is not None and pair_given:
            raise SpecError("--messages-column names conversations, --prompt-column / --response-column "
                            "prompt/response pairs: give one or the other")
        if given and label_column is not None:
            raise SpecError(f"--label-column {label_column!r} makes the data classification and the "
                            "instruction columns make them instruction data: give one or the other")
        names = train.column_names
        fmt: tuple[str, ...] | None = None
        if self.messages_column is not None:
            fmt = ("messages", self.messages_column)
        elif pair_given:
            fmt = ("prompt-response", self.prompt_column or "prompt", self.response_column or "response")
        elif label_column is None and "messages" in names:
            fmt = ("messages", "messages")
        elif label_column is None and "prompt" in names and "response" in names:
            fmt = ("prompt-response", "prompt", "response")
        if fmt is None:
            if self.chat_template is not None:
                raise train.error(f"--chat-template {self.chat_template} is for instruction data, and the "
                                  "data have neither a 'messages' column nor 'prompt' and 'response' columns "
                                  f"(the columns are: {', '.join(names) or '(none)'})")
            return None
        if text_pair_column is not None:
            raise SpecError(f"--text-pair-column {text_pair_column!r} is for sentence-pair classification, "
                            "not instruction data")
        for column in fmt[1:]:
            train.column(column)
        return fmt


def _with_template(info: Mapping[str, Any], text: str) -> dict[str, Any]:
    """``info`` with the chat template's contents joined to its ``fingerprint``: the same data rendered with
    another template are other samples."""
    fingerprint = info.get("fingerprint")
    if fingerprint is None:
        return dict(info)
    return {**info, "fingerprint": _combine([fingerprint, f"chat_template={_combine([text])}"])}


def _held_out(train: Records, n: int, eval_split: float, seed: int,
              what: str) -> tuple[np.ndarray, np.ndarray]:
    """A seeded hold-out of ``eval_split`` of ``n`` documents or examples (``what``): the positions kept for
    training and those held out for evaluation, each in file order; none held out, or none left, is one
    line."""
    k = round(n * eval_split)
    if k == 0:
        raise train.error(f"too few {what} to hold out eval_split={eval_split} of {n} for evaluation; "
                          "give --eval-file or raise --eval-split")
    if k == n:
        raise train.error(f"holding out eval_split={eval_split} of {n} {what} leaves none to train on; "
                          "lower --eval-split")
    order = _rng(seed, 0).permutation(n)
    return np.sort(order[k:]), np.sort(order[:k])


def _build_instruct(train: Records, evals: Records | None, tok: Any, max_length: int, fmt: tuple[str, ...],
                    template: Any, eval_split: float, seed: int, max_train: int | None, max_eval: int | None,
                    common: dict[str, Any]) -> tuple[RaggedDataset, RaggedDataset]:
    """Instruction data: the examples of each split (the evaluation file's, else a seeded hold-out of whole
    examples of the training rows, each split in file order)."""
    if evals is None:
        kept, held = _held_out(train, len(train), eval_split, seed, "examples")
        parts = (_subset(train, kept), _subset(train, held))
    else:
        parts = (train, evals)
    meta = {**common, "kind": "causal-lm", "num_labels": None, "label_names": None}
    out = []
    for split, part, cap in (("train", parts[0], max_train), ("eval", parts[1], max_eval)):
        kw = dict(chat_template=template, max_examples=cap, records=part,
                  info={**meta, "split": split, "rows": len(part)},
                  label=f"the {split} examples of {train.option} {train.source}")
        if fmt[0] == "messages":
            out.append(chat_dataset(part.column(fmt[1]), tok, max_length, column=fmt[1], **kw))
        else:
            out.append(prompt_response_dataset(part.column(fmt[1]), part.column(fmt[2]), tok, max_length,
                                               columns=(fmt[1], fmt[2]), **kw))
    return out[0], out[1]


def _subset(records: Records, rows: Sequence[int]) -> Records:
    """The rows ``rows`` of ``records`` (each still named by its place in the file)."""
    columns = {k: [v[i] for i in rows] for k, v in records.columns.items()}
    return Records(records.source, records.option, columns, [records.lines[i] for i in rows],
                   unit=records.unit, column_names=records.column_names,
                   text_limit=records.text_limit, read_as=records.read_as)


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


