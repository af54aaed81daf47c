"""Comparing training runs: load run directories, tabulate them, draw one figure.

A training run writes a run directory::

    RUN_DIR/config.json     the resolved config, nested by section: {"compression": {"forward": "delta:q2",
                            "backward": "direct:q4", ...}, "pipeline": {"stages": 4, "link": ...}, ...}
                            (older runs: flat, {"task", "forward", "backward", ...})
    RUN_DIR/metrics.jsonl   one JSON object per line: {"kind": "train", ...} and {"kind": "eval", ...} rows;
                            a train row's "time": {"step": seconds} gives the wall-time axis
    RUN_DIR/summary.json    written at the end: final metrics, bytes, compression ratio, throughput

Only ``metrics.jsonl`` is required; ``config.json`` and ``summary.json`` (absent while a run is still going)
are optional, and every value taken from the summary falls back to one derived from the rows. Lines of
``metrics.jsonl`` that are not valid rows (a truncated last line, a bad value) are skipped and counted;
rows of another ``kind`` are ignored.

Use from Python::

    runs = [load_run("runs/fp32"), load_run("runs/aqsgd", label="AQ-SGD q2")]
    rows = comparison_table(runs)            # one dict per run, see comparison_table()
    plot_runs(runs, "report.png")            # 5 panels: loss vs step and vs wall time, eval metric,
                                             # cumulative bytes, total bytes
    fig = report_figure(runs)                # the same figure, not written (see PANELS)

Reading and comparing runs is :mod:`aqsgd.train.report.reader`, the figure :mod:`aqsgd.train.report.plot`,
and the ``aqsgd report`` command :mod:`aqsgd.cli.report`.
"""

from aqsgd.train.report.plot import PANELS, plot_runs, report_figure
from aqsgd.train.report.reader import (
    HIGHER_IS_BETTER,
    METRIC_PRIORITY,
    Run,
    comparison_table,
    is_uncompressed,
    load_run,
    main_metric,
    select_baseline,
)
from aqsgd.train.report.reader import MODES as MODES
from aqsgd.train.report.reader import ByteKey as ByteKey
from aqsgd.train.report.reader import Mode as Mode

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC_PRIORITY",
    "PANELS",
    "Run",
    "comparison_table",
    "is_uncompressed",
    "load_run",
    "main_metric",
    "plot_runs",
    "report_figure",
    "select_baseline",
]
