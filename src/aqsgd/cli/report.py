"""``aqsgd report RUN_DIR...``: compare training runs in one table and one figure.

The runs are loaded and compared by :mod:`aqsgd.train.report`; this module prints the table (and writes it
as JSON with ``--json``) and writes the figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aqsgd.errors import ReportError
from aqsgd.train.report import METRIC_PRIORITY, Run, comparison_table, load_run, plot_runs
from aqsgd.train.report.reader import format_bytes

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report RUN_DIR... [--out PATH.png] [--json PATH] [--baseline NAME] [--labels a,b,...]
    [--metric NAME]`` to an argparse subparsers object. The parser sets ``func`` (``args.func(args)``
    returns the exit code). Returns the ``report`` parser."""
    p = sub.add_parser("report", help="compare training runs: a table and a 5-panel figure",
                       description="Compare run directories (config.json, metrics.jsonl, summary.json): "
                                   "print a table of final metrics, bytes and throughput, and write one PNG "
                                   "with training loss against steps and against wall time (the sum of the "
                                   "step times), eval metric, cumulative bytes and total bytes; the legend "
                                   "names each run's codecs, stages and emulated link.")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    p.add_argument("--out", type=Path, default=Path("report.png"), metavar="PATH.png",
                   help="where to write the figure (default: report.png)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the table as JSON to PATH")
    p.add_argument("--baseline", default=None, metavar="NAME",
                   help="run to compare against (default: the uncompressed none/fp32 run, else the first)")
    p.add_argument("--labels", default=None, metavar="a,b,...",
                   help="comma-separated run names, one per RUN_DIR (default: the directory names)")
    p.add_argument("--metric", default=None, choices=METRIC_PRIORITY,
                   help="eval metric to compare (default: the first present of accuracy, mcc, "
                        "perplexity, loss; mcc first for CoLA)")
    p.set_defaults(func=run)
    return p


def _unique_names(runs: list[Run]) -> None:
    """Rename runs whose names clash (same directory name under different parents) to ``parent/name``."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        if seen[run.name] > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
    names = [run.name for run in runs]
    for i, run in enumerate(runs):
        if names.count(run.name) > 1:
            run.name = f"{run.name} #{names[:i + 1].count(names[i])}"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run(args: argparse.Namespace) -> int:
    """``aqsgd report``: load the runs, print the table, write the PNG (and the JSON). A
    :class:`ReportError` propagates (the main CLI prints it as one line)."""
    dirs: list[Path] = list(args.run_dirs)
    labels: list[str | None] = [None] * len(dirs)
    if args.labels is not None:
        given = [s.strip() for s in args.labels.split(",")]
        if len(given) != len(dirs) or not all(given):
            raise ReportError(f"--labels has {len(given)} name(s) for {len(dirs)} run director"
                              f"{'y' if len(dirs) == 1 else 'ies'}; give one non-empty name per RUN_DIR")
        if len(set(given)) != len(given):
            raise ReportError(f"--labels has duplicate names: {args.labels}")
        labels = list(given)
    runs = [load_run(d, label=lab) for d, lab in zip(dirs, labels)]
    if args.labels is None:
        _unique_names(runs)
    rows = comparison_table(runs, baseline=args.baseline, metric=args.metric)
    metric = rows[0]["metric"]
    base = rows[0]["baseline"]

    table = Table(title=f"runs compared on {metric or 'no eval metric'}; baseline: {escape(base)}")
    left = {"run", "setting"}
    cols = ["run", "setting", "steps", "train loss", f"{metric or 'metric'} on", f"{metric or 'metric'} off",
            f"vs {escape(base)}", "bytes sent", "ratio", "samples/s"]
    for col in cols:
        table.add_column(col, justify="left" if col in left else "right", overflow="fold")
    metric_fmt = ".4f" if metric in ("accuracy", "mcc") else ".4g"
    for r in rows:
        diff = "-" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.2f}%"
        if r["rel_diff"] and r["higher_is_better"] is not None:
            better = (r["rel_diff"] > 0) == r["higher_is_better"]
            diff = f"[{'green' if better else 'red'}]{diff}[/]"
        table.add_row(escape(r["run"]), escape(r["setting"]), _fmt(r["steps"], "d"),
                      _fmt(r["final_train_loss"], ".4f"),
                      _fmt(r["metric_on"], metric_fmt), _fmt(r["metric_off"], metric_fmt), diff,
                      "-" if r["bytes_sent"] is None else format_bytes(r["bytes_sent"]),
                      _fmt(r["compression_ratio"], ".1f") + ("x" if r["compression_ratio"] else ""),
                      _fmt(r["samples_per_s"], ",.1f"))
    console = Console(width=max(Console().width, 150))
    console.print(table)
    for run in runs:
        if run.skipped_lines:
            console.print(escape(f"{run.name}: skipped {run.skipped_lines} malformed line(s) in "
                                 f"{run.path / 'metrics.jsonl'}"), soft_wrap=True)
    out = plot_runs(runs, args.out, baseline=args.baseline, metric=args.metric)
    console.print(escape(f"wrote {out}"), soft_wrap=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metric": metric, "baseline": base, "rows": rows}, indent=2) + "\n",
                             encoding="utf-8")
        console.print(escape(f"wrote {args.json}"), soft_wrap=True)
    return 0
