"""``benchmarks.projection_roofline``: every product's operation count is the one its shapes give, and the
JSON names its command (a tiny message: nothing here is a timing claim)."""

from __future__ import annotations

import json

import pytest

from benchmarks.projection_roofline import main, measure


def test_each_products_rate_is_its_operation_count_over_its_time():
    out = measure((2, 8, 32), 4, repeats=2, warmup=1, square=16)
    rows, d, r = 16, 32, 8
    flops = {"encode projection z U^T": 2 * rows * d * r, "decode c U": 2 * rows * r * d,
             "sender's sum z^T z": 2 * rows * d * d, "projection in bf16 (cast included)": 2 * rows * d * r,
             "square fp32 16^3": 2 * 16 ** 3}
    assert set(out) == {"clone", *flops}
    assert out["clone"]["vs_clone"] == 1.0 and out["clone"]["gflops"] == 0.0
    for name, n in flops.items():
        assert out[name]["gflops"] == pytest.approx(n / (out[name]["ms"] / 1e3) / 1e9)


def test_the_json_names_the_command(tmp_path, capsys):
    path = tmp_path / "roofline.json"
    main(["--shape", "2", "8", "32", "--repeats", "2", "--warmup", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["command"].startswith("python -m benchmarks.projection_roofline --shape 2 8 32")
    assert data["benchmark"] == "projection-roofline" and data["shape"] == [2, 8, 32]
    assert "sender's sum z^T z" in data["results"]
    assert "GFLOP/s" in capsys.readouterr().out
