"""The diloco study's figures: a run's time over a slow data-parallel link and its time to fp32's loss
(aqsgd.bench.dpsync), checked by hand; and the study itself on 2 stages x 2 replicas."""

import json

import pytest

from aqsgd.bench.convergence import study_table
from aqsgd.bench.dpsync import elapsed, sync_curve, sync_delay, time_to_target
from aqsgd.cli import main


def _rows():
    # two stages; each stage row is the mean over its replicas (what one rank sent)
    return [
        {"step": 1, "loss": 3.0, "stages": [{"step_s": 0.5, "sync_bytes": 0.0},
                                            {"step_s": 0.4, "sync_bytes": 0.0}]},
        {"step": 2, "loss": 2.0, "stages": [{"step_s": 0.5, "sync_bytes": 3.75e6},
                                            {"step_s": 0.6, "sync_bytes": 1e6}]},
        {"step": 3, "loss": None, "stages": [{"step_s": 0.5, "sync_bytes": 0.0},
                                             {"step_s": 0.5, "sync_bytes": 0.0}]},
        {"step": 4, "loss": 1.0, "stages": [{"step_s": 1.0, "sync_bytes": 0.0},
                                            {"step_s": 0.5, "sync_bytes": 7.5e6}]},
        {"kind": "a row without stages", "step": 4},
    ]


def test_sync_curve_takes_the_slowest_stage_and_the_largest_share():
    assert sync_curve(_rows()) == [[1, 3.0, 0.5, 0.0], [2, 2.0, 0.6, 3.75e6], [3, None, 0.5, 0.0],
                                   [4, 1.0, 1.0, 7.5e6]]


def test_elapsed_adds_each_steps_transfer_at_the_links_speed():
    curve = sync_curve(_rows())
    # 3.75 MB at 30 Mbit/s is 1 s, 7.5 MB 2 s
    assert elapsed(curve, 30.0) == pytest.approx([0.5, 0.5 + 0.6 + 1.0, 2.1 + 0.5, 2.6 + 1.0 + 2.0])
    assert elapsed(curve, 60.0)[-1] == pytest.approx(0.5 + (0.6 + 0.5) + 0.5 + (1.0 + 1.0))
    with pytest.raises(ValueError, match="positive"):
        elapsed(curve, 0)


def test_a_delayed_sync_crosses_the_link_while_the_steps_after_it_compute():
    # steps of 1 s, delay 2: 3.75 MB (1 s at 30 Mbit/s) logged at step 3 left at step 1's end (on the link
    # 1-2); 7.5 MB (2 s) logged at step 4 left at step 2's end (2-4: step 4 waits until 4); 3.75 MB logged at
    # step 5 left at step 3's end, but the link is busy until 4 (4-5); the last step's transfer is serial
    curve = [[k, None, 1.0, b] for k, b in enumerate([0, 0, 3.75e6, 7.5e6, 3.75e6, 3.75e6], start=1)]
    assert elapsed(curve, 30.0, delay=2) == pytest.approx([1, 2, 3, 4, 5, 7])
    # a transfer longer than the steps it overlaps: step 2, which applies it, waits for it
    slow = [[1, None, 1.0, 0], [2, None, 1.0, 15e6], [3, None, 1.0, 0]]  # 15 MB: 4 s, left at step 1's end
    assert elapsed(slow, 30.0, delay=1) == pytest.approx([1, 5, 6])
    assert elapsed(curve, 30.0) == pytest.approx([1, 2, 4, 7, 9, 11])  # serial without a delay
    assert sync_delay({"summary": {"grad_sync": "diloco:50:fragments2:delay5:q8"}}) == 5
    assert sync_delay({"summary": {"grad_sync": "q8"}}) == sync_delay({"summary": {}}) == 0


def test_time_to_target_is_the_end_of_the_first_evaluation_that_gets_there():
    curve = sync_curve(_rows())
    evals = [(2, 0.9), (4, 0.5)]
    assert time_to_target(curve, evals, 1.0, 30.0) == (2, pytest.approx(2.1))
    assert time_to_target(curve, evals, 0.5, 30.0) == (4, pytest.approx(5.6))
    assert time_to_target(curve, evals, 0.4, 30.0) is None
    assert time_to_target(curve, [(2, None), (4, 0.5)], 1.0, 60.0) == (4, pytest.approx(4.1))
    assert time_to_target(curve, [(9, 0.1)], 1.0) is None  # an evaluation after the last logged step


@pytest.mark.slow
def test_the_diloco_study_records_sync_bytes_and_times_on_two_replicas(tmp_path, capsys):
    """``bench convergence --study diloco`` on 2 stages x 2 replicas: per-step sync sends every step, DiLoCo
    only at its outer steps (every 10th and the run's last); the table gives bytes per step, the run over the
    30 Mbit/s link and the time to fp32's final evaluation loss (fp32: 1x)."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    names = ["fp32", "diloco10 q8"]
    assert main(["bench", "convergence", "synthetic-lm-dp2", "--study", "diloco", "--settings", *names,
                 "--runs-dir", str(runs), "--results-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "diloco: synthetic-lm-dp2" in printed and "diloco:10:q8" in printed and "1.00x" in printed
    saved = json.loads((out / "diloco-synthetic-lm-dp2.json").read_text())
    fp32, dl = saved["runs"]["fp32"], saved["runs"]["diloco10 q8"]
    steps = fp32["summary"]["steps"]
    assert steps == 16 and len(fp32["sync_curve"]) == steps  # 64 samples, global batch 8, 2 epochs
    assert all(s[3] > 0 for s in fp32["sync_curve"])
    assert [s[0] for s in dl["sync_curve"] if s[3] > 0] == [10, 16]
    rows = {r["setting"]: r for r in saved["table"]}
    assert rows["fp32"]["sooner_than_fp32"] == pytest.approx(1.0)
    assert rows["fp32"]["time_to_target_s"] <= rows["fp32"]["link_run_s"]
    assert (rows["fp32"]["time_to_target_s"] == pytest.approx(rows["fp32"]["link_run_s"])
            or fp32["eval"][0]["uncompressed"]["loss"] <= fp32["eval"][-1]["uncompressed"]["loss"])
    assert rows["fp32"]["sync_bytes_per_step"] == fp32["summary"]["grad_sync_bytes"] / steps
    assert rows["diloco10 q8"]["sync_bytes_per_step"] < rows["fp32"]["sync_bytes_per_step"] / 10
    assert rows == {r["setting"]: r for r in study_table(saved)}
    assert (out / "diloco-synthetic-lm-dp2-sync.png").stat().st_size > 0
