"""The netem sweep end to end on a tiny model, with data parallelism: four processes on a chain of shaped
links (root and iproute2 needed; skipped elsewhere with the reason)."""

from __future__ import annotations

import pytest

from aqsgd.bench.netem import NetemBenchConfig, bench_netem, netem_unavailable_reason, variant_label

_REASON = netem_unavailable_reason()
pytestmark = [pytest.mark.netem, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


@pytest.mark.slow
def test_sweep_with_data_parallel_rows(tmp_path):
    cfg = NetemBenchConfig(bandwidths_mbps=[50.0], settings=("fp32", "aqsgd fw2/bw4"), hidden=64, layers=2,
                           seq_len=32, vocab=128, measure_steps=2, timeout_s=60, data_parallel=2,
                           dp_settings=("fp32",), grad_syncs=("allreduce", "q8"))
    report = bench_netem(cfg, tmp_path)
    rows = {variant_label(r): r for r in report["rows"]}
    assert set(rows) == {"fp32", "aqsgd fw2/bw4", "fp32, D=2 allreduce", "fp32, D=2 q8"}
    assert rows["fp32"]["sync_bytes"] == 0 and rows["fp32"]["sync_load"] == 0
    full, q8 = rows["fp32, D=2 allreduce"], rows["fp32, D=2 q8"]
    assert full["sync_load"] == 2 and full["speedup_vs_fp32"] == 1.0
    # q8 sends about a quarter of the fp32 all-reduce's bytes (scales and padding on top)
    assert 0.2 < q8["sync_bytes"] / full["sync_bytes"] < 0.35
    for r in report["rows"]:
        assert r["samples_per_s"] > 0 and r["ideal_speedup"] > 0 and r["efficiency"] > 0
    assert report["links"]["50"]["forward_mbps"] > 40


@pytest.mark.long  # about 45 s of real shaped links, timed: run by hand with -m long
def test_one_tc_setting_per_boundary_that_changes_during_the_run(tmp_path):
    from aqsgd.bench.netem import bench_netem_links

    cfg = NetemBenchConfig(stages=2, settings=("fp32", "auto"), hidden=256, layers=2, seq_len=128, vocab=128,
                           measure_steps=6, timeout_s=60)
    # 128 KB of fp16 activations per micro-batch, 8 per step: ~4 ms each at 300 Mbit/s, ~100 ms at 10 Mbit/s,
    # against ~20 ms of compute. A sender sees a message as sent once the kernel has taken it: the slow link
    # shows where the receiver sees the messages arrive held back.
    report = bench_netem_links(cfg, "300mbit~10mbit@3", tmp_path)
    assert report["goodput_mbps"][0] > 200  # measured with the initial setting
    rows = {r["setting"]: r for r in report["rows"]}
    auto = rows["auto"]["codecs"]
    assert auto[1]["b0.forward"] == "delta:fp16"  # 300 Mbit/s: no compression needed
    assert auto[-1]["b0.forward"] != "delta:fp16", auto  # re-shaped to 10 Mbit/s at step 3: more compression
    assert "ideal_step_s" not in rows["fp32"]  # no single link speed to model a changing link with
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0 and rows["auto"]["samples_per_s"] > 0
