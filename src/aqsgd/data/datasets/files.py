"""The user's own data as aqsgd datasets: local files (:func:`load_text_files`) or a Hugging Face hub data set
(:func:`load_hub_dataset`), read the way Hugging Face's ``run_clm.py`` / ``run_glue.py`` examples read them.

* **Formats** (:data:`SUPPORTED_EXTENSIONS`, chosen by the file's extension; see :func:`read_records`):
  ``.jsonl``, ``.json``, ``.csv``, ``.tsv``, ``.txt`` (one document per line, column ``text``) and
  ``.parquet`` (needs ``pyarrow``).
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

import codecs
import copy
import csv
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqsgd.data.datasets.base import DictDataset, PathLike
from aqsgd.data.datasets.batching import _rng, stratified_split
from aqsgd.data.datasets.hub import _hub_probe
from aqsgd.data.datasets.text import _document_separator, lm_chunks, load_tokenizer, text_classification
from aqsgd.errors import DataFileError, SpecError

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "Records",
    "data_fingerprint",
    "load_hub_dataset",
    "load_text_files",
    "read_records",
]

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet")
"""The data file types :func:`read_records` reads, by extension (case-insensitive)."""

_INT = re.compile(r"-?(0|[1-9][0-9]*)")  # an integer written the one canonical way ("01" and "+1" are text)
_SHOWN_LABELS = 20  # how many training labels an "unknown label" message lists

log = logging.getLogger(__name__)
_Fail = Callable[[str], DataFileError]


# --------------------------------------------------------------------------------------------------
# records: the rows of one file, column by column
# --------------------------------------------------------------------------------------------------


class Records:
    """The rows of one data source, held column by column, with where each row is in the source.

    Attributes:
        source: the file as given (or the hub data set and split), as messages name it.
        option: the option that named the source (``--train-file``, ``--eval-file``, ``--dataset``).
        columns: column name -> one value per row, in the source's order. Values are what the format gives:
            strings for ``.csv``/``.tsv``/``.txt``, JSON values for ``.json``/``.jsonl`` (``None`` where a row
            lacks the column), Python values for ``.parquet``.
        column_names: every column of the source (a hub split is read only for the columns needed, so this
            may name more than ``columns`` holds).
        lines: for each row, its 1-based line number in the file (``.jsonl``, ``.csv``, ``.tsv``, ``.txt``),
            or its 1-based position (``.json`` record or row, ``.parquet`` row, hub row); ``unit`` says which.
        unit: ``"line"``, ``"record"`` or ``"row"``: what the numbers in ``lines`` count.
    """

    def __init__(self, source: str, option: str, columns: Mapping[str, list[Any]], lines: Sequence[int], *,
                 unit: str = "line", column_names: Sequence[str] | None = None) -> None:
        self.source = source
        self.option = option
        self.columns: dict[str, list[Any]] = dict(columns)
        self.lines: list[int] = list(lines)
        self.unit = unit
        self.column_names: list[str] = list(self.columns if column_names is None else column_names)

    def __len__(self) -> int:
        return len(self.lines)

    def __repr__(self) -> str:
        return f"Records({self.option} {self.source}: {len(self)} rows, columns {self.column_names})"

    def where(self, row: int) -> str:
        """Where row ``row`` (0-based) is in the source: ``line 12``, ``record 3`` or ``row 7``."""
        return f"{self.unit} {self.lines[row]}"

    def error(self, problem: str) -> DataFileError:
        """A one-line error about this source: ``{option} {source}: {problem}``."""
        return _error(self.option, self.source, problem)

    def column(self, name: str) -> list[Any]:
        """The values of column ``name``; a DataFileError listing the columns there are if it is missing."""
        if name not in self.columns:
            there = ", ".join(self.column_names) or "(none)"
            raise self.error(f"no column {name!r}; the columns are: {there}")
        return self.columns[name]


def read_records(path: PathLike, *, option: str = "--train-file") -> Records:
    """The rows of a data file, by its extension (one of :data:`SUPPORTED_EXTENSIONS`).

    * ``.jsonl``: one JSON object per line; blank lines are skipped. Rows may differ in their keys (a missing
      key reads as ``None``).
    * ``.json``: a JSON list of objects; an object whose ``"data"`` is a list of objects; or an object of
      equal-length column lists (``{"text": [...], "label": [...]}``). A ``.json`` file that holds JSON Lines
      is read as ``.jsonl``.
    * ``.csv`` / ``.tsv``: a header row, then one row per line (comma / tab separated, ``"`` quoting,
      quoted fields may span lines); blank lines are skipped; every value is a string.
    * ``.txt``: one document per line in the column ``text``; blank lines are skipped.
    * ``.parquet``: read with ``pyarrow`` (``pip install pyarrow``).

    Text files must be UTF-8 (a leading byte-order mark is ignored). ``option`` is the option that named the
    file, for messages. Raises a one-line :class:`~aqsgd.errors.DataFileError` for a missing file, a
    directory, an unknown extension, a file that is not UTF-8, a malformed line and a file without rows.
    """
    p = Path(path)
    source = str(path)

    def fail(problem: str) -> DataFileError:
        return _error(option, source, problem)

    if not p.exists():
        raise fail("no such file")
    if p.is_dir():
        raise fail("is a directory, not a data file")
    ext = p.suffix.lower()
    if ext not in SUPPORTED_EXTENSIONS:
        kind = f"unknown file type {ext!r}" if ext else "no file extension"
        raise fail(f"{kind}; the supported ones are: {', '.join(SUPPORTED_EXTENSIONS)}")
    try:
        columns, lines, unit = _READERS[ext](p, fail)
    except OSError as e:
        raise fail(f"cannot read it: {e.strerror or e}") from None
    records = Records(source, option, columns, lines, unit=unit)
    if not len(records):
        raise fail("no rows (the file holds no data)")
    return records


_Read = tuple[dict[str, list[Any]], list[int], str]


def _read_jsonl(path: Path, fail: _Fail) -> _Read:
    return _parse_json_lines(enumerate(_decoded_lines(path, fail), 1), fail)


def _parse_json_lines(numbered: Iterable[tuple[int, str]], fail: _Fail) -> _Read:
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for n, line in numbered:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise fail(f"line {n} is not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise fail(f"line {n} is {_describe(obj)}, not a JSON object")
        rows.append(obj)
        lines.append(n)
    return _rows_to_columns(rows), lines, "line"


def _read_json(path: Path, fail: _Fail) -> _Read:
    text = _decode_all(path.read_bytes(), fail)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and _starts_with_object_line(text):
            return _parse_json_lines(enumerate(text.split("\n"), 1), fail)  # JSON Lines in a .json file
        if not text.strip():
            return {}, [], "record"
        raise fail(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list) \
            and all(isinstance(r, dict) for r in data["data"]):
        data = data["data"]
    if isinstance(data, list):
        for i, r in enumerate(data):
            if not isinstance(r, dict):
                raise fail(f"record {i + 1} of the list is {_describe(r)}, not a JSON object")
        return _rows_to_columns(data), list(range(1, len(data) + 1)), "record"
    if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) > 1:
            sizes = ", ".join(f"{k!r} {n}" for k, n in lengths.items())
            raise fail(f"the column lists differ in length: {sizes}")
        n = next(iter(lengths.values()), 0)
        return dict(data), list(range(1, n + 1)), "row"
    raise fail(f"holds {_describe(data)}; expected a list of objects, an object with a \"data\" list of "
               "objects, or an object of equal-length column lists")


def _starts_with_object_line(text: str) -> bool:
    first = next((line for line in text.split("\n") if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _read_delimited(path: Path, fail: _Fail, delimiter: str) -> _Read:
    kind = "TSV" if delimiter == "\t" else "CSV"
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, 2**31 - 1))  # whole documents can exceed the default 128 KiB per field
    try:
        reader = csv.reader(_decoded_lines(path, fail), delimiter=delimiter)
        header: list[str] | None = None
        rows: list[list[str]] = []
        lines: list[int] = []
        end = 0
        try:
            for row in reader:
                start, end = end + 1, reader.line_num  # quoted fields may span lines: the row starts at start
                if not row:
                    continue  # a blank line
                if header is None:
                    header = row
                    seen: set[str] = set()
                    for name in header:
                        if name in seen:
                            raise fail(f"the header (line {start}) names the column {name!r} twice")
                        seen.add(name)
                    continue
                if len(row) != len(header):
                    fields = f"{len(row)} field" + ("" if len(row) == 1 else "s")
                    raise fail(f"line {start} has {fields}, the header has {len(header)}")
                rows.append(row)
                lines.append(start)
        except csv.Error as e:
            raise fail(f"line {reader.line_num} is malformed {kind}: {e}") from None
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise fail("no rows (the file is empty)")
    if not rows:
        raise fail("no rows below the header")
    return {name: [r[j] for r in rows] for j, name in enumerate(header)}, lines, "line"


def _read_txt(path: Path, fail: _Fail) -> _Read:
    texts: list[str] = []
    lines: list[int] = []
    for n, line in enumerate(_decoded_lines(path, fail), 1):
        line = line.removesuffix("\n").removesuffix("\r")
        if line.strip():
            texts.append(line)
            lines.append(n)
    return {"text": texts}, lines, "line"


def _read_parquet(path: Path, fail: _Fail) -> _Read:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise fail("reading .parquet files needs pyarrow: run `pip install pyarrow`") from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, ValueError) as e:  # ArrowInvalid for a file that is not Parquet
        raise fail(f"not a readable Parquet file ({_first_line(e)})") from None
    return table.to_pydict(), list(range(1, table.num_rows + 1)), "row"


_READERS: dict[str, Callable[[Path, _Fail], _Read]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": lambda p, fail: _read_delimited(p, fail, ","),
    ".tsv": lambda p, fail: _read_delimited(p, fail, "\t"),
    ".txt": _read_txt,
    ".parquet": _read_parquet,
}


def _decoded_lines(path: Path, fail: _Fail) -> Iterator[str]:
    """The file's lines (split at ``\\n`` only, endings kept) decoded as UTF-8, streamed."""
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            skip = len(codecs.BOM_UTF8) if n == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as e:
                at = skip + e.start
                raise fail(f"not UTF-8 text: byte 0x{raw[at]:02x} at line {n} (byte offset {offset + at}); "
                           "save the file as UTF-8") from None
            offset += len(raw)
            yield text


