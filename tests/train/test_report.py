"""``aqsgd report``: run directories -> comparison table, figure, CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest

from aqsgd.cli.report import register as register_cli
from aqsgd.errors import AqsgdError, ReportError
from aqsgd.train.config import TrainConfig
from aqsgd.train.report import (
    PANELS,
    Run,
    comparison_table,
    is_uncompressed,
    load_run,
    main_metric,
    plot_runs,
    report_figure,
    select_baseline,
)

STEPS = 200          # train steps 0..199, one row each
EVAL_EVERY = 50      # eval at steps 49, 99, 149, 199
RAW = 1_000_000      # fp32 bytes per step over all boundaries (half forward, half backward)

# name -> (forward, backward, bytes per step after warm-up, warm-up steps, final acc on, final acc off)
SETTINGS = {
    "fp32": ("direct:fp32", "direct:fp32", RAW, 0, 0.80, 0.80),
    "aqsgd": ("delta:q2", "direct:q4", RAW // 32 + RAW // 16, 50, 0.79, 0.795),
    "q2": ("direct:q2", "direct:q2", RAW // 32 * 2, 0, 0.70, 0.78),
}


def make_run(root: Path, name: str, *, summary: bool = True, cumulative: bool = False) -> Path:
    """A plausible run directory: per-step train rows (bytes per step, or running totals), eval rows that
    approach the final accuracies, and a summary consistent with the rows."""
    fwd, bwd, per_step, warmup, acc_on, acc_off = SETTINGS[name]
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"task": "synthetic-cls", "forward": fwd, "backward": bwd,
                                               "stages": 4, "lr": 0.01}))
    lines, sent_total, raw_total = [], 0, 0
    for step in range(STEPS):
        sent = RAW if step < warmup else per_step
        sent_total += sent
        raw_total += RAW
        loss = 2.3 * math.exp(-step / 80) + 0.3 + (0.1 if name == "q2" else 0.0)
        lines.append({
            "kind": "train", "step": step, "epoch": step // 50,
            "phase": "warmup" if step < warmup else "train", "loss": loss, "lr": 0.01,
            "samples_per_s": 100.0 if name == "fp32" else 400.0, "tokens_per_s": None,
            "bytes_sent": sent_total if cumulative else sent, "raw_bytes": raw_total if cumulative else RAW,
            "bytes": {"b0.forward": sent // 2, "b0.backward": sent // 2},
            "time": {"compute": 0.1, "codec": 0.01, "wait": 0.05, "step": 0.16},
        })
        if (step + 1) % EVAL_EVERY == 0:
            frac = (step + 1) / STEPS
            lines.append({"kind": "eval", "step": step, "epoch": step // 50,
                          "compressed": {"loss": 1.0 - 0.5 * frac, "accuracy": acc_on * frac},
                          "uncompressed": {"loss": 0.9 - 0.5 * frac, "accuracy": acc_off * frac}})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if summary:
        (d / "summary.json").write_text(json.dumps({
            "task": "synthetic-cls", "setting": f"{fwd}/{bwd}", "steps": STEPS,
            "final_train_loss": lines[-2]["loss"],
            "eval": {"compressed": {"loss": 0.5, "accuracy": acc_on},
                     "uncompressed": {"loss": 0.4, "accuracy": acc_off}},
            "bytes_sent": sent_total, "raw_bytes": raw_total, "compression_ratio": raw_total / sent_total,
            "samples_per_s": 100.0 if name == "fp32" else 400.0, "wall_s": 12.5,
        }))
    return d


@pytest.fixture
def run_dirs(tmp_path: Path) -> list[Path]:
    # The baseline is deliberately not first: it must be found by its setting.
    return [make_run(tmp_path, n) for n in ("aqsgd", "fp32", "q2")]


def expected_bytes(name: str) -> int:
    _, _, per_step, warmup, _, _ = SETTINGS[name]
    return warmup * RAW + (STEPS - warmup) * per_step


def test_load_run(run_dirs):
    run = load_run(run_dirs[0])
    assert isinstance(run, Run)
    assert run.name == "aqsgd" and run.path == run_dirs[0]
    assert run.config["stages"] == 4 and run.summary["steps"] == STEPS
    assert len(run.train_rows) == STEPS and len(run.eval_rows) == STEPS // EVAL_EVERY
    assert run.skipped_lines == 0
    assert (run.forward, run.backward, run.setting) == ("delta:q2", "direct:q4", "delta:q2/direct:q4")
    assert run.warmup_span() == (0, 49) and not run.uncompressed
    assert load_run(run_dirs[1], label="baseline").name == "baseline"
    assert load_run(run_dirs[1]).uncompressed


def test_comparison_table_values(run_dirs):
    runs = [load_run(d) for d in run_dirs]
    assert main_metric(runs) == "accuracy"
    rows = comparison_table(runs)
    by = {r["run"]: r for r in rows}
    assert [r["run"] for r in rows] == ["aqsgd", "fp32", "q2"]
    assert {r["baseline"] for r in rows} == {"fp32"} and {r["metric"] for r in rows} == {"accuracy"}
    for name, (fwd, bwd, _, _, acc_on, acc_off) in SETTINGS.items():
        r = by[name]
        assert r["setting"] == f"{fwd}/{bwd}" and r["steps"] == STEPS and r["higher_is_better"] is True
        assert r["metric_off"] == pytest.approx(acc_off) and r["rank_by"] == "uncompressed"
        # fp32 both ways has no compressed boundary: its one figure is the uncompressed one
        assert r["metric_on"] == (None if name == "fp32" else pytest.approx(acc_on))
        assert r["evaluates_compressed"] == (name != "fp32") and r["no_cache"] == (name == "aqsgd")
        assert r["bytes_sent"] == expected_bytes(name)
        assert r["compression_ratio"] == pytest.approx(STEPS * RAW / expected_bytes(name))
        assert r["final_train_loss"] == pytest.approx(2.3 * math.exp(-(STEPS - 1) / 80) + 0.3
                                                      + (0.1 if name == "q2" else 0.0))
    # compared on the uncompressed evaluation, the model's quality
    assert by["fp32"]["rel_diff"] == 0.0
    assert by["aqsgd"]["rel_diff"] == pytest.approx((0.795 - 0.80) / 0.80)
    assert by["q2"]["rel_diff"] == pytest.approx((0.78 - 0.80) / 0.80)
    assert by["aqsgd"]["compression_ratio"] == pytest.approx(200 / (50 + 150 * 3 / 32))
    assert by["q2"]["samples_per_s"] == 400.0

    # An explicit baseline, and an unknown one.
    rows = comparison_table(runs, baseline="q2")
    assert rows[1]["rel_diff"] == pytest.approx((0.80 - 0.78) / 0.78) and rows[2]["rel_diff"] == 0.0
    with pytest.raises(ReportError, match="'nope' is not one of the runs: aqsgd, fp32, q2"):
        comparison_table(runs, baseline="nope")
    # On the compressed evaluation on request (fp32, with no compressed boundary, counts with its one figure).
    rows = comparison_table(runs, rank_by="compressed")
    assert [r["rel_diff"] for r in rows] == pytest.approx([(0.79 - 0.80) / 0.80, 0.0, (0.70 - 0.80) / 0.80])
    assert {r["rank_by"] for r in rows} == {"compressed"} and rows[1]["metric_on"] is None
    with pytest.raises(ReportError, match="rank_by 'best' is not one of uncompressed, compressed"):
        comparison_table(runs, rank_by="best")  # type: ignore[arg-type]
    # Another metric on request: loss, lower is better.
    rows = comparison_table(runs, metric="loss")
    assert rows[0]["metric_on"] == 0.5 and rows[0]["metric_off"] == 0.4
    assert rows[0]["higher_is_better"] is False


def test_values_fall_back_to_rows_without_summary(tmp_path):
    with_summary = load_run(make_run(tmp_path / "a", "aqsgd"))
    without = load_run(make_run(tmp_path / "b", "aqsgd", summary=False))
    cumulative = load_run(make_run(tmp_path / "c", "aqsgd", summary=False, cumulative=True))
    cumulative_with_summary = load_run(make_run(tmp_path / "d", "aqsgd", cumulative=True))
    assert without.summary == {}
    for run in (without, cumulative, cumulative_with_summary):
        assert run.total_bytes == with_summary.total_bytes == expected_bytes("aqsgd")
        assert run.raw_bytes == STEPS * RAW
        assert run.compression_ratio == pytest.approx(with_summary.compression_ratio)
        assert run.steps == (STEPS if run.summary else STEPS - 1)  # without a summary: the last step logged
        assert run.final_eval("compressed")["accuracy"] == pytest.approx(0.79)
        assert run.final_train_loss == pytest.approx(with_summary.final_train_loss)
        assert run.samples_per_s == 400.0
        steps, cum = run.cumulative()
        assert steps == list(range(STEPS)) and cum[-1] == expected_bytes("aqsgd") and cum[49] == 50 * RAW
    # The setting also comes from the summary when the config lacks it.
    (tmp_path / "a" / "aqsgd" / "config.json").unlink()
    run = load_run(tmp_path / "a" / "aqsgd")
    assert run.config == {} and run.setting == "delta:q2/direct:q4" and run.task == "synthetic-cls"


def test_sparse_logging_counts_steps_between_rows(tmp_path):
    d = tmp_path / "sparse"
    d.mkdir()
    rows = [{"kind": "train", "step": s, "loss": 1.0, "bytes_sent": 100} for s in (0, 10, 20)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_run(d).cumulative() == ([0, 10, 20], [100.0, 1100.0, 2100.0])


def test_uncompressed_settings():
    assert all(map(is_uncompressed, ("none", "fp32", "direct:fp32", "direct:none", " fp32")))
    assert not any(map(is_uncompressed, (None, "", "fp16", "direct:q8", "delta:q2", "q4", "direct")))


def test_baseline_defaults_to_first_run_without_uncompressed(tmp_path):
    runs = [load_run(make_run(tmp_path, n)) for n in ("q2", "aqsgd")]
    assert select_baseline(runs).name == "q2"
    rows = comparison_table(runs)
    assert rows[0]["rel_diff"] == 0.0 and rows[1]["rel_diff"] == pytest.approx((0.795 - 0.78) / 0.78)


def test_plot_writes_readable_png(run_dirs, tmp_path):
    import matplotlib.image as mpimg

    runs = [load_run(d) for d in run_dirs]
    out = plot_runs(runs, tmp_path / "figs" / "report.png", dpi=100)
    assert out == tmp_path / "figs" / "report.png"
    assert out.stat().st_size > 10_000
    img = mpimg.imread(out)
    assert img.shape[:2] == (950, 1600)  # figsize (16, 9.5) inches at 100 dpi
    assert img.std() > 0.05  # not a blank canvas


def test_plot_of_many_runs_keeps_colours_distinct_and_names_readable(run_dirs, tmp_path, monkeypatch):
    """A study of 12+ settings: no colour repeats (the default cycle has 10), the bytes panel turns into one
    labelled row per run, and the shared warm-up span is drawn once (not stacked into an opaque block)."""
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    runs = [load_run(d, label=f"{d.name}-{i}") for i in range(4) for d in run_dirs]
    assert len(runs) >= 12
    plot_runs(runs, tmp_path / "many.png", dpi=60)
    axes = {ax.get_label(): ax for ax in figures[0].axes}
    ax_loss, ax_bar = axes["loss"], axes["total_bytes"]
    colours = {mcolors.to_hex(line.get_color()) for line in ax_loss.lines}
    assert len(colours) == len(runs)
    assert [t.get_text() for t in ax_bar.get_yticklabels()] == [r.name for r in runs]
    assert len(ax_loss.patches) == len({r.warmup_span() for r in runs if r.warmup_span()})


def test_plot_without_eval_rows_or_bytes(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "loss": 1.0}) + "\n")
    run = load_run(d)
    assert main_metric([run]) is None
    row, = comparison_table([run])
    assert row["metric"] is None and row["metric_on"] is None and row["bytes_sent"] is None
    assert row["setting"] == "?/?" and row["steps"] == 0
    assert plot_runs([run], tmp_path / "bare.png").stat().st_size > 10_000


def test_malformed_lines_are_skipped_and_counted(run_dirs, caplog):
    metrics = run_dirs[0] / "metrics.jsonl"
    good = metrics.read_text().splitlines()
    bad = [
        "not json",
        '["a", "list"]',
        '{"kind": "train", "step": "7", "loss": 1.0}',     # step is not an int
        '{"kind": "train", "step": 7}',                     # no loss
        '{"kind": "eval", "step": 7, "compressed": 0.5}',   # no metrics object
        '{"kind": "train", "step": 7, "loss": 1.0',         # truncated (a run still writing)
    ]
    lines = good[:3] + bad[:3] + good[3:] + ["", '{"kind": "checkpoint", "step": 9}'] + bad[3:]
    metrics.write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="aqsgd.train.report"):
        run = load_run(run_dirs[0])
    assert run.skipped_lines == len(bad)
    assert len(run.train_rows) == STEPS and len(run.eval_rows) == STEPS // EVAL_EVERY
    assert "skipped 6 malformed line(s)" in caplog.text and str(metrics) in caplog.text
    # Bad JSON in the optional files is ignored with a warning, too.
    (run_dirs[0] / "summary.json").write_text("{")
    assert load_run(run_dirs[0]).summary == {}


def test_missing_run_dir_errors(tmp_path):
    with pytest.raises(ReportError, match="does not exist") as e:
        load_run(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)
    assert isinstance(e.value, AqsgdError) and isinstance(e.value, ValueError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="has no metrics.jsonl") as e:
        load_run(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(e.value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aqsgd")
    register_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_end_to_end(run_dirs, tmp_path, capsys):
    out, js = tmp_path / "r.png", tmp_path / "r.json"
    args = _parser().parse_args(["report", *map(str, run_dirs), "--out", str(out), "--json", str(js),
                                 "--labels", "AQ-SGD,FP32,Q2"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}\n" in text
    for s in ("AQ-SGD", "FP32", "Q2", "delta:q2/direct:q4", "-0.63%", "-2.50%", "baseline: FP32", "3.1x",
              "16.0x", "0.7950", "runs compared on accuracy;"):
        assert s in text
    assert "-1.25%" not in text and "-12.50%" not in text  # (the compressed figures' differences)
    assert out.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert data["metric"] == "accuracy" and data["baseline"] == "FP32" and data["rank_by"] == "uncompressed"
    assert [r["run"] for r in data["rows"]] == ["AQ-SGD", "FP32", "Q2"]
    assert data["rows"][2]["rel_diff"] == pytest.approx(-0.025)

    args = _parser().parse_args(["report", *map(str, run_dirs), "--out", str(out), "--baseline", "q2"])
    assert args.func(args) == 0
    assert "baseline: q2" in capsys.readouterr().out
    args = _parser().parse_args(["report", *map(str, run_dirs), "--out", str(out), "--rank-by", "compressed"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "runs compared on accuracy through compressed boundaries" in text
    assert "-1.25%" in text and "-12.50%" in text


def test_cli_bad_options(run_dirs, tmp_path):
    parser = _parser()
    png = str(tmp_path / "x.png")
    args = parser.parse_args(["report", *map(str, run_dirs), "--out", png, "--labels", "a,b"])
    with pytest.raises(ReportError, match="2 name.* for 3 run directories"):
        args.func(args)
    args = parser.parse_args(["report", str(run_dirs[0]), str(tmp_path / "missing"), "--out", png])
    with pytest.raises(ReportError, match="missing"):
        args.func(args)
    assert not (tmp_path / "x.png").exists()


def test_same_directory_names_are_told_apart(tmp_path, capsys):
    a, b = make_run(tmp_path / "seed0", "aqsgd"), make_run(tmp_path / "seed1", "aqsgd")
    args = _parser().parse_args(["report", str(a), str(b), "--out", str(tmp_path / "r.png"),
                                 "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["seed0/aqsgd", "seed1/aqsgd"]


def test_main_metric_follows_the_task(tmp_path):
    def run_with(task: str, metrics: dict[str, float]) -> Run:
        d = tmp_path / task
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"task": task, "forward": "fp32", "backward": "fp32"}))
        (d / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 5, "compressed": metrics,
                                                     "uncompressed": metrics}) + "\n")
        return load_run(d)

    lm = run_with("wikitext", {"loss": 3.0, "perplexity": 20.1})
    assert main_metric([lm]) == "perplexity"
    assert comparison_table([lm])[0]["higher_is_better"] is False
    assert main_metric([run_with("lm-loss-only", {"loss": 3.0})]) == "loss"
    both = {"loss": 0.5, "accuracy": 0.8, "mcc": 0.4}
    assert main_metric([run_with("sst2", both)]) == "accuracy"
    assert main_metric([run_with("glue-cola", both)]) == "mcc"
    assert plot_runs([lm], tmp_path / "lm.png").is_file()


def test_eval_only_in_summary(tmp_path):
    d = make_run(tmp_path, "aqsgd")
    metrics = d / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if '"eval"' not in line))
    run = load_run(d)
    assert run.eval_rows == [] and main_metric([run]) == "accuracy"
    assert comparison_table([run])[0]["metric_on"] == pytest.approx(0.79)
    assert plot_runs([run], tmp_path / "summary-only.png").stat().st_size > 10_000


# --- wall time and settings in the legend ----------------------------------------------------------------

# run name -> (config.json as written, [(step, loss, step seconds)] in file order)
TIMED = {
    # nested by section, as the trainer writes it; a restart after step 3 (its first step is slow) and an eval
    # and a checkpoint row between the train rows
    "slow-link": ({"task": {"name": "bbc"}, "pipeline": {"stages": 2, "link": "10mbit,20ms"},
                   "compression": {"forward": "delta:q2", "backward": "direct:q4"}},
                  [(1, 2.0, 4.0), (2, 1.5, 4.0), (3, 1.2, 4.5), (4, 1.0, 9.0), (5, 0.9, 4.0)]),
    # the whole config the trainer would write, no emulated link; step 3 was run twice (a resume that kept
    # the interrupted run's rows): wall time counts both
    "local": (TrainConfig.of(task="bbc", stages=4, forward="direct:q8", backward="none").to_dict(),
              [(1, 2.1, 1.0), (2, 1.6, 1.5), (3, 1.4, 1.0), (3, 1.3, 2.0), (4, 1.1, 1.0)]),
}


def make_timed_run(root: Path, name: str, *, timed: bool = True) -> Path:
    """A run directory written by hand from :data:`TIMED` (``timed=False``: an old run, no step times)."""
    config, rows = TIMED[name]
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    lines = []
    for step, loss, seconds in rows:
        row = {"kind": "train", "step": step, "loss": loss, "bytes_sent": 100}
        if timed:
            row["time"] = {"step": seconds, "compute": seconds / 2, "codec": 0.0, "wait": seconds / 2}
        lines.append(row)
        if step == 3:
            lines += [{"kind": "eval", "step": 3, "compressed": {"accuracy": 0.5}},
                      {"kind": "checkpoint", "step": 3}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return d


def expected_times(name: str) -> list[float]:
    return list(itertools.accumulate(seconds for _, _, seconds in TIMED[name][1]))


def figure_panels(runs: list[Run]) -> tuple[Any, dict[str, Any]]:
    """:func:`report_figure` of ``runs`` (closed: its artists stay readable) and its axes by panel name."""
    import matplotlib.pyplot as plt

    fig = report_figure(runs)
    plt.close(fig)
    return fig, {ax.get_label(): ax for ax in fig.axes}


def test_wall_times_sum_the_step_durations(tmp_path):
    for name in TIMED:
        run = load_run(make_timed_run(tmp_path, name))
        steps, times = run.wall_times()
        assert steps == [step for step, _, _ in TIMED[name][1]]
        assert times == pytest.approx(expected_times(name))
        assert run.loss_vs_time() == (pytest.approx(expected_times(name)),
                                      [loss for _, loss, _ in TIMED[name][1]])
        assert run.has_wall_times
    assert expected_times("slow-link")[-1] == 25.5 and expected_times("local")[-1] == 6.5
    # an old run: no step times, nothing to plot against time
    old = load_run(make_timed_run(tmp_path / "old", "local", timed=False))
    assert old.wall_times() == ([], []) and old.loss_vs_time() == ([], []) and not old.has_wall_times
    # rows every 10 steps: each duration stands for the steps since the previous row (as the bytes do)
    d = tmp_path / "sparse"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 1.0,
                                                         "time": {"step": 0.5}}) + "\n" for s in (0, 10, 20)))
    assert load_run(d).wall_times() == ([0, 10, 20], [0.5, 5.5, 10.5])


def test_settings_label_names_codecs_stages_and_link(tmp_path):
    slow, local = (load_run(make_timed_run(tmp_path, n)) for n in TIMED)
    assert slow.settings_label == "delta:q2/direct:q4, 2 stages, link 10mbit,20ms"
    assert (slow.task, slow.stages, slow.link) == ("bbc", 2, "10mbit,20ms")
    assert local.settings_label == "direct:q8/none, 4 stages"  # no link, and no word of one
    assert (local.forward, local.backward, local.link) == ("direct:q8", "none", None)
    # an old flat config, and none at all (the summary's setting and stages)
    d = make_run(tmp_path, "aqsgd")
    assert load_run(d).settings_label == "delta:q2/direct:q4, 4 stages"
    (d / "config.json").unlink()
    (d / "summary.json").write_text(json.dumps({"setting": "delta:q2/direct:q4", "stages": 3}))
    assert load_run(d).settings_label == "delta:q2/direct:q4, 3 stages"


def test_figure_has_loss_against_steps_and_wall_time(tmp_path, caplog):
    runs = [load_run(make_timed_run(tmp_path, n)) for n in TIMED]
    fig, axes = figure_panels(runs)
    assert [ax.get_label() for ax in fig.axes] == list(PANELS)
    ax_steps, ax_time = axes["loss"], axes["loss_time"]
    for run, line_s, line_t in zip(runs, ax_steps.lines, ax_time.lines, strict=True):
        _, rows = TIMED[run.name]
        assert list(line_s.get_xdata()) == [step for step, _, _ in rows]
        assert list(line_t.get_xdata()) == pytest.approx(expected_times(run.name))
        assert list(line_t.get_ydata()) == list(line_s.get_ydata()) == [loss for _, loss, _ in rows]
    assert ax_steps.get_xlabel() == "step" and ax_time.get_xlabel() == "wall time (s, sum of step times)"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["slow-link (delta:q2/direct:q4, 2 stages, link 10mbit,20ms)",
                      "local (direct:q8/none, 4 stages)"]
    assert "wall time" not in caplog.text  # every run has its times: no warning

    # written as a PNG of the same figure
    import matplotlib.image as mpimg

    out = plot_runs(runs, tmp_path / "timed.png", dpi=50)
    assert mpimg.imread(out).shape[:2] == (475, 800)


def test_run_without_step_times_is_named_in_one_warning(tmp_path, caplog, capsys):
    new = make_timed_run(tmp_path, "slow-link")
    old = make_timed_run(tmp_path / "before", "local", timed=False)
    with caplog.at_level(logging.WARNING, logger="aqsgd.train.report"):
        _, axes = figure_panels([load_run(new), load_run(old)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["no wall times (step durations, time.step in metrics.jsonl) in run local: left out "
                        "of the loss against wall time panel"]
    assert len(axes["loss"].lines) == 2  # both runs against steps
    time_line, = axes["loss_time"].lines  # only the timed one against time
    assert list(time_line.get_xdata()) == pytest.approx(expected_times("slow-link"))

    # the command goes on: table, figure, exit 0
    caplog.clear()
    png = tmp_path / "r.png"
    args = _parser().parse_args(["report", str(new), str(old), "--out", str(png)])
    with caplog.at_level(logging.WARNING, logger="aqsgd.train.report"):
        assert args.func(args) == 0
    assert f"wrote {png}" in capsys.readouterr().out and png.stat().st_size > 10_000
    assert len([r for r in caplog.records if "no wall times" in r.getMessage()]) == 1

    # no run with times: the panel says so
    ax_time = figure_panels([load_run(old)])[1]["loss_time"]
    assert not ax_time.lines and [t.get_text() for t in ax_time.texts] == ["no step times recorded"]


def test_long_runs_show_minutes_or_hours(tmp_path):
    d = make_timed_run(tmp_path, "slow-link")
    rows = [{"kind": "train", "step": s, "loss": 1.0, "time": {"step": 30.0}} for s in range(1, 11)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ax_time = figure_panels([load_run(d)])[1]["loss_time"]
    assert ax_time.get_xlabel() == "wall time (min, sum of step times)"
    assert list(ax_time.lines[0].get_xdata()) == pytest.approx([0.5 * s for s in range(1, 11)])
    (d / "metrics.jsonl").write_text(json.dumps({**rows[0], "time": {"step": 7201.0}}) + "\n")
    ax_time = figure_panels([load_run(d)])[1]["loss_time"]
    assert ax_time.get_xlabel() == "wall time (h, sum of step times)"


# --- the compressed evaluation, for what it is; short runs; writing the outputs -----------------------------

def make_lm_run(root: Path, name: str, forward: str, stages: int, ppl_off: float, ppl_on: float | None = None,
                *, eval_steps: tuple[int, ...] = (4,), samples_per_s: float = 5.0) -> Path:
    """A short LM run written as the trainer writes it (nested config, one train row a step, eval rows at
    ``eval_steps``, a summary). ``ppl_on`` None: the compressed evaluation equals the uncompressed one (as
    where nothing is compressed)."""
    ppl_on = ppl_off if ppl_on is None else ppl_on
    d = root / name
    d.mkdir(parents=True)
    backward = "none" if forward == "none" else "direct:q4"
    (d / "config.json").write_text(json.dumps({
        "task": {"name": "wiki"}, "pipeline": {"stages": stages},
        "compression": {"forward": forward, "backward": backward}}))
    sent = 0 if stages == 1 else (1000 if forward == "none" else 300)
    raw = 0 if stages == 1 else 1000
    rows = [{"kind": "train", "step": s, "loss": 4.8 - 0.05 * s, "bytes_sent": sent, "raw_bytes": raw,
             "time": {"step": 0.5}} for s in range(1, 5)]
    evals = {"compressed": {"loss": math.log(ppl_on), "perplexity": ppl_on},
             "uncompressed": {"loss": math.log(ppl_off), "perplexity": ppl_off}}
    rows += [{"kind": "eval", "step": s, **evals} for s in eval_steps]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({
        "task": "wiki", "setting": f"{forward}/{backward}", "stages": stages, "steps": 4, "eval": evals,
        "bytes_sent": 4 * sent, "raw_bytes": 4 * raw, "samples_per_s": samples_per_s}))
    return d


@pytest.fixture
def lm_runs(tmp_path: Path) -> list[Path]:
    """The case that misled: AQ-SGD's compressed perplexity (no cache) in the thousands beside 55-60
    uncompressed; an uncompressed pipeline; a run of one stage (its codecs never used)."""
    return [make_lm_run(tmp_path, "lora-dist2-fp32", "none", 2, 55.0),
            make_lm_run(tmp_path, "aqsgd", "delta:q2", 2, 58.5, 8515.0, samples_per_s=0.0123),
            make_lm_run(tmp_path, "direct", "direct:q8", 2, 56.1, 57.3),
            make_lm_run(tmp_path, "one-stage", "delta:q2", 1, 57.2)]


def table_rows(text: str) -> dict[str, list[str]]:
    """The report table's rows by run name: its cells, stripped."""
    lines = [line for line in text.splitlines() if line.startswith("│")]
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines]
    return {r[0]: r[1:] for r in rows}


