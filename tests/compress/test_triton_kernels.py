"""The Triton kernels under Triton's interpreter, on CPU tensors (the cases: ``triton_cases.py``), in a
process of their own: Triton reads ``TRITON_INTERPRET`` when it is first imported, which in the suite's
process may have happened already (torch imports it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("triton_cases.py")
COMPILE_CASES = Path(__file__).with_name("triton_compile_cases.py")


def test_every_triton_kernel_equals_the_other_backends_byte_for_byte():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=CASES.parents[2])
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


def test_every_triton_kernel_compiles_for_a_gpu():
    """``triton_compile_cases.py``: each kernel compiled for an H100 here, without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(COMPILE_CASES)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=COMPILE_CASES.parents[2])
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
