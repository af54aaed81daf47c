"""``aqsgd train`` from the command line: presets, overrides, errors, and both runtimes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aqsgd.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--task", "synthetic-lm", "--max-train-samples", "32", "--max-eval-samples", "16", "--max-length",
         "12", "--micro-batches", "2", "--micro-batch-size", "4", "--epochs", "2", "--lr", "3e-3",
         "--no-progress", "--no-tensorboard"]


def test_every_option_is_documented():
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0
    from aqsgd.train.config import options

    for o in options():
        assert o.flag in out.stdout, o.flat
        assert o.help.split()[0] in out.stdout


@pytest.mark.parametrize("argv,needle", [(["--lr", "fast"], "--lr"), (["--stages", "0"], "--stages"),
                                         (["--backward", "q0"], "--backward"),
                                         (["--cache", "tape"], "--cache"),
                                         (["--config", "/nonexistent.toml"], "--config"),
                                         (["--data-parallel", "2"], "--data-parallel")])
@pytest.mark.slow
def test_invalid_value_is_one_line_naming_the_option(argv, needle):
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *argv], capture_output=True, text=True)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_preset_with_override_runs_locally(tmp_path, capsys):
    rc = main(["train", "--config", str(ROOT / "configs" / "synthetic-quick.toml"), *QUICK, "--stages", "3",
               "--output-dir", str(tmp_path), "--run-name", "cli", "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "traffic saved vs fp32" in out
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    # override and preset
    assert cfg["pipeline"]["stages"] == 3 and cfg["compression"]["forward"] == "delta:q2:l2"
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["steps"] == 8


@pytest.mark.slow
def test_distributed_runtime_starts_one_process_per_stage(tmp_path):
    out = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *QUICK, "--stages", "2", "--runtime",
                          "distributed", "--output-dir", str(tmp_path), "--run-name", "dist", "--cache-dir",
                          str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "dist" / "summary.json").read_text())
    assert summary["runtime"] == "distributed" and summary["steps"] == 8
    local = subprocess.run([sys.executable, "-m", "aqsgd.cli", "train", *QUICK, "--stages", "2",
                            "--output-dir", str(tmp_path), "--run-name", "local", "--cache-dir",
                            str(tmp_path / "cache")],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0
    assert (json.loads((tmp_path / "local" / "summary.json").read_text())["final_train_loss"]
            == summary["final_train_loss"])