def _decode_all(raw: bytes, fail: _Fail) -> str:
    skip = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        line = raw.count(b"\n", 0, at) + 1
        raise fail(f"not UTF-8 text: byte 0x{raw[at]:02x} at line {line} (byte offset {at}); "
                   "save the file as UTF-8") from None


def _rows_to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    names: dict[str, None] = {}
    for r in rows:
        for k in r:
            names.setdefault(k)
    return {k: [r.get(k) for r in rows] for k in names}


# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------


def data_fingerprint(*paths: PathLike) -> str:
    """A hex SHA-256 fingerprint of data files' bytes (read in blocks), to refuse resuming on changed data.

    One file: the SHA-256 of its bytes (what ``sha256sum`` prints). Several: the SHA-256 of their digests,
    one per line, in the order given (so swapping the training and evaluation files changes it). Raises
    ``OSError`` for a file that cannot be read.
    """
    if not paths:
        raise SpecError("data_fingerprint needs at least one file")
    digests = [_sha256(p) for p in paths]
    return digests[0] if len(digests) == 1 else _combine(digests)


def _sha256(path: PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _combine(parts: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


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
        tokenizer_for: instead of ``tokenizer``, ``tokenizer_for(kind)`` gives the tokenizer once the data's kind
            (``causal-lm`` / ``sequence-classification``) is known, e.g. that of the kind's default model.
        max_length: tokens per sample: padded/truncated length (classification) or chunk length (LM).
        text_column: the column holding the text.
        text_pair_column: the column holding the second text of sentence-pair classification.
        label_column: the column holding the class label (strings or integers); must exist when given.
            ``None``: ``label`` where the training data have it, else the data are causal-LM text.
        eval_split: share of the training rows held out for evaluation when there is no ``eval_file``.
        seed: seed of the hold-out.
        max_train_samples, max_eval_samples: keep only the first N samples (LM: chunks) of each split;
            ``None`` keeps all.

    Both datasets' ``info`` hold ``kind`` (``causal-lm`` / ``sequence-classification``), ``num_labels`` and
    ``label_names`` (``None`` for LM), ``source`` (``files``), ``train_file``, ``eval_file``, the columns,
    ``fingerprint`` (:func:`data_fingerprint` of the training file, and of the evaluation file if given),
    ``fingerprints`` (per file), ``rows_read`` (rows read per file), ``rows`` (source rows in this split),
    ``split``, ``seed``, ``eval_split`` (``None`` with an evaluation file), plus the builders' metadata.

    Raises a one-line :class:`~aqsgd.errors.DataFileError` for bad data, a
    :class:`~aqsgd.errors.SpecError` for a bad argument.
    """
    train = read_records(train_file, option="--train-file")
    evals = None if eval_file is None else read_records(eval_file, option="--eval-file")
    digests = {"train": _sha256(train_file)}
    if eval_file is not None:
        digests["eval"] = _sha256(eval_file)
    info = {
        "source": "files",
        "train_file": str(train_file),
        "eval_file": None if eval_file is None else str(eval_file),
        "fingerprint": digests["train"] if eval_file is None else _combine(list(digests.values())),
        "fingerprints": digests,
    }
    return _logged(train, evals, tokenizer=tokenizer, tokenizer_for=tokenizer_for, max_length=max_length, text_column=text_column,
                  text_pair_column=text_pair_column, label_column=label_column, eval_split=eval_split,
                  seed=seed, max_train_samples=max_train_samples, max_eval_samples=max_eval_samples,
                  info=info)


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
    return _logged(train, evals, tokenizer=tokenizer, tokenizer_for=tokenizer_for, max_length=max_length, text_column=text_column,
                  text_pair_column=text_pair_column, label_column=label, eval_split=eval_split, seed=seed,
                  max_train_samples=max_train_samples, max_eval_samples=max_eval_samples, info=info,
                  class_names=class_names)


def _hub_records(ds: Any, spec: str, split: str, wanted: Sequence[str]) -> Records:
    names = list(ds.column_names)
    columns = {c: list(ds[c]) for c in wanted if c in names}
    return Records(f"{spec} ({split} split)", "--dataset", columns, range(1, len(ds) + 1), unit="row",
                   column_names=names)


# --------------------------------------------------------------------------------------------------
# from records to datasets
# --------------------------------------------------------------------------------------------------


def _logged(train: Records, evals: Records | None, **kw: Any) -> tuple[DictDataset, DictDataset]:
    """:func:`_build`, with what was read and what it became in the log (tokenizing a large file takes a while)."""
    log.info("%s %s: %d %ss with columns %s%s; tokenizing", train.option, train.source, len(train), train.unit,
             ", ".join(train.column_names), "" if evals is None else f" (evaluation: {len(evals)} {evals.unit}s)")
    out = _build(train, evals, **kw)
    log.info("data: %d training and %d evaluation samples (%s)", len(out[0]), len(out[1]), out[0].info.get("kind"))
    return out


def _build(train: Records, evals: Records | None, *, tokenizer: Any, tokenizer_for: Callable[[str], Any] | None,
           max_length: int, text_column: str,
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
    separator = _document_separator(tok)
    if separator is None:
        separator = getattr(tok, "sep_token_id", None)
    meta = {**common, "kind": "causal-lm", "num_labels": None, "label_names": None}
    train_ds = _chunks(train, f"the training documents ({len(train_docs)})", train_docs, tok, max_length,
                       separator, max_train, {**meta, "split": "train", "rows": len(train_docs)})
    eval_ds = _chunks(train if evals is None else evals, eval_what, eval_docs, tok, max_length, separator,
                      max_eval, {**meta, "split": "eval", "rows": len(eval_docs)})
    return train_ds, eval_ds


def _documents(records: Records, column: str) -> list[str]:
    docs = [t for t in _texts(records, column) if t.strip()]
    if not docs:
        raise records.error(f"no text: every {column!r} value is blank")
    return docs


def _chunks(records: Records, what: str, docs: list[str], tok: Any, max_length: int, separator: int | None,
            max_chunks: int | None, info: dict[str, Any]) -> DictDataset:
    try:
        return lm_chunks(docs, tok, max_length, eos_token_id=separator, add_eos=separator is not None,
                         max_chunks=max_chunks, info=info)
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
                                       label_names=names, info={**meta, "split": split, "rows": rows}))
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


# --------------------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------------------


def _error(option: str, source: str, problem: str) -> DataFileError:
    return DataFileError(" ".join(f"{option} {source}: {problem}".splitlines()))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"
