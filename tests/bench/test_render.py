"""``python -m benchmarks.render``: the tables of docs/bench-*.md from the files of benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render import main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_cache_path_result_renders_both_tables(capsys):
    path = RESULTS / "codecs-cache-path-cpu.json"
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    d = json.loads(path.read_text())
    assert lines[0].startswith(f"<!-- {path}: {d['command']} on ")
    assert lines[1].startswith("| cache | codec | sender GB/s | receiver GB/s | clone GB/s |")
    rows = [ln for ln in lines if ln.startswith("| `")]
    assert len(rows) == len(d["rows"]) + len(d["prefetch"])
    assert rows[0].startswith(f"| `{d['rows'][0]['cache']}` | `{d['rows'][0]['codec']}` | ")
    assert "| cache | pages | prefetch | resident at step start |" in "\n".join(lines)
    first = d["prefetch"][0]
    assert rows[len(d["rows"])].endswith(f"| {first['hits']}/{first['misses']} |")


def test_cache_path_without_prefetch_rows_renders_one_table(tmp_path, capsys):
    d = json.loads((RESULTS / "codecs-cache-path-cpu.json").read_text())
    d["prefetch"] = []
    d["rows"] = d["rows"][:1]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| pages |" not in out and sum(ln.startswith("| `") for ln in out.splitlines()) == 1
