"""``aqsgd bench codecs`` on a busy machine: the clone timed beside each codec is the reference of its ratios,
so a clone rate that varies widely between codecs is said to make the ratios unreliable (no real timing
here)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from aqsgd.bench import codecs as bench
from aqsgd.bench.codecs import CodecRow, bench_codecs, clone_spread_warning, write_json


def _row(codec: str, clone_gbps: float) -> CodecRow:
    return CodecRow(codec=codec, device="cpu", shape=[4, 8], dtype="float32", encode_gbps=1.0,
                    decode_gbps=1.0, roundtrip_gbps=0.5, clone_gbps=clone_gbps,
                    encode_vs_clone=1.0 / clone_gbps, decode_vs_clone=1.0 / clone_gbps, wire_bytes=16,
                    ratio=8.0, max_abs_err=0.0, rel_err=0.0)


def test_a_clone_rate_that_varies_over_2x_is_said_to_make_the_ratios_unreliable():
    rows = [_row("q8", 20.0), _row("q4", 7.4), _row("q2", 15.0)]
    assert clone_spread_warning(rows) == (
        "the clone rate varied 2.7x between codecs (7.40 GB/s beside q4, 20.00 GB/s beside q8): the machine "
        "was busy; the ratios are unreliable")


@pytest.mark.parametrize("clones", [[20.0, 10.0], [12.0, 11.0, 13.0], [9.0]])
def test_a_steady_clone_rate_gives_no_warning(clones):
    # 2x exactly is still within the limit; one codec has nothing to compare with
    assert clone_spread_warning([_row(f"q{i + 1}", c) for i, c in enumerate(clones)]) is None


def _fake_timer(clone_seconds: list[float]):
    """``interleaved_medians`` that times nothing: the clone's median is the next of ``clone_seconds`` (one
    per codec), every other call's 1 ms."""
    left = list(clone_seconds)

    def medians(calls, *, device, warmup, repeats):
        return {name: left.pop(0) if name == "clone" else 1e-3 for name in calls}

    return medians


def test_the_bench_warns_and_records_a_busy_machine(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(bench, "interleaved_medians", _fake_timer([1e-3, 3e-3, 1.5e-3]))
    with caplog.at_level(logging.WARNING, logger="aqsgd.bench.codecs"):
        rows = bench_codecs(["q8", "q4", "fp16"], shape=(4, 8), repeats=1, warmup=1)
    assert [r.clone_gbps for r in rows] == pytest.approx([128e-9 / 1e-3, 128e-9 / 3e-3, 128e-9 / 1.5e-3])
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("the clone rate varied 3.0x between codecs (") and "beside q4," in warning
    assert warning.endswith("the machine was busy; the ratios are unreliable")
    path = tmp_path / "codecs.json"
    write_json(rows, path, device=torch.device("cpu"), command="aqsgd bench codecs")
    assert json.loads(path.read_text())["warnings"] == [warning]


def test_a_quiet_machine_gets_no_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(bench, "interleaved_medians", _fake_timer([1e-3, 1.2e-3]))
    with caplog.at_level(logging.WARNING, logger="aqsgd.bench.codecs"):
        rows = bench_codecs(["q8", "q4"], shape=(4, 8), repeats=1, warmup=1)
    assert not caplog.records
    path = tmp_path / "codecs.json"
    write_json(rows, path, device=torch.device("cpu"), command="aqsgd bench codecs")
    assert json.loads(path.read_text())["warnings"] == []


def test_the_warm_allocator_keeps_a_results_pages_mapped():
    """A 12.6 MB result allocated anew in each timed call: with glibc's mmap threshold held low (as a
    process's history can leave it) every call maps 3,072 fresh pages, timed as the copy; inside
    warm_allocator none do once the heap has grown (a warm-up). In a process of its own: mallopt is
    process-wide."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from aqsgd.bench.timing import minor_faults, warm_allocator\n"
            "x = torch.randn(8, 512, 768)\n"
            "def faults():\n"
            "    for _ in range(15): x.clone()  # the warm-up: the heap grows to the working set\n"
            "    before = minor_faults()\n"
            "    for _ in range(10): x.clone()\n"
            "    return (minor_faults() - before) / 10\n"
            "cold = faults()\n"
            "with warm_allocator() as warm:\n"
            "    hot = faults()\n"
            "print(cold, hot, warm)\n")
    env = {**__import__("os").environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cold, hot, warm = out.stdout.split()
    assert warm == "True" and float(cold) > 1000 and float(hot) < 10, out.stdout


def test_a_subspace_codec_is_also_timed_as_trainings_sender_runs_it():
    """Training's sender adds each message's rows to the next basis's estimate and refreshes it every N
    messages: the row's ``learning_encode_gbps`` is the encode with both, so below the encode's rate; other
    codecs have none."""
    rows = bench_codecs(["q4:pca/4", "q4"], shape=(2, 16, 32), repeats=2, warmup=1)
    subspace, plain = rows
    assert 0 < subspace.learning_encode_gbps < subspace.encode_gbps
    assert plain.learning_encode_gbps is None


def test_a_refresh_is_timed_on_copies_of_the_state():
    x = torch.randn(64, 32)
    codec = bench.codec_for("q4:pca8", x)
    state = codec.state
    state.observe(x)
    basis, version = state.basis.clone(), state.version
    assert bench.refresh_seconds(state, torch.device("cpu")) > 0
    assert state.version == version and torch.equal(state.basis, basis)  # the codec's own state unchanged
    assert bench.refresh_seconds(bench.codec_for("q4:pca8:refresh0", x).state, torch.device("cpu")) == 0.0
