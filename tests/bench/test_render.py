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
    assert lines[1].startswith("| cache | codec | fused | sender GB/s | receiver GB/s | clone GB/s |")
    rows = [ln for ln in lines if ln.startswith("| `")]
    assert len(rows) == len(d["rows"]) + len(d["prefetch"])
    r0 = d["rows"][0]
    assert rows[0].startswith(f"| `{r0['cache']}` | `{r0['codec']}` | {'yes' if r0['fused'] else 'no'} | ")
    assert f"| {r0['eager_sender_ms']:.2f} / {r0['eager_receiver_ms']:.2f} |" in rows[0]
    assert "| cache | pages | prefetch | resident at step start |" in "\n".join(lines)
    first = d["prefetch"][0]
    assert rows[len(d["rows"])].endswith(f"| {first['hits']}/{first['misses']} |")


def test_cache_path_file_without_the_fused_columns_renders(tmp_path, capsys):
    """A file written before the fused step (no ``fused`` / ``eager_*_ms``) renders with "no" and "-"."""
    d = json.loads((RESULTS / "codecs-cache-path-cpu.json").read_text())
    for r in d["rows"]:
        for key in ("fused", "eager_sender_ms", "eager_receiver_ms"):
            r.pop(key)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    assert main([str(path)]) == 0
    first = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| `"))
    assert "| no |" in first and "| - |" in first


def test_cache_path_without_prefetch_rows_renders_one_table(tmp_path, capsys):
    d = json.loads((RESULTS / "codecs-cache-path-cpu.json").read_text())
    d["prefetch"] = []
    d["rows"] = d["rows"][:1]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| pages |" not in out and sum(ln.startswith("| `") for ln in out.splitlines()) == 1


def _codec_rows(eager: bool) -> dict:
    row = {"codec": "q2", "encode_gbps": 8.0, "decode_gbps": 12.0, "clone_gbps": 20.0, "encode_vs_clone": 0.4,
           "decode_vs_clone": 0.6, "wire_bytes": 788032, "ratio": 16.0}
    if eager:
        row.update(eager_encode_gbps=2.0, eager_decode_gbps=4.0)
    return {"benchmark": "codecs", "command": "aqsgd bench codecs", "machine": "test", "rows": [row]}


def test_codec_throughput_renders_the_eager_columns_when_measured(tmp_path, capsys):
    for eager in (False, True):
        path = tmp_path / f"codecs-{eager}.json"
        path.write_text(json.dumps(_codec_rows(eager)))
        assert main([str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        header, rule, row = lines[1], lines[2], lines[3]
        assert header.count("|") == rule.count("|") == row.count("|")
        assert ("eager encode GB/s" in header) == eager
        if eager:
            assert "| 2.00 | 4.00 | 4.0x / 3.0x |" in row, row


def test_codec_quality_of_named_specs_renders_one_table_per_source(capsys):
    path = RESULTS / "codecs-quality-under-1.5-bits.json"
    d = json.loads(path.read_text())
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    specs = list(dict.fromkeys(r["spec"] for r in d["rows"]))
    sources = list(dict.fromkeys(r["source"] for r in d["rows"]))
    assert [ln for ln in out.splitlines() if ln.endswith(":")] == [f"{s}:" for s in sources]
    assert sum(ln.startswith("| `") for ln in out.splitlines()) == len(specs) * len(sources)
    r = d["rows"][0]
    assert f"| {r['bits_per_value']:.2f} | {r['rel_mse']:.3g} |" in out


def test_every_result_file_renders(capsys):
    """The docs say ``python -m benchmarks.render FILE.json`` prints the tables of any file in results/."""
    paths = sorted(RESULTS.glob("*.json"))
    assert paths
    for path in paths:
        assert main([str(path)]) == 0, path
        out = capsys.readouterr().out
        assert out.startswith(f"<!-- {path}: ") and "\n|" in out, path


def test_a_result_of_an_unknown_kind_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"benchmark": "odd", "rows": []}))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{path} holds a 'odd' result" in err and "vs-torch" in err


def test_vs_torch_result_renders_both_tables(capsys):
    path = RESULTS / "vs-torch.json"
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    d = json.loads(path.read_text())
    for r in d["rows"]:
        assert f"| {r['stages']} | {r['torch_schedule']} | {r['aqsgd_samples_per_s']:.1f} | " in out
        assert f"| {r['ratio']:.2f}x |" in out
    for r in d["latency"]:
        assert (f"| {r['payload_bytes']:,} | {r['aqsgd_handover_ms']:.3f} / {r['torch_handover_ms']:.3f} "
                in out)


def test_codec_quality_rows_are_the_docs_rows(capsys):
    """The Gaussian table of docs/bench-codecs.md is this file's first table, row for row."""
    assert main([str(RESULTS / "codecs-quality.json")]) == 0
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    rows = [ln for ln in table if ln.startswith(("| `", "| default |"))]  # header, the 14 codec rows
    doc = (RESULTS.parents[1] / "docs" / "bench-codecs.md").read_text()
    assert len(rows) == 15
    for row in rows:
        assert row in doc, row


def test_codec_throughput_renders_the_device_operations_when_profiled(tmp_path, capsys):
    d = _codec_rows(True)
    d["rows"][0].update(encode_kernels=3, encode_kernel_us=11.4, decode_kernels=1, decode_kernel_us=6.6)
    path = tmp_path / "codecs-cuda.json"
    path.write_text(json.dumps(d))
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rule, row = lines[1], lines[2], lines[3]
    assert header.count("|") == rule.count("|") == row.count("|")
    assert "device ops enc / dec" in header and "| 3 / 1 | 11 / 7 |" in row, row
