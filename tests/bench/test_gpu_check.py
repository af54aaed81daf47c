"""``python -m benchmarks.gpu_check``: the GPU check runs its steps within a budget and reports them; checked
here on the CPU with tiny settings (``--smoke``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_smoke_run_reports_every_step_it_ran(tmp_path):
    out = tmp_path / "out"
    steps = "codecs,codecs-topk11,codecs-subspace,dp-nccl,suite"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "run", "--budget", "200",
                           "--out", str(out), "--smoke", "--only", steps],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == ["codecs", "codecs-topk11", "codecs-subspace", "dp-nccl", "suite"]
    assert steps["codecs"]["rc"] == 0 and ({r["codec"] for r in steps["codecs"]["figures"]["rows"]}
                                           == {"q2", "fp16"})
    topk11 = steps["codecs-topk11"]
    assert topk11["rc"] == 0
    assert {r["codec"] for r in topk11["figures"]["rows"]} == {"topk0.1", "topk0.1+q8:token"}
    subspace = steps["codecs-subspace"]
    assert subspace["rc"] == 0 and len(subspace["figures"]["rows"]) == 5
    assert steps["suite"]["rc"] == 0 and steps["suite"]["figures"]["passed"] > 0
    # NCCL on a machine without a GPU: refused before any stage process starts, in one line
    assert steps["dp-nccl"]["rc"] == 2 and steps["dp-nccl"]["figures"]["refused_in_one_line"]
    assert steps["dp-nccl"]["figures"]["line"].startswith(
        "aqsgd: error: --dp-backend nccl: NCCL runs on GPUs only")
    assert data["env"]["torch"] and "| codecs | 0 |" in (out / "gpu-check.md").read_text()
    assert "=== suite: rc=0" in (out / "log.txt").read_text()


def test_a_step_without_time_left_is_skipped_and_said(tmp_path):
    check = gpu_check.Check(8.0, tmp_path, tmp_path)
    record = check.step("late", 100, [sys.executable, "-c", "print(1)"])
    assert record["rc"] is None and record["skipped"] == "no time left"
    data = check.report({"gpu": None})
    assert "| late | None | 0.0 | no time left |" in (tmp_path / "gpu-check.md").read_text()
    assert data["steps"][0]["name"] == "late"


def test_pytest_counts_read_the_summary_line():
    assert gpu_check._pytest_counts("...\n3 failed, 120 passed, 4 skipped, 1 error in 9.1s") == {
        "failed": 3, "passed": 120, "skipped": 4, "error": 1}


def test_the_failure_log_names_each_failure_as_it_happens(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    assert True\n\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no fixture')\n\n"
        "def test_err(broken):\n    pass\n\n"
        "def test_lines():\n    assert False, 'rank 0:\\nthe reason'\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "AQSGD_TEST_LOG": str(log), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "benchmarks.pytest_failure_log", str(tmp_path / "test_some.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("CALL test_some.py::test_bad: AssertionError: one is not two")
    assert lines[1].startswith("SETUP test_some.py::test_err: RuntimeError: no fixture")
    assert lines[2].startswith("CALL test_some.py::test_lines: AssertionError: rank 0: | the reason")
    # reversed (the GPU check's second call): the same failures, the last test's first
    log.unlink()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "benchmarks.pytest_failure_log", str(tmp_path / "test_some.py")],
                          cwd=tmp_path, env={**env, "AQSGD_TEST_REVERSE": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert [line.split(":")[2] for line in log.read_text().splitlines()] == ["test_lines", "test_err",
                                                                            "test_bad"], proc.stdout[-2000:]
