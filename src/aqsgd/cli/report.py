"""``aqsgd report RUN_DIR...``: compare training runs in one table and one figure.

The runs are loaded and compared by :mod:`aqsgd.train.report`; this module prints the table (and writes it
as JSON with ``--json``) and writes the figure. Runs are compared on their uncompressed evaluation, the
model's quality; the evaluation through compressed boundaries is shown beside it, for what it is (AQ-SGD's
has no cache), and compared on only with ``--rank-by compressed``.
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
from aqsgd.train.report.files import check_writable, write_replacing
from aqsgd.train.report.reader import NO_CACHE_NOTE, RANK_BY, format_bytes, format_rate

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report RUN_DIR... [--out PATH.png] [--json PATH] [--baseline NAME] [--labels a,b,...]
    [--metric NAME] [--rank-by uncompressed|compressed]`` to an argparse subparsers object. The parser sets
    ``func`` (``args.func(args)`` returns the exit code). Returns the ``report`` parser."""
    p = sub.add_parser("report", help="compare training runs: a table and a 5-panel figure",
                       description="Compare run directories (config.json, metrics.jsonl, summary.json): "
                                   "print a table of final metrics, bytes and throughput, and write one PNG "
                                   "with training loss against steps and against wall time (the sum of the "
                                   "step times), eval metric, cumulative bytes and total bytes; the legend "
                                   "names each run's codecs, stages and emulated link. Runs are compared on "
                                   "the uncompressed evaluation (the model's quality); the one through "
                                   "compressed boundaries is shown beside it (AQ-SGD's has no per-sample "
                                   "cache, so it reads far worse than the model).")
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
    p.add_argument("--rank-by", default="uncompressed", choices=RANK_BY,
                   help="which evaluation the 'vs' column compares: uncompressed (default: the model's "
                        "quality) or compressed (through the runs' compressed boundaries)")
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


def _diff(r: dict) -> str:
    """The relative difference to the baseline, green where better and red where worse."""
    diff = "-" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.2f}%"
    if r["rel_diff"] and r["higher_is_better"] is not None:
        better = (r["rel_diff"] > 0) == r["higher_is_better"]
        diff = f"[{'green' if better else 'red'}]{diff}[/]"
    return diff


def _table(rows: list[dict], runs: list[Run]) -> Table:
    """The comparison table: the uncompressed evaluation first (the model's quality), then the one through
    compressed boundaries (``-`` for a run without one, ``(no cache)`` for AQ-SGD's), with the ``vs``
    column after the one it compares; the setting without codecs where nothing was compressed."""
    metric, base, rank_by = rows[0]["metric"], rows[0]["baseline"], rows[0]["rank_by"]
    off = metric or "metric"
    on = f"{off} through compressed boundaries"
    vs = f"vs {escape(base)}" + (" (compressed)" if rank_by == "compressed" else "")
    evals = [off, vs, on] if rank_by == "uncompressed" else [off, on, vs]
    compared = "no eval metric" if metric is None else (on if rank_by == "compressed" else off)
    table = Table(title=f"runs compared on {compared}; baseline: {escape(base)}")
    cols = ["run", "setting", "steps", "train loss", *evals, "bytes sent", "ratio", "samples/s"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("run", "setting") else "right", overflow="fold")
    metric_fmt = ".4f" if metric in ("accuracy", "mcc") else ".4g"
    for r, run in zip(rows, runs):
        no_cache = r["no_cache"] and r["metric_on"] is not None
        cells = {off: _fmt(r["metric_off"], metric_fmt), vs: _diff(r),
                 on: _fmt(r["metric_on"], metric_fmt) + (" (no cache)" if no_cache else "")}
        table.add_row(escape(r["run"]), escape(run.setting_label), _fmt(r["steps"], "d"),
                      _fmt(r["final_train_loss"], ".4f"), *(cells[c] for c in evals),
                      "-" if r["bytes_sent"] is None else format_bytes(r["bytes_sent"]),
                      _fmt(r["compression_ratio"], ".1f") + ("x" if r["compression_ratio"] else ""),
                      "-" if r["samples_per_s"] is None else format_rate(r["samples_per_s"]))
    return table


def run(args: argparse.Namespace) -> int:
    """``aqsgd report``: load the runs, print the table, write the PNG (and the JSON). A
    :class:`ReportError` propagates (the main CLI prints it as one line); an output path that cannot be
    written is refused before anything is loaded."""
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
    check_writable(args.out, "--out", ReportError)
    if args.json is not None:
        check_writable(args.json, "--json", ReportError)
    runs = [load_run(d, label=lab) for d, lab in zip(dirs, labels)]
    if args.labels is None:
        _unique_names(runs)
    rank_by = getattr(args, "rank_by", "uncompressed")
    rows = comparison_table(runs, baseline=args.baseline, metric=args.metric, rank_by=rank_by)

    console = Console(width=max(Console().width, 150))
    console.print(_table(rows, runs))
    if any(r["no_cache"] and r["metric_on"] is not None for r in rows):
        console.print(escape(NO_CACHE_NOTE), soft_wrap=True)
    for run in runs:
        if run.skipped_lines:
            console.print(escape(f"{run.name}: skipped {run.skipped_lines} malformed line(s) in "
                                 f"{run.path / 'metrics.jsonl'}"), soft_wrap=True)
    out = plot_runs(runs, args.out, baseline=args.baseline, metric=args.metric)
    console.print(escape(f"wrote {out}"), soft_wrap=True)
    if args.json is not None:
        text = json.dumps({"metric": rows[0]["metric"], "baseline": rows[0]["baseline"], "rank_by": rank_by,
                           "rows": rows}, indent=2) + "\n"
        write_replacing(args.json, lambda f: f.write(text.encode("utf-8")), "--json", ReportError)
        console.print(escape(f"wrote {args.json}"), soft_wrap=True)
    return 0
