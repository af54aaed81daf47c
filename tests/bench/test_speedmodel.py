"""The speed model of the pipeline benchmarks (:mod:`aqsgd.bench.speedmodel`): its limits, its closed forms,
and that ``bench pipeline`` and ``bench netem`` both read their rows against it."""

from __future__ import annotations

import itertools
import random

import pytest

from aqsgd.bench import pipeline, speedmodel
from aqsgd.bench.netem import sweep
from aqsgd.bench.speedmodel import BACKWARD_SHARE, pipeline_bound, row_step_time, step_time, transfer_time

SCHEDULES = ("gpipe", "1f1b")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 8), (2, 1), (2, 8), (3, 5), (4, 4), (4, 8), (8, 3)])
def test_without_communication_the_step_is_the_compute_bubble(schedule, stages, micro):
    c = 0.06
    t = step_time(schedule, stages, micro, c)
    assert t == pytest.approx((micro + stages - 1) * c)
    assert t / (micro * c) == pytest.approx((micro + stages - 1) / micro)  # the bubble over a single stage
    assert t == pytest.approx(pipeline_bound(stages, micro, c))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_stage_has_no_bubble_and_no_links(schedule):
    assert step_time(schedule, 1, 8, 0.25, [], []) == pytest.approx(8 * 0.25)
    assert step_time(schedule, 1, 8, 0.25, latency_s=1.0) == pytest.approx(8 * 0.25)  # no link to cross


def test_without_compute_the_step_is_the_comm_bound_limit():
    lf, lb = 0.3, 0.5
    for stages in (2, 3, 4):
        for micro in (1, 4, 16):
            # GPipe: the forward sweep, then the backward sweep; the two directions never overlap
            assert (step_time("gpipe", stages, micro, 0.0, lf, lb)
                    == pytest.approx((micro + stages - 2) * (lf + lb)))
    # 1F1B on two stages keeps both directions busy: one round trip, then one slower message per micro-batch
    for micro in (1, 4, 16):
        assert step_time("1f1b", 2, micro, 0.0, lf, lb) == pytest.approx(lf + lb + (micro - 1) * lb)
    # per micro-batch, the comm-bound step tends to the slower direction's message time
    assert step_time("1f1b", 2, 1000, 0.0, lf, lb) / 1000 == pytest.approx(lb, rel=1e-2)


def test_one_f_one_b_pays_for_its_in_flight_limit():
    # stage 0 holds at most S micro-batches in flight, so its period is at least one round trip / S
    c, lf, lb, s, m = 0.1, 0.05, 0.05, 4, 400
    period = step_time("1f1b", s, m, c, lf, lb) / m
    assert period == pytest.approx(c + (s - 1) / s * (lf + lb), rel=2e-2)
    assert period > max(c, lf, lb)  # the steady-state max(c, l) of the former model is out of reach


def test_gpipe_closed_form_and_the_lower_bound_hold_for_random_pipelines():
    rng = random.Random(0)
    for _ in range(300):
        s, m = rng.choice((1, 2, 3, 4, 6)), rng.choice((1, 2, 3, 8, 16))
        c, lf, lb, lat = (rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 2),
                          rng.choice((0.0, rng.uniform(0, 1))))
        if s == 1:
            lf = lb = 0.0
        f, b = (1 - BACKWARD_SHARE) * c, BACKWARD_SHARE * c
        gpipe = (s * f + (s - 1) * (lf + lat) + (m - 1) * max(f, lf)
                 + s * b + (s - 1) * (lb + lat) + (m - 1) * max(b, lb))
        assert step_time("gpipe", s, m, c, lf, lb, latency_s=lat) == pytest.approx(gpipe)
        bound = pipeline_bound(s, m, c, lf, lb, latency_s=lat)
        for schedule in SCHEDULES:
            assert step_time(schedule, s, m, c, lf, lb, latency_s=lat) >= bound - 1e-9


