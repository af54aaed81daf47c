"""Reading the user's data files into rows (:func:`read_records`), and fingerprints of their bytes.

* **Formats** (:data:`SUPPORTED_EXTENSIONS`, chosen by the file's extension): ``.jsonl``, ``.json``, ``.csv``,
  ``.tsv``, ``.txt`` (column ``text``: one document per line, per paragraph or the whole file, see
  :data:`TXT_UNITS`) and ``.parquet`` (needs ``pyarrow``).
* **Only regular files** are read: a directory, a FIFO, a device or a socket is refused at once (a FIFO would
  block the reader forever), and so is a symbolic link that loops or points nowhere.
* **Bounded lines**: the line-based formats (``.jsonl``, ``.csv``, ``.tsv``, ``.txt``) are read line by line,
  at most :data:`MAX_LINE_BYTES` (4 MiB) at a time; a longer line, or a longer text value in a ``.json`` or
  ``.parquet`` file, is an error naming its line (or record, or row), so that a file that never ends a line
  (a sparse file of zero bytes) is refused at once, not read whole. A ``.txt`` document of many lines (a
  paragraph, the whole file) may be longer: a long document is tokenized in bounded pieces
  (:mod:`aqsgd.data.datasets.pieces`). A ``.json`` file is parsed whole and may be at most
  :data:`MAX_JSON_BYTES` (1 GiB); larger data go in ``.jsonl``.
* **Progress**: reading a large file logs how far it got every few seconds.

Bad input raises a one-line :class:`~aqsgd.errors.DataFileError` naming the option, the file, the problem and,
where it has one, the line.
"""

from __future__ import annotations

import codecs
import csv
import errno
import hashlib
import itertools
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqsgd.data.datasets.base import PathLike
from aqsgd.errors import DataFileError, SpecError
from aqsgd.logs import ProgressLog

__all__ = ["MAX_JSON_BYTES", "MAX_LINE_BYTES", "SUPPORTED_EXTENSIONS", "TXT_UNITS", "Records",
           "data_fingerprint", "read_records"]

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet")
"""The data file types :func:`read_records` reads, by extension (case-insensitive)."""
MAX_LINE_BYTES = 4 << 20
"""The longest line of a line-based data file, in bytes (4 MiB); also the longest text value, in
characters."""
MAX_JSON_BYTES = 1 << 30
"""The largest ``.json`` file (1 GiB): it is parsed whole; larger data go in ``.jsonl``, read line by line."""
TXT_UNITS = {"line": "one per line", "paragraph": "one per paragraph: lines up to a blank line",
             "file": "the whole file as one document"}
"""How a ``.txt`` file is cut into documents (``txt_unit``), and how the log says it: ``line`` (the default),
``paragraph`` (blank-line separated) or ``file``."""

