"""``aqsgd bench vs-torch`` at a tiny size: both pipelines run end to end from the same weights."""

from __future__ import annotations

import pytest

from aqsgd.bench.vs_torch import (LatencyConfig, VsTorchConfig, bench_latency, bench_vs_torch, check_losses,
                                  pipelining_supported)


@pytest.mark.skipif(pipelining_supported() is not None, reason=str(pipelining_supported()))
@pytest.mark.slow
def test_both_pipelines_run_and_start_from_the_same_loss():
    cfg = VsTorchConfig(stages=(2,), hidden=32, layers=2, seq_len=16, vocab=64, microbatch_size=2,
                        num_microbatches=3, steps=1, repeats=1)
    rows = bench_vs_torch(cfg)
    assert [(r["stages"], r["schedule"]) for r in rows] == [(2, "gpipe"), (2, "1f1b")]
    for r in rows:
        assert r["aqsgd_samples_per_s"] > 0 and r["torch_samples_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["aqsgd_samples_per_s"] / r["torch_samples_per_s"])
        assert r["aqsgd_first_loss"] == pytest.approx(r["torch_first_loss"], rel=1e-5)
    check_losses(rows)


def test_check_losses_catches_a_difference():
    rows = [{"stages": 2, "aqsgd_first_loss": 4.0, "torch_first_loss": 4.1}]
    with pytest.raises(AssertionError, match="2 stages"):
        check_losses(rows)


def test_latency_rows():
    rows = bench_latency(LatencyConfig(sizes=(4, 4096), repeats=3, rounds=1))
    assert [r["payload_bytes"] for r in rows] == [4, 4096]
    for r in rows:
        assert r["aqsgd_pingpong_ms"] > 0 and r["torch_pingpong_ms"] > 0 and r["aqsgd_handover_ms"] > 0


@pytest.mark.skipif(pipelining_supported() is None, reason="this torch runs the comparison")
def test_an_older_torch_is_refused_in_one_line():
    from aqsgd.errors import SpecError

    with pytest.raises(SpecError, match=r"^aqsgd bench vs-torch: the comparison needs torch.distributed"
                                        r".pipelining's Schedule.step\(return_outputs=...\), from torch "
                                        r"2.8 on"):
        bench_vs_torch(VsTorchConfig(stages=(2,)))
