"""Input files that are not plain data, or too large to read in one piece: each is refused at once, in one
line naming it, before it can hang the reader or fill the memory; large files report their progress."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from aqsgd.data import DataFileError, load_text_files, read_records
from aqsgd.data.datasets import records
from aqsgd.data.datasets import text as text_module
from aqsgd.logs import ProgressLog

LIMIT = records.MAX_LINE_BYTES


def message(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


def test_the_line_limit_is_4_mib():
    assert LIMIT == 4 * 1024 * 1024


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_without_reading_it(tmp_path):
    """A FIFO with no writer would block the reader forever."""
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(DataFileError) as e:
        read_records(fifo)
    assert message(e) == (f"--train-file {fifo}: is a FIFO (named pipe), not a regular file; save the data "
                          "to a file first")
    assert time.monotonic() - t0 < 5


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_character_device_is_refused():
    """Read as a data file, /dev/zero would never end."""
    with pytest.raises(DataFileError) as e:
        read_records("/dev/zero", option="--eval-file")
    assert message(e) == ("--eval-file /dev/zero: is a character device, not a regular file; save the data "
                          "to a file first")


def test_symbolic_link_loops_and_dangling_links_say_so(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(DataFileError) as e:
        read_records(a)
    assert message(e) == f"--train-file {a}: a symbolic link loop (it points back to itself)"
    dangling = tmp_path / "d.txt"
    dangling.symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataFileError) as e:
        read_records(dangling)
    assert message(e) == f"--train-file {dangling}: a symbolic link to a file that does not exist"
    target = tmp_path / "real.txt"
    target.write_text("one line\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert read_records(link).columns["text"] == ["one line"]  # a link to a regular file is read


@pytest.mark.parametrize("fname", ["big.txt", "big.jsonl"])
def test_a_line_over_the_limit_is_refused_by_number(tmp_path, fname):
    p = tmp_path / fname
    short = "a b c" if p.suffix == ".txt" else json.dumps({"text": "a b c"})
    long = "x" * (LIMIT + 10) if p.suffix == ".txt" else json.dumps({"text": "x" * (LIMIT + 10)})
    p.write_text(f"{short}\n{short}\n{long}\n{short}\n")
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert message(e) == (f"--train-file {p}: line 3 is longer than 4 MiB, the limit for one line; split "
                          "long documents into paragraphs, one per line")


def test_a_line_of_exactly_the_limit_is_read(tmp_path):
    p = tmp_path / "edge.txt"
    p.write_bytes(b"y" * LIMIT + b"\n" + b"z" * LIMIT)  # the last line without a newline
    got = read_records(p).columns["text"]
    assert [len(t) for t in got] == [LIMIT, LIMIT]


def test_a_sparse_2_gb_file_is_refused_at_once(tmp_path):
    """One 2 GB "line" of zero bytes: refused at its first 4 MiB, not after reading (and holding) all of
    it."""
    p = tmp_path / "sparse.txt"
    with open(p, "wb") as f:
        f.truncate(2 << 30)
    t0 = time.monotonic()
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert "line 1 is longer than 4 MiB" in message(e)
    assert time.monotonic() - t0 < 5


def test_a_csv_field_over_the_limit_names_where_it_starts(tmp_path):
    p = tmp_path / "long.csv"
    body = "\n".join(["y" * 1000] * (LIMIT // 1000 + 10))  # a quoted field of many short lines
    p.write_text(f'text,label\n"a b",1\n"{body}",0\n')
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert message(e) == (f"--train-file {p}: a field that starts at line 3 is longer than 4 MiB, the limit "
                          "for one text; split long documents into paragraphs")


def test_a_json_text_over_the_limit_names_its_record(tmp_path, word_tokenizer):
    p = tmp_path / "long.json"
    p.write_text(json.dumps([{"text": "a b"}, {"text": "x" * (LIMIT + 1)}]))
    with pytest.raises(DataFileError) as e:
        load_text_files(p, tokenizer=word_tokenizer, max_length=4)
    assert message(e) == (f"--train-file {p}: record 2: the 'text' value is {LIMIT + 1:,} characters long, "
                          f"over the limit of {LIMIT:,} for one text; split long documents into paragraphs")


def test_a_json_file_over_its_limit_points_to_jsonl(tmp_path, monkeypatch):
    p = tmp_path / "huge.json"
    p.write_text(json.dumps([{"text": "a"}] * 200))
    monkeypatch.setattr(records, "MAX_JSON_BYTES", 1 << 10)
    with pytest.raises(DataFileError) as e:
        read_records(p)
    assert message(e).startswith(f"--train-file {p}: 0.0 GiB: a .json file is parsed whole and may be at "
                                 f"most")
    assert message(e).endswith("save large data as .jsonl (one object per line)")


def test_progress_lines_for_reading_and_tokenizing(tmp_path, word_tokenizer, monkeypatch, caplog):
    """Long work logs how far it got (here every call, to see the lines without a long wait)."""
    eager = lambda logger, what, **kw: ProgressLog(logger, what, **{**kw, "every_s": 0.0})  # noqa: E731
    monkeypatch.setattr(records, "ProgressLog", eager)
    monkeypatch.setattr(text_module, "ProgressLog", eager)
    p = tmp_path / "docs.txt"
    p.write_text("".join(f"a b c d e f {i % 7}\n" for i in range(3000)))
    with caplog.at_level(logging.INFO):
        load_text_files(p, tokenizer=word_tokenizer, max_length=4, eval_split=0.1)
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"reading --train-file {p}: ") and m.endswith(" MB (100%)") for m in lines), lines
    tokenizing = [m for m in lines
                  if m.startswith("tokenizing the training documents (2700) of --train-file")]
    assert tokenizing and tokenizing[-1].endswith(": 2,700 of 2,700 documents (100%)"), lines


def test_progress_log_waits_between_lines(caplog):
    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO):
        slow = ProgressLog(log, "work", total=10, unit="items", every_s=3600)
        for i in range(10):
            slow.update(i)
        fast = ProgressLog(log, "work", unit="items", every_s=0)
        fast.update(5)
    assert [r.getMessage() for r in caplog.records] == ["work: 5 items"]


def test_classification_tokenized_in_batches_equals_one_call(word_tokenizer):
    texts = [" ".join("abcdefghij"[(i + k) % 10] for k in range(i % 9 + 1)) for i in range(50)]
    labels = [i % 3 for i in range(50)]
    one = text_module.text_classification(texts, labels, word_tokenizer, 6, batch_texts=1000)
    batched = text_module.text_classification(texts, labels, word_tokenizer, 6, batch_texts=7)
    assert one.columns.keys() == batched.columns.keys()
    for k, v in one.columns.items():
        assert v.equal(batched.columns[k]), k