def test_report_compares_the_uncompressed_evaluation_and_labels_the_compressed_one(lm_runs, tmp_path, capsys):
    args = _parser().parse_args(["report", *map(str, lm_runs), "--out", str(tmp_path / "r.png"),
                                 "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "runs compared on perplexity; baseline: lora-dist2-fp32" in text
    header = [[c.strip() for c in line.strip()[1:-1].split("┃")] for line in text.splitlines()
              if line.startswith("┃")]  # (a long column name folds over lines)
    cols = [" ".join(filter(None, parts)) for parts in zip(*header)]
    assert cols[4:7] == ["perplexity", "vs lora-dist2-fp32", "perplexity through compressed boundaries"]
    rows = table_rows(text)
    # setting, steps, train loss, perplexity, vs, compressed, bytes, ratio, samples/s
    assert rows["aqsgd"][0] == "delta:q2/direct:q4" and rows["aqsgd"][3:6] == ["58.5", "+6.36%",
                                                                               "8515 (no cache)"]
    assert rows["aqsgd"][8] == "0.0123"  # significant digits, not 0.0
    assert rows["direct"][3:6] == ["56.1", "+2.00%", "57.3"]
    fp32 = rows["lora-dist2-fp32"]
    assert fp32[0] == "uncompressed" and fp32[3:6] == ["55", "+0.00%", "-"]
    assert rows["one-stage"][0] == "1 stage" and rows["one-stage"][5] == "-"  # one figure: no codec was used
    assert "15381" not in text  # (8515 against 55: the difference on the compressed figure)
    note = [line for line in text.splitlines() if "per-sample cache" in line]
    assert len(note) == 1 and "not the model's quality" in note[0]
    data = json.loads((tmp_path / "r.json").read_text())
    by = {r["run"]: r for r in data["rows"]}
    assert data["rank_by"] == "uncompressed" and by["aqsgd"]["rel_diff"] == pytest.approx(3.5 / 55)
    assert by["aqsgd"]["no_cache"] and not by["direct"]["no_cache"]
    assert by["one-stage"]["metric_on"] is None and by["one-stage"]["metric_off"] == 57.2

    # asked for: compared on the compressed evaluation
    args = _parser().parse_args(["report", *map(str, lm_runs), "--out", str(tmp_path / "r.png"),
                                 "--rank-by", "compressed"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "runs compared on perplexity through compressed boundaries; baseline: lora-dist2-fp32" in text
    rows = table_rows(text)
    assert rows["aqsgd"][3:6] == ["58.5", "8515 (no cache)", "+15381.82%"]
    assert rows["one-stage"][5] == "+4.00%"  # its one figure: nothing was compressed


def test_one_stage_run_is_the_baseline_where_no_run_is_uncompressed(tmp_path):
    runs = [load_run(make_lm_run(tmp_path, "aqsgd", "delta:q2", 2, 58.5, 8515.0)),
            load_run(make_lm_run(tmp_path, "one-stage", "delta:q2", 1, 57.2))]
    assert runs[1].compresses_nothing and not runs[1].uncompressed
    assert select_baseline(runs).name == "one-stage"
    assert comparison_table(runs)[0]["rel_diff"] == pytest.approx((58.5 - 57.2) / 57.2)


def test_settings_label_names_no_codecs_where_nothing_is_compressed(lm_runs):
    uncompressed, aqsgd, _, one = map(load_run, lm_runs)
    assert one.settings_label == "1 stage"  # not "delta:q2/direct:q4, 1 stage"
    assert uncompressed.settings_label == "uncompressed, 2 stages"  # not "none/none, 2 stages"
    assert aqsgd.settings_label == "delta:q2/direct:q4, 2 stages"
    assert (one.evaluates_compressed, uncompressed.evaluates_compressed, aqsgd.evaluates_compressed) == (
        False, False, True)


def test_eval_panel_of_short_runs_shows_every_evaluation(lm_runs, tmp_path):
    """One evaluation a run: each is a marker big enough to see; uncompressed and compressed differ by
    marker (filled circle, hollow diamond above it); runs without a compressed boundary draw one series;
    equal values of several runs show as rings of decreasing size, not one point."""
    import matplotlib.colors as mcolors

    runs = [load_run(d) for d in lm_runs]
    runs.append(load_run(make_lm_run(tmp_path / "more", "same-as-fp32", "none", 2, 55.0)))
    fig, axes = figure_panels(runs)
    lines = {line.get_label(): line for line in axes["eval"].lines if line.get_marker() != "^"}
    assert sorted(lines) == sorted(["lora-dist2-fp32 uncompressed", "aqsgd uncompressed", "aqsgd compressed",
                                    "direct uncompressed", "direct compressed", "one-stage uncompressed",
                                    "same-as-fp32 uncompressed"])
    for name, line in lines.items():
        assert list(line.get_xdata()) == [4] and line.get_markersize() >= 6, name
        if name.endswith(" compressed"):
            assert line.get_marker() == "D" and line.get_markerfacecolor() == "none"
            assert line.get_linestyle() == ":" and line.get_zorder() > 3
        else:
            assert line.get_marker() == "o" and line.get_linestyle() == "-"
            assert mcolors.same_color(line.get_markerfacecolor(), line.get_color())
    # the same value at the same step: the later run's marker is smaller, inside the first one's
    first, same = lines["lora-dist2-fp32 uncompressed"], lines["same-as-fp32 uncompressed"]
    assert same.get_markersize() < first.get_markersize() and same.get_ydata()[0] == first.get_ydata()[0]
    assert axes["eval"].get_xlim() == (3, 5)  # one step: whole steps either side, not 3.8 to 4.2
    legend = [t.get_text() for t in axes["eval"].get_legend().get_texts()]
    assert legend == ["uncompressed (the model)", "compressed boundaries\n(AQ-SGD: no cache)",
                      "above the scale"]
    # 8515 (no cache) beside 55-58.5: marked above the scale with its value, the model's values keep the scale
    low, high = axes["eval"].get_ylim()
    assert low < 55 and 58.5 < high < 70 and axes["eval"].get_yscale() == "linear"
    assert [t.get_text() for t in axes["eval"].texts] == ["8515"]
    above, = [line for line in axes["eval"].lines if line.get_marker() == "^"]
    assert list(above.get_xdata()) == [4] and mcolors.same_color(above.get_color(), lines["aqsgd compressed"]
                                                                 .get_color())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[0] == "lora-dist2-fp32 (uncompressed, 2 stages)" and labels[3] == "one-stage (1 stage)"
    # without an AQ-SGD run the legend says nothing of a cache
    _, axes = figure_panels([runs[0], runs[2]])
    assert [t.get_text() for t in axes["eval"].get_legend().get_texts()] == [
        "uncompressed (the model)", "compressed boundaries"]


def test_bytes_panel_says_more_where_a_run_sent_more_than_the_baseline(tmp_path):
    runs = [load_run(make_lm_run(tmp_path, "fp32", "none", 2, 55.0)),
            load_run(make_lm_run(tmp_path, "aqsgd", "delta:q2", 2, 58.5, 8515.0))]
    (runs[1].path / "summary.json").write_text(json.dumps({**runs[1].summary, "bytes_sent": 4400}))
    runs[1] = load_run(runs[1].path)
    _, axes = figure_panels(runs)
    notes = [t.get_text() for t in axes["total_bytes"].texts]
    assert notes == ["4 kB\nbaseline", "4.4 kB\n1.1x more"]  # not "0.909x fewer"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


def test_unwritable_out_is_one_line_before_anything_is_loaded(lm_runs, tmp_path, capsys, monkeypatch):
    from aqsgd.cli import main

    (tmp_path / "notes.txt").write_text("a file")
    missing = str(tmp_path / "no-such-run")  # not looked at: the output is checked first
    under_file = tmp_path / "notes.txt" / "r.png"
    assert main(["report", str(lm_runs[0]), missing, "--out", str(under_file)]) == 2
    assert f"--out {under_file}: {tmp_path / 'notes.txt'} is a file, not a folder" in one_line_error(capsys)
    assert main(["report", str(lm_runs[0]), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: is a directory" in one_line_error(capsys)
    assert main(["report", str(lm_runs[0]), "--out", str(tmp_path / "r.png"), "--json", str(under_file)]) == 2
    assert f"--json {under_file}:" in one_line_error(capsys)
    assert not (tmp_path / "r.png").exists()

    folder = tmp_path / "read-only"
    folder.mkdir()
    real_access = os.access
    # (chmod 0o555 does not stop root: the check asks os.access, as it would answer there)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != folder and real_access(p, mode, **kw))
    assert main(["report", str(lm_runs[0]), missing, "--out", str(folder / "r.png")]) == 2
    assert f"--out {folder / 'r.png'}: folder {folder} is not writable" in one_line_error(capsys)
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("full", ["r.png", "r.json"])
def test_full_disk_is_one_line_and_leaves_no_partial_file(lm_runs, tmp_path, capsys, full_disk, full):
    from aqsgd.cli import main

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / full).write_text("the previous one")
    full_disk(lambda path: full in path.name)  # the writes of one file (or its temporary file) fail
    assert main(["report", *map(str, lm_runs), "--out", str(folder / "r.png"), "--json",
                 str(folder / "r.json")]) == 2
    err = one_line_error(capsys)
    assert f"{folder / full}: could not write it (No space left on device)" in err
    assert (folder / full).read_text() == "the previous one"
    # the old file kept, the figure written first where the JSON failed, no temporary file
    assert sorted(p.name for p in folder.iterdir()) == sorted({full, "r.png"})
