"""``aqsgd data list`` piped or redirected: plain lines, one per source, nothing cut to 80 columns; on a
terminal, the table."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

from aqsgd.cli.data import register
from aqsgd.data.sources import SOURCES


def _list(tmp_path) -> int:
    parser = argparse.ArgumentParser(prog="aqsgd")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", "list", "--cache-dir", str(tmp_path)])
    return args.func(args)


def test_piped_list_is_one_whole_line_per_source(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # as in a pipe: no width to fit
    assert _list(tmp_path) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"offline sources in {tmp_path}"
    assert lines[1].split() == ["name", "prepared", "size", "licence", "origin", "description"]
    assert len(lines) == 2 + len(SOURCES)
    for line, (name, src) in zip(lines[2:], SOURCES.items()):
        assert line.split()[:2] == [name, "no"]
        for value in (src.licence, src.origin, src.description):  # each whole, on its source's line
            assert value in line
    assert "…" not in "".join(lines) and "┃" not in "".join(lines)


def test_list_through_a_real_pipe(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(f"{sys.executable} -m aqsgd.cli data list --cache-dir {tmp_path} | cat", shell=True,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()[2:]
    assert [r.split()[0] for r in rows] == list(SOURCES)
    assert all(src.description in row for row, src in zip(rows, SOURCES.values()))


def test_on_a_terminal_it_is_a_table(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("COLUMNS", "200")
    assert _list(tmp_path) == 0
    text = out.getvalue()
    assert "┏━" in text and "┃" in text and all(name in text for name in SOURCES)
