"""``aqsgd bench overhead``: the plain loop and the local pipeline train the same model on the same data, and
the result says how their step times compare."""

from __future__ import annotations

import json
import math

import pytest

from aqsgd.bench.overhead import OverheadConfig, bench_overhead
from aqsgd.cli import main

TINY = dict(stages=(1, 2), hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48, vocab=64, seq_len=8,
            microbatch_size=2, num_microbatches=2, steps=1, rounds=2, device="cpu")


def test_every_system_starts_from_the_same_model_and_data():
    result = bench_overhead(OverheadConfig(**TINY))
    rows = result["rows"]
    assert [(r["system"], r["stages"]) for r in rows] == [("plain", None), ("aqsgd", 1), ("aqsgd", 2)]
    assert result["dtype"] == "fp32" and result["device"] == "cpu" and result["parameters"] > 0
    first = [r["first_loss"] for r in rows]
    assert all(math.isclose(f, first[0], rel_tol=1e-5) for f in first), first  # same weights, same batches
    for r in rows[1:]:
        assert r["ratio"] == pytest.approx(rows[0]["step_s"] / r["step_s"])
        assert result["ratio"][str(r["stages"])] == r["ratio"]
    assert all(r["step_s"] > 0 and r["samples_per_s"] > 0 for r in rows)


def test_the_command_writes_json(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--stages", "1,2", "--hidden", "32", "--layers", "2", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "48", "--vocab", "64", "--seq-len", "8",
            "--micro-batch-size", "2", "--micro-batches", "2", "--steps", "1", "--rounds", "1",
            "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "overhead" and data["command"].startswith("aqsgd bench overhead --stages 1,2")
    assert set(data["ratio"]) == {"1", "2"} and data["versions"]["torch"] and data["machine"]
    out_text = capsys.readouterr().out
    assert "plain" in out_text and f"wrote {out}" in out_text.replace("\n", "")


def test_more_stages_than_layers_is_one_line(capsys):
    assert main(["bench", "overhead", "--stages", "1,9", "--layers", "2"]) == 2
    assert capsys.readouterr().err.strip() == "aqsgd: error: --stages 1,9: each must be in 1..--layers (2)"
