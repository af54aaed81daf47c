"""``aqsgd bench batching``: what a row reports from a run's metrics, and the runs it asks for."""

from __future__ import annotations

from aqsgd.bench.batching import BatchingBenchConfig, summarize, train_args
from aqsgd.cli import main


def _row(epoch: int, tokens: int, step_s: float, sent: int, pads: int) -> dict:
    return {"epoch": epoch, "tokens": tokens, "time": {"step": step_s}, "bytes_sent": sent,
            "raw_bytes": 4 * sent, "pad_tokens_sent": pads}


def test_summarize_times_whole_epochs_after_the_warm_up():
    rows = [_row(0, 100, 10.0, 999, 7),  # the warm-up epoch: left out
            _row(1, 100, 1.0, 10, 0), _row(1, 300, 1.0, 30, 0),  # 200 tokens/s
            _row(2, 100, 0.5, 10, 2), _row(2, 100, 0.5, 10, 0),  # 200 tokens/s
            _row(3, 600, 2.0, 60, 0)]  # 300 tokens/s
    s = summarize(rows, timed_epochs=3)
    assert s["tokens_per_s_epochs"] == [200.0, 200.0, 300.0] and s["tokens_per_s"] == 200.0
    assert s["tokens"] == 1200 and s["bytes_per_token"] == 120 / 1200 and s["fp32_bytes_per_token"] == 0.4
    assert s["pad_tokens_sent"] == 2 and s["steps"] == 5


def test_each_row_is_one_training_command():
    cfg = BatchingBenchConfig(forward="delta:q4")
    local = train_args(cfg, "pack", "local", "out")
    assert local[local.index("--batching") + 1] == "pack" and "--link" not in local
    assert local[local.index("--forward") + 1] == "delta:q4" and "--backward" not in local
    remote = train_args(cfg, "bucket", "distributed", "out")
    assert remote[remote.index("--link") + 1] == cfg.link
    assert remote[remote.index("--epochs") + 1] == str(1 + cfg.epochs)


def test_a_study_without_settings_for_the_task_is_one_line(capsys):
    assert main(["bench", "convergence", "minilm-bbc", "--study", "instruct"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("aqsgd: error: --study instruct has no settings for minilm-bbc; its tasks: "
                   "smollm2-instruct (or give --settings)")
