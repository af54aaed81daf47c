"""The user's own data files (and hub data sets) as datasets: every format, causal LM and classification,
evaluation files and hold-outs, stable sample ids, fingerprints, and the one-line errors for bad input."""

from __future__ import annotations

import csv
import hashlib
import json
import socket
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from aqsgd.data import (
    SUPPORTED_EXTENSIONS,
    DataFileError,
    data_fingerprint,
    load_hub_dataset,
    load_text_files,
    read_records,
)
from aqsgd.data.datasets import stratified_split
from aqsgd.errors import DataSourceError, SpecError

from .conftest import WORDS

EOS, PAD, UNK, CLS, SEP = 2, 0, 1, 3, 4

ROWS = [
    {"text": "a b c", "label": "pos"},
    {"text": "d e, f", "label": "neg"},  # a comma: quoting in CSV
    {"text": "g h", "label": "pos"},
    {"text": "i j k l", "label": "neg"},
]


def ids(text: str) -> list[int]:
    return [WORDS.index(w) + 5 for w in text.split()]


def name(i: int) -> str:
    """A distinct three-letter text per row index, so a sample's tokens tell which row it came from."""
    return " ".join(WORDS[(i // 26 ** k) % 26] for k in (2, 1, 0))


def write(path: Path, rows: list[dict], fmt: str | None = None) -> Path:
    """Write ``rows`` in the format of ``path``'s extension (``fmt`` picks a .json layout)."""
    ext = path.suffix
    if ext == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif ext == ".json":
        cols = {k: [r[k] for r in rows] for k in rows[0]}
        data = {"list": rows, "data": {"version": 1, "data": rows}, "columns": cols}[fmt or "list"]
        path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    elif ext in (".csv", ".tsv"):
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if ext == ".tsv" else ",")
            w.writeheader()
            w.writerows(rows)
    elif ext == ".txt":
        path.write_text("".join(r["text"] + "\n" for r in rows), encoding="utf-8")
    elif ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise AssertionError(ext)
    return path


def message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "\r" not in text, text
    return text


def same(a, b) -> bool:
    return a.columns.keys() == b.columns.keys() and all(torch.equal(v, b.columns[k])
                                                        for k, v in a.columns.items())


def rows_of(ds, n_tokens: int = 3) -> list[tuple[int, ...]]:
    """Each sample's first text tokens (after [CLS]): which row it came from."""
    return [tuple(r[1:1 + n_tokens]) for r in ds.columns["input_ids"].tolist()]


# ---------------------------------------------------------------------------------------------- formats


FORMATS = [(".jsonl", None), (".json", "list"), (".json", "data"), (".json", "columns"), (".csv", None),
           (".tsv", None), (".parquet", None)]


@pytest.mark.parametrize("ext,fmt", FORMATS)
def test_every_format_reads_the_same_rows(tmp_path, ext, fmt):
    rec = read_records(write(tmp_path / f"d{ext}", ROWS, fmt))
    assert rec.column_names == ["text", "label"] and len(rec) == 4
    assert rec.column("text") == [r["text"] for r in ROWS]
    assert rec.column("label") == [r["label"] for r in ROWS]
    expected_unit = {".json": "row" if fmt == "columns" else "record", ".parquet": "row"}.get(ext, "line")
    assert rec.unit == expected_unit
    assert rec.where(0) == f"{expected_unit} {rec.lines[0]}"
    assert SUPPORTED_EXTENSIONS == (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet")


def test_line_numbers_skip_blank_lines_and_follow_multiline_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n   \n{"text": "b"}\r\n', encoding="utf-8")
    assert read_records(p).lines == [1, 4] and read_records(p).column("text") == ["a", "b"]
    p = tmp_path / "d.csv"
    p.write_text('text,label\n"a\nb",x\n\nc,y\n', encoding="utf-8")
    rec = read_records(p)
    assert rec.column("text") == ["a\nb", "c"] and rec.lines == [2, 5]
    p = tmp_path / "d.txt"
    p.write_text("first doc\n\n  \nsecond doc\r\nthird\n", encoding="utf-8")
    rec = read_records(p)
    assert rec.column_names == ["text"] and rec.column("text") == ["first doc", "second doc", "third"]
    assert rec.lines == [1, 4, 5]


def test_byte_order_mark_and_jsonl_inside_a_json_file(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbftext,label\na,x\n")
    assert read_records(p).column_names == ["text", "label"]
    p = tmp_path / "lines.json"
    p.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": 0}\n', encoding="utf-8")
    rec = read_records(p)
    assert rec.column("label") == [1, 0] and rec.unit == "line" and rec.lines == [1, 2]
    p = tmp_path / "ragged.jsonl"  # rows with different keys: a missing key reads as None
    p.write_text('{"text": "a"}\n{"text": "b", "extra": 1}\n', encoding="utf-8")
    assert read_records(p).columns == {"text": ["a", "b"], "extra": [None, 1]}


# -------------------------------------------------------------------------------------- classification


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".tsv", ".parquet"])
def test_classification_with_string_labels_from_every_format(tmp_path, word_tokenizer, ext):
    train = write(tmp_path / f"train{ext}", ROWS)
    evals = write(tmp_path / f"eval{ext}", ROWS[:2])
    tr, ev = load_text_files(train, evals, tokenizer=word_tokenizer, max_length=8)
    assert len(tr) == 4 and len(ev) == 2
    assert tr.columns["labels"].tolist() == [1, 0, 1, 0]  # sorted: neg=0, pos=1; file order kept
    assert ev.columns["labels"].tolist() == [1, 0]
    assert tr[0]["input_ids"].tolist() == [CLS, *ids("a b c"), SEP, PAD, PAD, PAD]
    assert tr[1]["input_ids"].tolist()[:7] == [CLS, *ids("d e"), UNK, *ids("f"), SEP, PAD]  # "," is unknown
    for ds, split in ((tr, "train"), (ev, "eval")):
        info = ds.info
        assert info["kind"] == "sequence-classification" and info["num_labels"] == 2
        assert info["label_names"] == ["neg", "pos"] and info["pad_token_id"] == PAD
        assert info["train_file"] == str(train) and info["eval_file"] == str(evals)
        assert info["text_column"] == "text" and info["label_column"] == "label"
        assert info["text_pair_column"] is None and info["split"] == split
        assert info["rows_read"] == {"train": 4, "eval": 2} and info["eval_split"] is None
        assert info["fingerprint"] == data_fingerprint(train, evals)
        assert info["fingerprints"] == {"train": data_fingerprint(train), "eval": data_fingerprint(evals)}
    assert tr[3]["sample_id"] == 3


def test_integer_labels_keep_their_values_and_sort_numerically(tmp_path, word_tokenizer):
    rows = [{"text": name(i), "label": i % 12} for i in range(24)]
    tr, _ = load_text_files(write(tmp_path / "t.jsonl", rows), tokenizer=word_tokenizer, max_length=6,
                            eval_split=0.5)
    assert tr.info["label_names"] == [str(i) for i in range(12)] and tr.info["num_labels"] == 12
    by_row = {tuple(ids(name(i))): i % 12 for i in range(24)}
    assert [by_row[r] for r in rows_of(tr)] == tr.columns["labels"].tolist()
    # the same labels from CSV (strings that spell integers) give the same classes in numeric order
    tr_csv, _ = load_text_files(write(tmp_path / "t.csv", rows), tokenizer=word_tokenizer, max_length=6,
                                eval_split=0.5)
    assert tr_csv.info["label_names"] == tr.info["label_names"] and same(tr, tr_csv)


def test_mixed_and_boolean_labels_become_strings(tmp_path, word_tokenizer):
    rows = [{"text": "a", "label": 1}, {"text": "b", "label": "x"}, {"text": "c", "label": 1.0}]
    tr, ev = load_text_files(write(tmp_path / "t.jsonl", rows), write(tmp_path / "e.jsonl", rows[:1]),
                             tokenizer=word_tokenizer, max_length=4)
    assert tr.info["label_names"] == ["1", "x"] and tr.columns["labels"].tolist() == [0, 1, 0]
    assert ev.columns["labels"].tolist() == [0]
    rows = [{"text": "a", "label": True}, {"text": "b", "label": False}]
    tr, _ = load_text_files(write(tmp_path / "b.jsonl", rows), write(tmp_path / "be.jsonl", rows),
                            tokenizer=word_tokenizer, max_length=4)
    assert tr.info["label_names"] == ["false", "true"] and tr.columns["labels"].tolist() == [1, 0]


def test_sentence_pairs_and_named_columns(tmp_path, word_tokenizer):
    rows = [{"q": "a b", "s": "c", "y": "yes"}, {"q": "d", "s": "e f", "y": "no"}]
    tr, _ = load_text_files(write(tmp_path / "p.csv", rows), write(tmp_path / "pe.csv", rows),
                            tokenizer=word_tokenizer, max_length=8, text_column="q", text_pair_column="s",
                            label_column="y")
    assert tr[0]["input_ids"].tolist() == [CLS, *ids("a b"), SEP, *ids("c"), SEP, PAD, PAD]
    assert tr[0]["token_type_ids"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert tr.info["label_names"] == ["no", "yes"] and tr.info["text_pair_column"] == "s"
    assert tr.columns["labels"].tolist() == [1, 0]


def test_hold_out_is_stratified_seeded_and_keeps_file_order(tmp_path, word_tokenizer):
    labels = ["a"] * 50 + ["b"] * 30 + ["c"] * 20
    rows = [{"text": name(i), "label": y} for i, y in enumerate(labels)]
    path = write(tmp_path / "s.jsonl", rows)
    tr, ev = load_text_files(path, tokenizer=word_tokenizer, max_length=5, eval_split=0.2, seed=3)
    assert Counter(ev.columns["labels"].tolist()) == {0: 10, 1: 6, 2: 4}
    assert len(tr) == 80 and tr.info["rows"] == 80 and ev.info["rows"] == 20
    row_of = {tuple(ids(name(i))): i for i in range(100)}
    tr_rows = [row_of[r] for r in rows_of(tr)]
    ev_rows = [row_of[r] for r in rows_of(ev)]
    assert sorted(tr_rows + ev_rows) == list(range(100))  # disjoint and complete
    assert tr_rows == sorted(tr_rows) and ev_rows == sorted(ev_rows)  # file order within each split
    _, expected_eval = stratified_split([ord(y) for y in labels], 0.2, 3)
    assert ev_rows == sorted(expected_eval.tolist())
    assert tr.info["eval_split"] == 0.2 and tr.info["seed"] == 3 and tr.info["eval_file"] is None
    # the same file and options give the same datasets; another seed holds out other rows
    tr2, ev2 = load_text_files(path, tokenizer=word_tokenizer, max_length=5, eval_split=0.2, seed=3)
    assert same(tr, tr2) and same(ev, ev2) and tr.info == tr2.info
    _, ev3 = load_text_files(path, tokenizer=word_tokenizer, max_length=5, eval_split=0.2, seed=4)
    assert sorted(row_of[r] for r in rows_of(ev3)) != ev_rows


def test_max_samples_keep_the_first_samples(tmp_path, word_tokenizer):
    rows = [{"text": name(i), "label": i % 2} for i in range(40)]
    path = write(tmp_path / "m.jsonl", rows)
    tr, ev = load_text_files(path, tokenizer=word_tokenizer, max_length=5)
    tr5, ev2 = load_text_files(path, tokenizer=word_tokenizer, max_length=5, max_train_samples=5,
                               max_eval_samples=2)
    assert len(tr5) == 5 and len(ev2) == 2
    assert same(tr5, tr.subset(5)) and same(ev2, ev.subset(2))
    tr_all, _ = load_text_files(path, tokenizer=word_tokenizer, max_length=5, max_train_samples=1000)
    assert same(tr_all, tr)
    with pytest.raises(SpecError, match="max_train_samples must be an integer >= 1 or None"):
        load_text_files(path, tokenizer=word_tokenizer, max_length=5, max_train_samples=0)


def test_a_tokenizer_without_pad_token_pads_with_eos_on_a_copy(tmp_path, word_tokenizer):
    import copy

    tok = copy.deepcopy(word_tokenizer)
    tok.pad_token = None
    assert tok.pad_token_id is None
    tr, _ = load_text_files(write(tmp_path / "t.jsonl", ROWS), write(tmp_path / "e.jsonl", ROWS),
                            tokenizer=tok, max_length=8)
    assert tr.info["pad_token_id"] == EOS and tr[0]["input_ids"].tolist()[-3:] == [EOS] * 3
    assert tok.pad_token_id is None  # the caller's tokenizer is unchanged


# ------------------------------------------------------------------------------------------------ causal LM


def test_causal_lm_from_txt_with_an_eval_file(tmp_path, word_tokenizer):
    train = tmp_path / "train.txt"
    train.write_text("a b c\n\nd e\nf g h i\n", encoding="utf-8")
    evals = write(tmp_path / "eval.jsonl", [{"text": "j k"}, {"text": " "}, {"text": "l"}])
    tr, ev = load_text_files(train, evals, tokenizer=word_tokenizer, max_length=3)
    stream = ids("a b c") + [EOS] + ids("d e") + [EOS] + ids("f g h i") + [EOS]
    assert tr.columns["input_ids"].flatten().tolist() == stream and len(tr) == 4
    assert ev.columns["input_ids"].flatten().tolist() == ids("j k") + [EOS]  # "l" [EOS] is the dropped tail
    assert torch.equal(tr.columns["labels"], tr.columns["input_ids"])
    info = tr.info
    assert info["kind"] == "causal-lm" and info["num_labels"] is None and info["label_names"] is None
    assert info["label_column"] is None and info["eos_token_id"] == EOS and info["seq_len"] == 3
    assert info["rows_read"] == {"train": 3, "eval": 3} and info["rows"] == 3 and ev.info["rows"] == 2


@pytest.mark.parametrize("ext", [".jsonl", ".csv", ".parquet", ".txt"])
def test_causal_lm_hold_out_takes_whole_documents_before_chunking(tmp_path, word_tokenizer, ext):
    docs = [" ".join([WORDS[i]] * 7) for i in range(20)]  # document i is seven times the letter i
    path = write(tmp_path / f"lm{ext}", [{"text": d} for d in docs])
    tr, ev = load_text_files(path, tokenizer=word_tokenizer, max_length=4, eval_split=0.2, seed=1)
    assert tr.info["rows"] == 16 and ev.info["rows"] == 4
    tr_letters = set(tr.columns["input_ids"].flatten().tolist()) - {EOS}
    ev_letters = set(ev.columns["input_ids"].flatten().tolist()) - {EOS}
    assert len(ev_letters) == 4 and len(tr_letters) == 16 and not tr_letters & ev_letters
    ev_stream = ev.columns["input_ids"].flatten().tolist()
    firsts = [t for i, t in enumerate(ev_stream) if t != EOS and (i == 0 or ev_stream[i - 1] == EOS)]
    assert firsts == sorted(firsts)  # the held-out documents stay in file order
    tr2, ev2 = load_text_files(path, tokenizer=word_tokenizer, max_length=4, eval_split=0.2, seed=1)
    assert same(tr, tr2) and same(ev, ev2)
    tr3, _ = load_text_files(path, tokenizer=word_tokenizer, max_length=4, eval_split=0.2, seed=1,
                             max_train_samples=3)
    assert len(tr3) == 3 and same(tr3, tr.subset(3))


def test_a_tokenizer_without_eos_separates_documents_with_sep(tmp_path, word_tokenizer):
    import copy

    tok = copy.deepcopy(word_tokenizer)
    tok.eos_token = None
    path = write(tmp_path / "t.jsonl", [{"text": "a b"}, {"text": "c"}])
    tr, _ = load_text_files(path, path, tokenizer=tok, max_length=5)
    assert tr.columns["input_ids"].flatten().tolist() == ids("a b") + [SEP] + ids("c") + [SEP]


# ------------------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_is_the_sha256_of_the_bytes_and_follows_changes(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("x y z\n")
    b.write_text("u v\n")
    fa = data_fingerprint(a)
    assert fa == hashlib.sha256(a.read_bytes()).hexdigest()
    assert data_fingerprint(a, b) not in (fa, data_fingerprint(b))
    assert data_fingerprint(a, b) != data_fingerprint(b, a)
    a.write_text("x y z!\n")
    assert data_fingerprint(a) != fa
    with pytest.raises(SpecError):
        data_fingerprint()


def test_info_fingerprint_changes_with_the_file(tmp_path, word_tokenizer):
    path = write(tmp_path / "t.jsonl", ROWS * 10)
    tr, _ = load_text_files(path, tokenizer=word_tokenizer, max_length=6)
    assert tr.info["fingerprint"] == hashlib.sha256(path.read_bytes()).hexdigest()
    write(path, ROWS * 10 + ROWS[:1])
    tr2, _ = load_text_files(path, tokenizer=word_tokenizer, max_length=6)
    assert tr2.info["fingerprint"] != tr.info["fingerprint"]


# ------------------------------------------------------------------------------------------------ errors


def test_file_errors(tmp_path):
    with pytest.raises(DataFileError) as e:
        read_records(tmp_path / "nope.csv")
    assert message(e) == f"--train-file {tmp_path / 'nope.csv'}: no such file"
    with pytest.raises(DataFileError) as e:
        read_records(tmp_path, option="--eval-file")
    assert message(e) == f"--eval-file {tmp_path}: is a directory, not a data file"
    for fname, what in (("d.xlsx", "unknown file type '.xlsx'"), ("data", "no file extension")):
        (tmp_path / fname).write_text("x")
        with pytest.raises(DataFileError) as e:
            read_records(tmp_path / fname)
        assert message(e) == (f"--train-file {tmp_path / fname}: {what}; the supported ones are: "
                              ".jsonl, .json, .csv, .tsv, .txt, .parquet")
    assert issubclass(DataFileError, DataSourceError) and issubclass(DataFileError, ValueError)


@pytest.mark.parametrize("fname,content,problem", [
    ("e.jsonl", "", "no rows (the file holds no data)"),
    ("e.jsonl", "\n  \n", "no rows (the file holds no data)"),
    ("e.json", "[]", "no rows (the file holds no data)"),
    ("e.json", "", "no rows (the file holds no data)"),
    ("e.txt", "\n \n", "no rows (the file holds no data)"),
    ("e.csv", "", "no rows (the file is empty)"),
    ("e.csv", "text,label\n\n", "no rows below the header"),
    ("e.jsonl", '{"text": "a"}\n{"text": oops}\n', "line 2 is not valid JSON: Expecting value (column 10)"),
    ("e.jsonl", '{"text": "a"}\n\n["a", 1]\n', "line 3 is a list, not a JSON object"),
    ("e.jsonl", '"just a string"\n', "line 1 is a string, not a JSON object"),
    ("e.json", '[{"text": "a"},\n {"text": }]', "not valid JSON: Expecting value at line 2 column 11"),
    ("e.json", '[{"text": "a"}, 3]', "record 2 of the list is a number (3), not a JSON object"),
    ("e.json", '{"text": ["a", "b"], "label": [1]}',
     "the column lists differ in length: 'text' 2, 'label' 1"),
    ("e.json", '"text"', ("holds a string; expected a list of objects, an object with a \"data\" list of "
                          "objects, or an object of equal-length column lists")),
    ("e.csv", "text,label\na,1\nb,2,3\n", "line 3 has 3 fields, the header has 2"),
    ("e.tsv", "text\tlabel\na\t1\n\nb\n", "line 4 has 1 field, the header has 2"),
    ("e.csv", "text,text\na,b\n", "the header (line 1) names the column 'text' twice"),
    ("e.parquet", "not parquet", "not a readable Parquet file (Could not open Parquet input source"),
])
def test_malformed_files(tmp_path, fname, content, problem):
    p = tmp_path / fname
    p.write_text(content, encoding="utf-8")
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert message(e).startswith(f"--train-file {p}: {problem}")


@pytest.mark.parametrize("fname", ["u.jsonl", "u.json", "u.csv", "u.txt"])
def test_not_utf8_names_line_and_offset(tmp_path, fname):
    p = tmp_path / fname
    first = {".jsonl": b'{"text": "ok"}\n', ".json": b'[{"text": "ok"},\n'}.get(p.suffix, b"text\n")
    second = b'{"text": "caf\xe9"}]\n'  # the bad byte is the 14th of the line
    p.write_bytes(first + second)
    with pytest.raises(DataFileError) as e:
        read_records(p)
    offset = len(first) + 13
    assert message(e) == (f"--train-file {p}: not UTF-8 text: byte 0xe9 at line 2 (byte offset {offset}); "
                          "save the file as UTF-8")


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    p = write(tmp_path / "d.parquet", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert message(e) == f"--train-file {p}: reading .parquet files needs pyarrow: run `pip install pyarrow`"


def load_err(tmp_path, tok, train_rows, eval_rows=None, ext=".jsonl", **kw) -> str:
    train = write(tmp_path / f"train{ext}", train_rows)
    evals = None if eval_rows is None else write(tmp_path / f"eval{ext}", eval_rows)
    kw.setdefault("max_length", 6)
    with pytest.raises(DataFileError) as e:
        load_text_files(train, evals, tokenizer=tok, **kw)
    return message(e)


def test_column_errors(tmp_path, word_tokenizer):
    rows = [{"sentence": "a", "label": "x"}, {"sentence": "b", "label": "y"}]
    train = tmp_path / "train.csv"
    assert load_err(tmp_path, word_tokenizer, rows, rows, ext=".csv") == (
        f"--train-file {train}: no column 'text'; the columns are: sentence, label")
    assert load_err(tmp_path, word_tokenizer, rows, rows, ext=".csv", text_column="sentence",
                    label_column="y") == (
        f"--train-file {train}: no column 'y'; the columns are: sentence, label")
    eval_rows = [{"sentence": "c"}]
    assert load_err(tmp_path, word_tokenizer, rows, eval_rows, ext=".csv", text_column="sentence") == (
        f"--eval-file {tmp_path / 'eval.csv'}: no column 'label'; the columns are: sentence")
    assert load_err(tmp_path, word_tokenizer, rows, rows, ext=".csv", text_column="sentence",
                    text_pair_column="p") == (
        f"--train-file {train}: no column 'p'; the columns are: sentence, label")
    lm = [{"text": "a b c d"}] * 3
    assert load_err(tmp_path, word_tokenizer, lm, lm, text_pair_column="text") == (
        f"--train-file {tmp_path / 'train.jsonl'}: --text-pair-column 'text' is for sentence-pair "
        "classification, but the data have no label column (no 'label'; name one with --label-column)")


def test_value_errors(tmp_path, word_tokenizer):
    train = tmp_path / "train.jsonl"
    evals = tmp_path / "eval.jsonl"
    good = [{"text": "a", "label": "neg"}, {"text": "b", "label": "pos"}]
    assert load_err(tmp_path, word_tokenizer, good, [*good, {"text": "c", "label": "neutral"}]) == (
        f"--eval-file {evals}: line 3: label 'neutral' does not occur in the training data "
        "(its labels are: neg, pos)")
    assert load_err(tmp_path, word_tokenizer, [*good, {"text": None, "label": "pos"}], good) == (
        f"--train-file {train}: line 3 has no 'text' value (null or missing)")
    assert load_err(tmp_path, word_tokenizer, [*good, {"label": "pos"}], good) == (
        f"--train-file {train}: line 3 has no 'text' value (null or missing)")
    assert load_err(tmp_path, word_tokenizer, [{"text": 5, "label": "pos"}, *good], good) == (
        f"--train-file {train}: line 1: the 'text' value is a number (5), not a string")
    assert load_err(tmp_path, word_tokenizer, [{"text": ["a"]}], None) == (
        f"--train-file {train}: line 1: the 'text' value is a list, not a string")
    assert load_err(tmp_path, word_tokenizer, [*good, {"text": "c", "label": None}], good) == (
        f"--train-file {train}: line 3 has no 'label' label (null or missing)")
    assert load_err(tmp_path, word_tokenizer, [*good, {"text": "c", "label": 0.5}], good) == (
        f"--train-file {train}: line 3: label 0.5 is not a class (regression targets are not supported)")
    assert load_err(tmp_path, word_tokenizer, [*good, {"text": "c", "label": " "}], good) == (
        f"--train-file {train}: line 3 has an empty 'label' label")
    assert load_err(tmp_path, word_tokenizer, [*good, {"text": "c", "label": {"a": 1}}], good) == (
        f"--train-file {train}: line 3: the 'label' label is an object, not a string or an integer")
    assert load_err(tmp_path, word_tokenizer, [{"text": "a", "label": 1}] * 2, good) == (
        f"--train-file {train}: the 'label' column holds a single label ('1'); classification needs two or "
        "more")


def test_blank_data_errors(tmp_path, word_tokenizer):
    train = tmp_path / "train.jsonl"
    blank_lm = [{"text": "  "}, {"text": ""}]
    assert load_err(tmp_path, word_tokenizer, blank_lm) == (
        f"--train-file {train}: no text: every 'text' value is blank")
    blank_cls = [{"text": " ", "label": "a"}, {"text": "", "label": "b"}]
    assert load_err(tmp_path, word_tokenizer, blank_cls, blank_cls) == (
        f"--train-file {train}: no text: every 'text' value is blank")
    good = [{"text": "a b c d e f g"}] * 3
    assert load_err(tmp_path, word_tokenizer, good, blank_lm) == (
        f"--eval-file {tmp_path / 'eval.jsonl'}: no text: every 'text' value is blank")


def test_hold_out_errors(tmp_path, word_tokenizer):
    train = tmp_path / "train.jsonl"
    few = [{"text": name(i), "label": i % 2} for i in range(6)]
    assert load_err(tmp_path, word_tokenizer, few, eval_split=0.1) == (
        f"--train-file {train}: too few rows to hold out eval_split=0.1 of 6 for evaluation (stratified by "
        "label); give --eval-file or raise --eval-split")
    assert load_err(tmp_path, word_tokenizer, few, eval_split=0.9) == (
        f"--train-file {train}: holding out eval_split=0.9 of 6 rows leaves none to train on; "
        "lower --eval-split")
    docs = [{"text": name(i) + " a b c d e f"} for i in range(4)]
    assert load_err(tmp_path, word_tokenizer, docs, eval_split=0.1) == (
        f"--train-file {train}: too few documents to hold out eval_split=0.1 of 4 for evaluation; give "
        "--eval-file or raise --eval-split")
    assert load_err(tmp_path, word_tokenizer, docs, eval_split=0.95) == (
        f"--train-file {train}: holding out eval_split=0.95 of 4 documents leaves none to train on; "
        "lower --eval-split")
    long_doc = [{"text": "a b c d e f g h i"}]
    assert load_err(tmp_path, word_tokenizer, [{"text": "a b"}], long_doc, max_length=8) == (
        f"--train-file {train}: the training documents (1) give 3 tokens, not one chunk of --max-length 8 "
        "tokens; give more text or lower --max-length")
    assert load_err(tmp_path, word_tokenizer, [{"text": "a"}] * 20, max_length=8, eval_split=0.1) == (
        f"--train-file {train}: the held-out evaluation documents (2) give 4 tokens, not one chunk of "
        "--max-length 8 tokens; give more text or lower --max-length")
    with pytest.raises(SpecError, match=r"eval_split must be in \(0, 1\)"):
        load_text_files(write(train, few), tokenizer=word_tokenizer, max_length=4, eval_split=1.0)


# ------------------------------------------------------------------------------------------------ hub


class _ClassLabel:
    """Stands in for datasets.ClassLabel (recognised by its type name)."""

    def __init__(self, names):
        self.names = names


_ClassLabel.__name__ = "ClassLabel"


class _Split:
    def __init__(self, columns, features=None, fingerprint=None):
        self._columns = columns
        self.column_names = list(columns)
        self.features = features or {}
        self._fingerprint = fingerprint

    def __len__(self):
        return len(next(iter(self._columns.values())))

    def __getitem__(self, key):
        return self._columns[key]


@pytest.fixture
def fake_hub(monkeypatch):
    """A `datasets` module whose load_dataset serves the splits put in the returned dict, and a local
    endpoint for the reachability probe."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    served: dict = {}
    calls: list = []

    def load_dataset(name, config=None):
        calls.append((name, config))
        if name not in served:
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub\nor cannot be accessed.")
        return served[name]

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    served["_calls"] = calls
    yield served
    server.close()


def test_hub_dataset_uses_the_validation_split_and_classlabel_names(fake_hub, word_tokenizer):
    feats = {"label": _ClassLabel(["negative", "positive"])}
    fake_hub["org/reviews"] = {
        "train": _Split({"sentence": ["a b", "c", "d"], "label": [1, 0, 1], "idx": [0, 1, 2]}, feats, "fp1"),
        "test": _Split({"sentence": ["z"], "label": [-1], "idx": [0]}, feats, "fp3"),
        "validation": _Split({"sentence": ["e", "f"], "label": [0, 1], "idx": [0, 1]}, feats, "fp2"),
    }
    tr, ev = load_hub_dataset("org/reviews:plain", tokenizer=word_tokenizer, max_length=5,
                              text_column="sentence")
    assert fake_hub["_calls"] == [("org/reviews", "plain")]
    assert tr.columns["labels"].tolist() == [1, 0, 1] and ev.columns["labels"].tolist() == [0, 1]
    assert tr[0]["input_ids"].tolist() == [CLS, *ids("a b"), SEP, PAD]
    info = ev.info
    assert info["label_names"] == ["negative", "positive"] and info["num_labels"] == 2
    assert info["source"] == "hub" and info["dataset"] == "org/reviews:plain"
    assert info["eval_split_name"] == "validation" and info["split"] == "eval"
    assert info["fingerprint"] == tr.info["fingerprint"] is not None


def test_hub_dataset_without_eval_split_holds_out_train(fake_hub, word_tokenizer):
    texts = [" ".join([WORDS[i % 26]] * 5) for i in range(20)]
    fake_hub["wiki-ish"] = {"train": _Split({"text": texts})}
    tr, ev = load_hub_dataset("wiki-ish", tokenizer=word_tokenizer, max_length=4, eval_split=0.25, seed=2)
    assert tr.info["kind"] == "causal-lm" and tr.info["eval_split_name"] is None
    assert tr.info["rows"] == 15 and ev.info["rows"] == 5 and tr.info["fingerprint"] is None
    tr2, ev2 = load_hub_dataset("wiki-ish", tokenizer=word_tokenizer, max_length=4, eval_split=0.25, seed=2)
    assert same(tr, tr2) and same(ev, ev2)


def test_hub_dataset_errors(fake_hub, word_tokenizer, monkeypatch):
    fake_hub["noeval"] = {"validation": _Split({"text": ["a"]})}
    with pytest.raises(DataFileError) as e:
        load_hub_dataset("noeval", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == "--dataset noeval: no 'train' split; the splits are: validation"
    with pytest.raises(DataFileError) as e:
        load_hub_dataset("missing:cfg", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == ("--dataset missing:cfg: datasets.load_dataset failed: FileNotFoundError: Dataset "
                          "'missing' doesn't exist on the Hub")
    fake_hub["cols"] = {"train": _Split({"sentence": ["a"], "label": [0]}),
                        "validation": _Split({"sentence": ["a"], "label": [5]})}
    with pytest.raises(DataFileError) as e:
        load_hub_dataset("cols", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == "--dataset cols (train split): no column 'text'; the columns are: sentence, label"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataSourceError) as e:
        load_hub_dataset("imdb", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == (
        "--dataset imdb loads from the Hugging Face hub, which HF_HUB_OFFLINE disables; "
        "offline alternative: save the data as .jsonl, .csv or .parquet and pass `--train-file`")


def test_real_minilm_tokenizer_by_source_name(tmp_path):
    from aqsgd.data import locate

    if locate("minilm") is None:
        pytest.skip("source 'minilm' is not prepared; run `aqsgd data prepare minilm`")
    rows = [{"sentence": f"review number {i} is {'good' if i % 2 else 'bad'}", "label": ["neg", "pos"][i % 2]}
            for i in range(20)]
    path = write(tmp_path / "r.csv", rows)
    tr, ev = load_text_files(path, tokenizer="minilm", max_length=12, text_column="sentence", eval_split=0.2)
    assert len(tr) == 16 and len(ev) == 4 and tr.info["vocab_size"] == 30522
    assert tr.columns["input_ids"].shape == (16, 12) and tr.info["label_names"] == ["neg", "pos"]
    docs = write(tmp_path / "docs.txt", [{"text": r["sentence"]} for r in rows])
    lm_tr, lm_ev = load_text_files(docs, tokenizer="minilm", max_length=8, eval_split=0.2)
    assert len(lm_tr) > 0 and len(lm_ev) > 0
    assert lm_tr.info["kind"] == "causal-lm"
    assert lm_tr.info["eos_token_id"] == 102  # MiniLM has no EOS: [SEP] separates the documents


def test_hub_classlabel_errors(fake_hub, word_tokenizer):
    feats = {"label": _ClassLabel(["negative", "positive"])}
    fake_hub["bad-train"] = {"train": _Split({"text": ["a", "b"], "label": [0, 5]}, feats)}
    with pytest.raises(DataFileError) as e:
        load_hub_dataset("bad-train", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == (
        "--dataset bad-train (train split): row 2: label 5 is not one of the 2 classes of the 'label' "
        "ClassLabel")
    fake_hub["unlabelled-test"] = {"train": _Split({"text": ["a", "b"], "label": [0, 1]}, feats),
                                   "test": _Split({"text": ["c"], "label": [-1]}, feats)}
    with pytest.raises(DataFileError) as e:
        load_hub_dataset("unlabelled-test", tokenizer=word_tokenizer, max_length=4)
    assert message(e) == (
        "--dataset unlabelled-test (test split): row 1: label -1 does not occur in the training data "
        "(its labels are: negative, positive)")
