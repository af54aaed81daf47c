"""``aqsgd bench codecs --quality``: the rate-distortion table and its references."""

from __future__ import annotations

import json
import math

import pytest
import torch

from aqsgd.bench.quality import (
    BITS,
    DEFAULT_VARIANTS,
    REFERENCE_LABELS,
    bench_quality,
    gaussian_uniform_mse,
    optimal_uniform_mse,
    reference_rows,
    shannon_bound,
)
from aqsgd.cli import main


@pytest.fixture(scope="module")
def rows():
    return bench_quality(shape=(64, 1024), seed=0)


def by_label(rows):
    return {r.label: r for r in rows}


@pytest.mark.parametrize("bits,expected", [(1, 0.3634), (2, 0.1188), (3, 0.03744), (4, 0.01154)])
def test_best_uniform_quantizer_matches_max_1960(bits, expected):
    mse, step = optimal_uniform_mse(2**bits)
    assert mse == pytest.approx(expected, rel=2e-3)
    assert 0 < step < 12 / (2**bits - 1)


def test_one_bit_optimum_is_closed_form():
    mse, step = optimal_uniform_mse(2)
    assert mse == pytest.approx(1 - 2 / math.pi, abs=1e-9)
    assert step == pytest.approx(2 * math.sqrt(2 / math.pi), abs=1e-5)  # levels at +-E|x|


def test_uniform_mse_formula_against_sampling():
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for levels, step in ((3, 1.2), (4, 1.0), (8, 0.6), (15, 0.3)):
        centers = (torch.arange(levels, dtype=torch.float64) - (levels - 1) / 2) * step
        y = centers[(x.unsqueeze(1) - centers).abs().argmin(1)]
        sampled = float((y - x).square().mean())
        assert gaussian_uniform_mse(levels, step) == pytest.approx(sampled, rel=0.01)
    assert gaussian_uniform_mse(1, 0.5) == 1.0


def test_optimum_is_a_minimum():
    for levels in (3, 4, 16, 255, 256):
        mse, step = optimal_uniform_mse(levels)
        for factor in (0.98, 1.02):
            assert mse <= gaussian_uniform_mse(levels, step * factor)


def test_table_has_every_variant_and_reference(rows):
    labels = [r.label for r in rows]
    assert labels == [v[0] for v in DEFAULT_VARIANTS] + list(REFERENCE_LABELS.values())
    for r in rows:
        assert len(r.rel_mse) == len(BITS)
        assert all(e is not None and math.isfinite(e) and e > 0 for e in r.rel_mse)
        if r.kind == "codec":
            assert r.specs[0].startswith("q1") and r.specs[-1].startswith("q8") and r.scale_bits > 0


def test_reference_columns_follow_the_formulas(rows):
    t = by_label(rows)
    for i, b in enumerate(BITS):
        assert t[REFERENCE_LABELS["shannon"]].rel_mse[i] == shannon_bound(b) == 2.0 ** (-2 * b)
        assert t[REFERENCE_LABELS["uniform_midrise"]].rel_mse[i] == optimal_uniform_mse(2**b)[0]
        assert t[REFERENCE_LABELS["uniform_midtread"]].rel_mse[i] == optimal_uniform_mse(max(2, 2**b - 1))[0]
    assert [r.rel_mse for r in reference_rows()] == [t[label].rel_mse for label in REFERENCE_LABELS.values()]


def test_codecs_against_the_references(rows):
    t = by_label(rows)
    # q1 at its default (mean |x|) scale sits on the 1-bit optimum; the max-abs scale is worse than zeros
    assert t["default"].rel_mse[0] < 1 and t["default"].rel_mse[0] == pytest.approx(1 - 2 / math.pi, abs=0.01)
    assert t["max"].rel_mse[0] > 1 and t["max"].specs[0] == "q1:max"
    # no default-rounding variant is worse than sending zeros, at any width, except an explicit q1:max
    for r in rows:
        if r.kind == "codec" and r.label != "stochastic":
            errs = r.rel_mse[1:] if r.label == "max" else r.rel_mse
            assert max(errs) < 1, r.label
    shannon = t[REFERENCE_LABELS["shannon"]].rel_mse
    for r in rows:
        if r.kind == "codec":
            assert all(e > s for e, s in zip(r.rel_mse, shannon)), r.label


def test_l2_midrise_is_the_best_uniform_quantizer():
    # one scale for many samples: l2 clipping on the mid-rise grid puts the outermost level where Max's
    # optimal uniform quantizer has it, so the measured error matches the computed optimum
    rows = bench_quality([("tensor:l2:midrise", ":tensor:l2:midrise:scale32")], bits=(1, 2, 3, 4),
                         shape=(1024, 1024))
    for b, e in zip((1, 2, 3, 4), rows[0].rel_mse):
        assert e == pytest.approx(optimal_uniform_mse(2**b)[0], rel=0.02)


def test_variant_invalid_at_some_width_is_blank():
    rows = bench_quality([("mean", ":mean")], shape=(16, 64))
    assert rows[0].rel_mse[0] is not None and rows[0].rel_mse[1:] == [None] * 7
    assert rows[0].specs == ["q1"] + [None] * 7


def test_cli_writes_table_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    assert main(["bench", "codecs", "--quality", "--shape", "32,256", "--device", "cpu", "--json", str(out),
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Shannon bound" in text and "best uniform" in text and "b=8" in text
    data = json.loads(out.read_text())
    assert data["benchmark"] == "codecs-quality"
    assert data["command"].startswith("aqsgd bench codecs --quality")
    assert data["data"]["shape"] == [32, 256] and data["bits"] == list(BITS)
    assert len(data["rows"]) == len(DEFAULT_VARIANTS) + 3
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_quality_rejects_codecs_and_png_needs_quality(tmp_path):
    assert main(["bench", "codecs", "--quality", "--codecs", "q4", "--device", "cpu"]) == 2
    assert main(["bench", "codecs", "--png", str(tmp_path / "x.png"), "--device", "cpu"]) == 2


def test_quality_option_misuse_is_one_line(capsys):
    from aqsgd.cli import main

    assert main(["bench", "codecs", "--device", "cpu", "--png", "x.png"]) == 2
    assert capsys.readouterr().err.strip() == "aqsgd: error: --png: plots the --quality table; add --quality"
    assert main(["bench", "codecs", "--device", "cpu", "--quality", "--codecs", "q2"]) == 2
    assert "leave --codecs out" in capsys.readouterr().err
