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


# A kernel with a loop bounded by a runtime argument, as ours have. Triton 3.6's interpreter turns that bound
# into a Python int from a one-element array, which numpy 2.4 refuses ("only 0-dimensional arrays can be
# converted to Python scalars"); Triton 3.9's does not. Found on a GPU machine (Triton 3.6, numpy 2.4).
PROBE = """
import triton, triton.language as tl, torch
@triton.jit
def k(x, n, B: tl.constexpr):
    for s in range(0, n, B):
        tl.store(x + s + tl.arange(0, B), tl.arange(0, B).to(tl.float32))
x = torch.zeros(8)
k[(1,)](x, 8, B=4)
assert x.tolist() == [0, 1, 2, 3] * 2
"""


def _interpreter_fault() -> str | None:
    """None where Triton's interpreter runs the probe; otherwise what it said, with the versions."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode == 0:
        return None
    import numpy
    import triton

    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return f"Triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__}: {last}"


def _failed(stdout: str) -> str:
    """The FAILED lines first (a failure log keeps a message's first line), then the output's tail."""
    failed = [line for line in stdout.splitlines() if line.startswith("FAILED")]
    return f"{len(failed)} failed: " + "; ".join(failed[:20]) + "\n" + stdout[-4000:]


@pytest.mark.slow
def test_every_triton_kernel_equals_the_other_backends_byte_for_byte():
    fault = _interpreter_fault()
    if fault:
        pytest.skip(fault)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=CASES.parents[2])
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, _failed(out.stdout) + out.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


def test_every_triton_kernel_compiles_for_a_gpu():
    """``triton_compile_cases.py``: each kernel compiled for an H100 here, without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(COMPILE_CASES)],
                         capture_output=True, text=True, env=env, timeout=900, cwd=COMPILE_CASES.parents[2])
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary


def test_a_column_max_splits_its_rows_to_keep_a_gpu_busy():
    """``[4096, 768]`` (8 x 512 tokens of a 768-wide activation): 6 programs of 128 columns, each of which
    looped over all 4096 rows (315 us on an H100); split into 64 row ranges of 64, 384 programs. Every row
    is in exactly one range; few rows, or no rows, are one range."""
    from aqsgd.compress.kernels.triton import _BLOCK_R, _row_splits

    assert _row_splits(4096, 768) == (64, 64)
    assert _row_splits(15, 64) == (1, 16) and _row_splits(0, 64) == (1, 16)
    for rows, k in ((4096, 768), (40, 136), (900, 16), (17, 65536), (1, 8), (100000, 4096)):
        splits, chunk = _row_splits(rows, k)
        assert chunk % _BLOCK_R == 0 and (splits - 1) * chunk < max(rows, 1) <= splits * chunk, (rows, k)


def test_the_topk_radix_digits_cover_the_key_from_its_top(monkeypatch):
    """Every layout's digits tile the 31-bit magnitude key from its top bit down, each digit's mask the bits
    above it; the default is the four 8-bit passes (measured faster on an H200); a layout not offered is
    refused in one line naming the variable."""
    from aqsgd.compress.kernels.triton import TOPK_DIGIT_BITS, _topk_digits, topk_digits

    assert topk_digits(11) == ((20, 11, 0), (9, 11, 0x7FF00000), (0, 9, 0x7FFFFE00))
    assert topk_digits(8) == ((23, 8, 0), (15, 8, 0x7F800000), (7, 8, 0x7FFF8000), (0, 7, 0x7FFFFF80))
    for bits in TOPK_DIGIT_BITS:
        digits = topk_digits(bits)
        assert sum(n for _, n, _ in digits) == 31 and digits[-1][0] == 0
        for (shift, nbits, high), (nshift, nnbits, nhigh) in zip(digits, digits[1:]):
            assert nshift + nnbits == shift and nhigh == high | (((1 << nbits) - 1) << shift)
    monkeypatch.delenv("AQSGD_TOPK_DIGIT_BITS", raising=False)
    assert _topk_digits() == topk_digits(8)
    monkeypatch.setenv("AQSGD_TOPK_DIGIT_BITS", "11")
    assert _topk_digits() == topk_digits(11)
    monkeypatch.setenv("AQSGD_TOPK_DIGIT_BITS", "6")
    with pytest.raises(ValueError, match="^AQSGD_TOPK_DIGIT_BITS=6: one of 11, 8$"):
        _topk_digits()
