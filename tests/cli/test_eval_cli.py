"""``aqsgd eval RUN``'s table and ``--out``: the uncompressed evaluation leads, the compressed one is labelled
for what it is, and an output path that cannot be written fails in one line (before the evaluation where
that can be known)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from aqsgd.cli import main

RESULT = {"checkpoint": "runs/r/checkpoints/step-00000008", "step": 8, "samples": 16,
          "eval": {"compressed": {"loss": 8.325, "perplexity": 4126.0},
                   "uncompressed": {"loss": 4.0466, "perplexity": 57.2}}}


@pytest.fixture
def evaluations(monkeypatch) -> list[str]:
    """The runs evaluated: ``evaluate_run`` (which rebuilds and runs the pipeline) replaced by one that
    records its run and returns :data:`RESULT`."""
    calls: list[str] = []

    def evaluate_run(run, **_kw) -> dict[str, Any]:
        calls.append(str(run))
        return json.loads(json.dumps(RESULT))

    monkeypatch.setattr("aqsgd.train.evaluate.evaluate_run", evaluate_run)
    monkeypatch.setenv("COLUMNS", "200")
    return calls


def make_run(tmp_path: Path, forward: str = "delta:q2", stages: int = 2) -> Path:
    """A run directory's config.json, nested by section as the trainer writes it."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    config = {"task": {"name": "wiki"}, "pipeline": {"stages": stages},
              "compression": {"forward": forward, "backward": "direct:q4"}}
    (run / "config.json").write_text(json.dumps(config))
    return run


def header_and_rows(out: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = [line for line in out.splitlines() if line.startswith(("┃", "│"))]
    cells = [[c.strip() for c in line.strip("┃│ ").replace("┃", "│").split("│")] for line in lines]
    return cells[0], {r[0]: r[1:] for r in cells[1:]}


def test_aqsgd_run_leads_with_the_uncompressed_evaluation(tmp_path, evaluations, capsys):
    run = make_run(tmp_path)
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    header, rows = header_and_rows(out)
    assert header == ["metric", "uncompressed", "through compressed boundaries (no cache)"]
    assert rows["perplexity"] == ["57.2000", "4126.0000"]
    note = [line for line in out.splitlines() if "per-sample cache" in line]
    assert len(note) == 1 and "not the model's quality" in note[0]
    assert evaluations == [str(run)]


def test_direct_codecs_are_labelled_without_the_cache_note(tmp_path, evaluations, capsys):
    assert main(["eval", str(make_run(tmp_path, forward="direct:q8"))]) == 0
    out = capsys.readouterr().out
    assert header_and_rows(out)[0] == ["metric", "uncompressed", "through compressed boundaries"]
    assert "cache" not in out


@pytest.mark.parametrize("forward,stages", [("delta:q2", 1), ("none", 4), ("direct:fp32", 2)])
def test_without_a_compressed_boundary_one_figure(tmp_path, evaluations, capsys, forward, stages):
    assert main(["eval", str(make_run(tmp_path, forward=forward, stages=stages))]) == 0
    out = capsys.readouterr().out
    header, rows = header_and_rows(out)
    assert header == ["metric", "value"] and rows["loss"] == ["4.0466"]
    assert "compress" not in out and "4126" not in out


def test_out_writes_the_result_into_new_folders(tmp_path, evaluations):
    out = tmp_path / "results" / "new" / "e.json"
    assert main(["eval", str(make_run(tmp_path)), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == RESULT
    assert [p.name for p in out.parent.iterdir()] == ["e.json"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


def test_out_directory_is_refused_before_evaluating(tmp_path, evaluations, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    assert main(["eval", str(make_run(tmp_path)), "--out", str(folder)]) == 2
    err = one_line_error(capsys)
    assert f"--out {folder}: is a directory" in err
    assert evaluations == []


def test_out_under_a_file_is_refused_before_evaluating(tmp_path, evaluations, capsys):
    (tmp_path / "notes.txt").write_text("a file")
    out = tmp_path / "notes.txt" / "e.json"
    assert main(["eval", str(make_run(tmp_path)), "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert str(out) in err and f"{tmp_path / 'notes.txt'} is a file, not a folder" in err
    assert evaluations == []


def test_out_in_a_read_only_folder_is_refused_before_evaluating(tmp_path, evaluations, capsys, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    real_access = os.access
    # (chmod 0o555 does not stop root: the check asks os.access, as it would answer there)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != folder and real_access(p, mode, **kw))
    out = folder / "e.json"
    assert main(["eval", str(make_run(tmp_path)), "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert f"--out {out}: folder {folder} is not writable" in err
    assert evaluations == [] and not out.exists()


def test_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, evaluations, capsys, full_disk):
    run = make_run(tmp_path)
    folder = tmp_path / "results"
    folder.mkdir()
    out = folder / "e.json"
    out.write_text("the previous result")
    full_disk(lambda path: path.parent == folder)
    assert main(["eval", str(run), "--out", str(out)]) == 2
    err = one_line_error(capsys)
    assert f"--out {out}: could not write it (No space left on device)" in err
    assert out.read_text() == "the previous result"  # not truncated
    assert [p.name for p in folder.iterdir()] == ["e.json"]  # no temporary file left