log = logging.getLogger(__name__)
_Fail = Callable[[str], DataFileError]
_LIMIT = f"{MAX_LINE_BYTES >> 20} MiB"

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
            lacks the column), Python values for ``.parquet``; lists and objects stay as they are (a
            ``messages`` column of instruction data).
        column_names: every column of the source (a hub split is read only for the columns needed, so this
            may name more than ``columns`` holds).
        lines: for each row, its 1-based line number in the file (``.jsonl``, ``.csv``, ``.tsv``, ``.txt``),
            or its 1-based position (``.json`` record or row, ``.parquet`` row, hub row); ``unit`` says which.
        unit: ``"line"``, ``"record"`` or ``"row"``: what the numbers in ``lines`` count (a ``.txt``
            paragraph's or file's number is its first line).
        text_limit: the longest text value, in characters (None: any length): :data:`MAX_LINE_BYTES`, but
            none for the documents of several lines of a ``.txt`` file (each line is bounded as it is read).
        read_as: how the rows were read, for the log (``4,512 lines read as 310 documents (...)``); by
            default the number of rows and the columns.
    """

    def __init__(self, source: str, option: str, columns: Mapping[str, list[Any]], lines: Sequence[int], *,
                 unit: str = "line", column_names: Sequence[str] | None = None,
                 text_limit: int | None = MAX_LINE_BYTES, read_as: str | None = None) -> None:
        self.source = source
        self.option = option
        self.columns: dict[str, list[Any]] = dict(columns)
        self.lines: list[int] = list(lines)
        self.unit = unit
        self.column_names: list[str] = list(self.columns if column_names is None else column_names)
        self.text_limit = text_limit
        self.read_as = read_as or f"{len(self.lines):,} {_plural(len(self.lines), unit)} with columns " \
                                  f"{', '.join(self.column_names)}"

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


def read_records(path: PathLike, *, option: str = "--train-file", txt_unit: str = "line") -> Records:
    """The rows of a data file, by its extension (one of :data:`SUPPORTED_EXTENSIONS`).

    * ``.jsonl``: one JSON object per line; blank lines are skipped. Rows may differ in their keys (a missing
      key reads as ``None``).
    * ``.json``: a JSON list of objects; an object whose ``"data"`` is a list of objects; or an object of
      equal-length column lists (``{"text": [...], "label": [...]}``). A ``.json`` file that holds JSON Lines
      is read as ``.jsonl``.
    * ``.csv`` / ``.tsv``: a header row, then one row per line (comma / tab separated, ``"`` quoting,
      quoted fields may span lines); blank lines are skipped; every value is a string.
    * ``.txt``: documents in the column ``text``, as ``txt_unit`` (:data:`TXT_UNITS`) says: one per line
      (``line``, the default), one per paragraph (``paragraph``: the lines up to a blank line, joined with
      ``\\n``) or one (``file``: every line, joined with ``\\n``, without the blank lines at the start and
      end); blank lines are never a document. Line endings (``\\n``, ``\\r\\n``) are not part of a line.
    * ``.parquet``: read with ``pyarrow`` (``pip install pyarrow``).

    Text files must be UTF-8 (a leading byte-order mark is ignored). ``option`` is the option that named the
    file, for messages. Raises a one-line :class:`~aqsgd.errors.DataFileError` for a missing file, a
    directory, an unknown extension, a file that is not UTF-8, a malformed line and a file without rows, and a
    :class:`~aqsgd.errors.SpecError` for a ``txt_unit`` that is not one of :data:`TXT_UNITS`.
    """
    if txt_unit not in TXT_UNITS:
        raise SpecError(f"txt_unit {txt_unit!r} is not one of {', '.join(TXT_UNITS)}")
    p = Path(path)
    source = str(path)

    def fail(problem: str) -> DataFileError:
        return _error(option, source, problem)

    fail.what = f"{option} {source}"  # type: ignore[attr-defined] - what progress lines name

    _check_regular_file(p, fail)
    ext = p.suffix.lower()
    if ext not in SUPPORTED_EXTENSIONS:
        kind = f"unknown file type {ext!r}" if ext else "no file extension"
        raise fail(f"{kind}; the supported ones are: {', '.join(SUPPORTED_EXTENSIONS)}")
    try:
        if ext == ".txt":
            records = _txt_records(p, fail, txt_unit, source, option)
        else:
            columns, lines, unit = _READERS[ext](p, fail)
            records = Records(source, option, columns, lines, unit=unit)
    except OSError as e:
        raise fail(f"cannot read it: {e.strerror or e}") from None
    if not len(records):
        raise fail("no rows (the file holds no data)")
    return records


_Read = tuple[dict[str, list[Any]], list[int], str]
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _check_regular_file(p: Path, fail: _Fail) -> None:
    """A regular file (through symbolic links), or a one-line error saying what it is instead."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise fail("a symbolic link to a file that does not exist" if p.is_symlink()
                   else "no such file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise fail("a symbolic link loop (it points back to itself)") from None
        raise fail(f"cannot read it: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise fail("is a directory, not a data file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise fail(f"is {kind}, not a regular file; save the data to a file first")


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
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise fail(f"{size / 2**30:.1f} GiB: a .json file is parsed whole and may be at most "
                   f"{MAX_JSON_BYTES >> 30} GiB; save large data as .jsonl (one object per line)")
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
    csv.field_size_limit(MAX_LINE_BYTES)  # whole documents can exceed the default 128 KiB per field
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
            if "field larger than field limit" in str(e):
                raise fail(f"a field that starts at line {end + 1} is longer than {_LIMIT}, the limit for "
                           "one text; split long documents into paragraphs") from None
            raise fail(f"line {reader.line_num} is malformed {kind}: {e}") from None
    finally:
        csv.field_size_limit(limit)
    if header is None:
        raise fail("no rows (the file is empty)")
    if not rows:
        raise fail("no rows below the header")
    return {name: [r[j] for r in rows] for j, name in enumerate(header)}, lines, "line"


def _txt_records(path: Path, fail: _Fail, unit: str, source: str, option: str) -> Records:
    """The documents of a ``.txt`` file, cut as ``unit`` says, each numbered by the line it starts at."""
    texts: list[str] = []
    starts: list[int] = []
    held: list[str] = []  # the lines of the paragraph (or file) being read, from its first non-blank one
    trailing = 0  # how many of them at the end are blank (a file's last lines)
    n = 0
    for n, line in enumerate(_decoded_lines(path, fail), 1):
        line = line.removesuffix("\n").removesuffix("\r")
        blank = not line.strip()
        if unit == "line":
            if not blank:
                texts.append(line)
                starts.append(n)
        elif blank and unit == "paragraph":
            if held:
                texts.append("\n".join(held))
                held = []
        elif held or not blank:
            if not held:
                starts.append(n)
            held.append(line)
            trailing = trailing + 1 if blank else 0
    if held:
        texts.append("\n".join(held[:len(held) - trailing]))
    how = TXT_UNITS[unit] + ("; --txt-unit paragraph or file reads paragraphs or the whole file"
                             if unit == "line" else "")
    read_as = f"{n:,} {_plural(n, 'line')} read as {len(texts):,} {_plural(len(texts), 'document')} ({how})"
    return Records(source, option, {"text": texts}, starts, read_as=read_as,
                   text_limit=MAX_LINE_BYTES if unit == "line" else None)


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
    ".parquet": _read_parquet,
}


def _decoded_lines(path: Path, fail: _Fail) -> Iterator[str]:
    """The file's lines (split at ``\\n`` only, endings kept) decoded as UTF-8, streamed, each at most
    :data:`MAX_LINE_BYTES` long (a longer one is an error naming it); progress is logged for a large file."""
    offset = 0
    size = os.stat(path).st_size
    progress = ProgressLog(log, f"reading {getattr(fail, 'what', path)}", total=size / 1e6, unit="MB")
    with open(path, "rb") as f:
        for n in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise fail(f"line {n} is longer than {_LIMIT}, the limit for one line; split long documents "
                           "into paragraphs, one per line")
            progress.update((offset + len(raw)) / 1e6)
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
# messages
# --------------------------------------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return word if n == 1 else f"{word}s"


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

