"""How a ``.txt`` file is cut into documents (``txt_unit``: line, paragraph, file), the log line that says
so, the fingerprint that keeps a resumed run from reading the same file otherwise, and ``--txt-unit``."""

from __future__ import annotations

import logging

import pytest

from aqsgd.data import load_text_files, read_records
from aqsgd.data.datasets import records
from aqsgd.errors import SpecError
from aqsgd.train.checkpoint import CheckpointError
from aqsgd.train.config import TrainConfig

NOTES = ("\n"
         "first paragraph line one\r\n"
         "line two of it\n"
         "   \n"
         "second paragraph\n"
         "\n"
         "\n"
         "third paragraph line one\n"
         "  indented line two\n"
         "\n")


@pytest.fixture
def notes(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_bytes(NOTES.encode())
    return p


def test_one_document_per_line_by_default(notes):
    rec = read_records(notes)
    assert rec.column("text") == ["first paragraph line one", "line two of it", "second paragraph",
                                  "third paragraph line one", "  indented line two"]
    assert rec.lines == [2, 3, 5, 8, 9] and rec.unit == "line"
    assert rec.read_as == ("10 lines read as 5 documents (one per line; --txt-unit paragraph or file reads "
                           "paragraphs or the whole file)")


def test_one_document_per_paragraph(notes):
    rec = read_records(notes, txt_unit="paragraph")
    assert rec.column("text") == ["first paragraph line one\nline two of it", "second paragraph",
                                  "third paragraph line one\n  indented line two"]
    assert rec.lines == [2, 5, 8]  # where each starts
    assert rec.read_as == "10 lines read as 3 documents (one per paragraph: lines up to a blank line)"


def test_the_whole_file_as_one_document(notes):
    rec = read_records(notes, txt_unit="file")
    assert rec.column("text") == ["first paragraph line one\nline two of it\n   \nsecond paragraph\n\n\n"
                                  "third paragraph line one\n  indented line two"]
    assert rec.lines == [2]
    assert rec.read_as == "10 lines read as 1 document (the whole file as one document)"


def test_a_file_of_blank_lines_has_no_documents_in_any_unit(tmp_path):
    p = tmp_path / "blank.txt"
    p.write_text("\n  \n\n")
    for unit in records.TXT_UNITS:
        with pytest.raises(records.DataFileError, match="no rows"):
            read_records(p, txt_unit=unit)


def test_an_unknown_unit_is_refused(notes):
    with pytest.raises(SpecError, match="txt_unit 'sentence' is not one of line, paragraph, file"):
        read_records(notes, txt_unit="sentence")


def test_the_log_says_how_the_file_was_read(notes, word_tokenizer, caplog):
    with caplog.at_level(logging.INFO):
        load_text_files(notes, tokenizer=word_tokenizer, max_length=2, eval_split=0.4, txt_unit="paragraph")
    assert (f"--train-file {notes}: 10 lines read as 3 documents (one per paragraph: lines up to a blank "
            "line); tokenizing") in caplog.text


def test_documents_of_many_lines_may_exceed_the_limit_of_one_line(tmp_path, word_tokenizer, monkeypatch):
    """Each line is still bounded as it is read; a paragraph or file of them is tokenized in pieces."""
    monkeypatch.setattr(records, "MAX_LINE_BYTES", 64)
    p = tmp_path / "long.txt"
    p.write_text("a b c d e f g h\n" * 40 + "\n" + "i j\n" * 40)  # paragraphs of 640 and 160 characters
    tr, ev = load_text_files(p, tokenizer=word_tokenizer, max_length=4, txt_unit="paragraph", eval_split=0.5)
    assert len(tr) + len(ev) == (8 * 40 + 1) // 4 + (2 * 40 + 1) // 4
    tr, _ = load_text_files(p, tokenizer=word_tokenizer, max_length=4, eval_file=p, txt_unit="file")
    assert tr.info["rows_read"] == {"train": 1, "eval": 1}
    p.write_text("a b c d e f g h " * 5 + "\n")
    with pytest.raises(records.DataFileError, match="line 1 is longer than"):  # a line stays bounded
        load_text_files(p, tokenizer=word_tokenizer, max_length=4, txt_unit="file")


def test_the_unit_is_part_of_the_data_fingerprint(notes, tmp_path, word_tokenizer):
    fps = {}
    for unit in records.TXT_UNITS:
        tr, _ = load_text_files(notes, notes, tokenizer=word_tokenizer, max_length=2, txt_unit=unit)
        assert tr.info["txt_unit"] == unit
        fps[unit] = tr.info["fingerprint"]
    assert fps["line"] == records.data_fingerprint(notes, notes)  # as before: the files' bytes alone
    assert len(set(fps.values())) == 3
    csv = tmp_path / "notes.csv"
    csv.write_text("text\n" + "a b c\n" * 10)
    tr, _ = load_text_files(csv, tokenizer=word_tokenizer, max_length=2, txt_unit="paragraph")
    assert tr.info["txt_unit"] is None and tr.info["fingerprint"] == records.data_fingerprint(csv)


def test_resuming_with_another_unit_is_refused_like_a_changed_file(tmp_path, word_tokenizer):
    from aqsgd.train.trainer import Trainer

    p = tmp_path / "notes.txt"
    lines = [" ".join("abcdefghij"[(i + k) % 10] for k in range(6)) for i in range(60)]
    p.write_text("".join(line + ("\n\n" if i % 3 == 2 else "\n") for i, line in enumerate(lines)))
    cfg = TrainConfig.of(model="tiny-llama", max_length=8, stages=2, micro_batches=2, micro_batch_size=2,
                         epochs=1, max_steps=2, checkpoint_every=2, output_dir=str(tmp_path / "runs"),
                         run_name="notes", progress=False, tensorboard=False,
                         cache_dir=str(tmp_path / "cache"))
    held = tmp_path / "held.txt"
    held.write_text("a b c d e f g h i j\n" * 4)

    def data(unit):
        return load_text_files(p, held, tokenizer=word_tokenizer, max_length=8, txt_unit=unit)

    Trainer(cfg, data=data("paragraph")).run()
    again = cfg.replace(resume=str(tmp_path / "runs" / "notes"), max_steps=4)
    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
        Trainer(again, data=data("line")).run()
    with pytest.raises(CheckpointError, match="changed since the checkpoint"):
        Trainer(again, data=data("file")).run()


@pytest.mark.parametrize("flat,problem", [
    (dict(txt_unit="sentence", train_file="a.txt"), "--txt-unit: 'sentence' is not one of line, paragraph, "
                                                    "file"),
    (dict(txt_unit="paragraph", train_file="a.csv"), "--txt-unit: paragraph cuts .txt files into documents, "
                                                     "and neither --train-file nor --eval-file is one"),
    (dict(txt_unit="file"), "--txt-unit: file cuts .txt files"),
])
def test_the_setting_is_checked(flat, problem):
    with pytest.raises(SpecError) as e:
        TrainConfig.of(**flat).validate()
    assert str(e.value).startswith(problem)


def test_the_setting_is_a_field_of_the_task_section():
    for unit in records.TXT_UNITS:
        cfg = TrainConfig.of(txt_unit=unit, train_file="notes.TXT").validate()
        assert cfg.task.txt_unit == unit and cfg.to_dict()["task"]["txt_unit"] == unit
    assert TrainConfig().task.txt_unit == "line"
    assert TrainConfig.of(train_file="a.csv").validate().task.txt_unit == "line"