def test_heterogeneous_stages_and_links():
    # the busiest stage works 6 x 0.3 s between the forward of stage 0 and the backward of stage 0 (0.1 s in
    # all), the uniform pipeline of three busiest stages takes (6 + 2) x 0.3 s
    t = step_time("1f1b", 3, 6, [0.1, 0.3, 0.2], 0.0, 0.0)
    assert 0.1 + 6 * 0.3 <= t < (6 + 2) * 0.3
    assert step_time("gpipe", 3, 6, [0.1, 0.3, 0.2], 0.0, 0.0) >= 0.1 + 6 * 0.3
    with pytest.raises(ValueError, match="compute_s"):
        step_time("1f1b", 3, 6, [0.1, 0.3], 0.0, 0.0)
    with pytest.raises(ValueError, match="forward_s"):
        step_time("1f1b", 3, 6, 0.1, [0.1], 0.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        step_time("zigzag", 2, 2, 0.1)


def _row(**kw):
    return {"setting": "fp32", "stages": 2, "bandwidth_mbps": 100.0, "compute_per_mb_s": 0.06,
            "bytes_per_mb": 524352.0, "num_microbatches": 8, "step_s": 1.0, "samples_per_s": 32.0, **kw}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 4])
def test_the_step_never_grows_with_bandwidth(schedule, stages):
    row = _row(stages=stages, schedule=schedule, compute_per_mb_s=0.05)
    times = [row_step_time(row, bw) for bw in (1, 3, 10, 30, 100, 300, 1000, 10000, 1e7)]
    assert all(a >= b for a, b in itertools.pairwise(times))
    assert times[-1] == pytest.approx((8 + stages - 1) * 0.05, rel=1e-3)  # the compute bubble in the limit


def test_row_step_time_reads_the_rows_fields():
    row = _row(stage_compute_per_mb_s=[0.05, 0.06], fw_bytes_per_mb=[33000.0], bw_bytes_per_mb=[66000.0],
               sync_bytes=1e6, sync_load=2, latency_ms=5.0)
    bps = 100e6
    expected = step_time("1f1b", 2, 8, [0.05, 0.06], transfer_time(33000, bps), transfer_time(66000, bps),
                         latency_s=0.005, sync_s=transfer_time(2e6, bps))
    assert row_step_time(row) == pytest.approx(expected)
    # rows of older result files: the busiest stage and the larger message everywhere, GPipe when they say so
    old = _row(schedule="gpipe")
    lt = transfer_time(524352, bps)
    assert row_step_time(old) == pytest.approx(step_time("gpipe", 2, 8, 0.06, lt, lt))


def test_both_benchmarks_read_their_rows_against_the_same_model(monkeypatch):
    calls = []
    real = speedmodel.step_time

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(speedmodel, "step_time", spy)
    rows = pipeline.summarize([_row(), _row(setting="aqsgd fw2/bw4", bytes_per_mb=66112.0, step_s=0.5)])
    assert len(calls) == 2
    assert rows[1]["ideal_step_s"] == pytest.approx(row_step_time(_row(setting="x", bytes_per_mb=66112.0)))
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["ideal_step_s"] / 0.5)
    assert rows[0]["ideal_speedup"] == 1.0 and rows[1]["ideal_speedup"] > 1.0

    calls.clear()
    netem_rows = [_row(link_mbps=95.6, bandwidth_mbps=100.0),
                  _row(setting="aqsgd fw2/bw4", bytes_per_mb=66112.0, link_mbps=95.6, bandwidth_mbps=100.0)]
    out = sweep._summarize_with_link_rate(netem_rows)
    assert len(calls) == 2 and sweep.summarize is pipeline.summarize
    assert [r["bandwidth_mbps"] for r in out] == [100.0, 100.0]  # the nominal rate is reported ...
    lt = transfer_time(524352, 95.6e6)  # ... and the model runs over the measured goodput
    assert calls[0][0][3:6] == (0.06, [lt], [lt])
