"""``aqsgd bench convergence``: fp32 against direct quantization, AQ-SGD, TopK and error feedback, with the
same seed and data (:mod:`aqsgd.bench.convergence`)."""

from __future__ import annotations

import argparse

import torch
from rich.table import Table

from aqsgd.cli.bench.options import add_options, ints, option, wide_console
from aqsgd.cli.options import positive_int
from aqsgd.errors import SpecError

DESCRIPTION = ("Train every setting with the same seed, data order and steps on reduced tasks; write curves "
               "and final metrics (compression on and off at eval) as JSON, a PNG per task and a table.")


def _options() -> list:
    from aqsgd.bench.convergence import DEFAULT_TASKS, SETTINGS, STUDIES, TASKS

    return [
        option("tasks", f"tasks, of {', '.join(TASKS)} (default: {' '.join(DEFAULT_TASKS)})", nargs="*",
               choices=list(TASKS), default=list(DEFAULT_TASKS), metavar="TASK"),
        option("--study", "which study: its default settings and the name of its result files, "
               "<study>-TASK.json (default: convergence; fewer-bits: rotated tiles, outlier rows, zstd, "
               "1-bit AQ-SGD, TAH-Quant; lora: LoRA in fp32 and with AQ-SGD against full fine-tuning; "
               "instruct: instruction tuning; subspace: both directions in learned bases, pca/4)",
               choices=list(STUDIES), default="convergence"),
        option("--settings", "settings (default: the study's)", nargs="+", choices=list(SETTINGS),
               default=None, metavar="SETTING"),
        option("--runs-dir", "run directories (default: runs/convergence); an interrupted study continues "
               "where it stopped", default="runs/convergence"),
        option("--results-dir", "JSON and PNG output (default: benchmarks/results)",
               default="benchmarks/results"),
        option("--epochs", "override the task's epochs", type=positive_int, default=None),
        option("--max-train-samples", "override the task's training samples", type=positive_int,
               default=None),
        option("--max-eval-samples", "override the task's evaluation samples", type=positive_int,
               default=None),
        option("--dropout", "override the model's dropout probabilities (e.g. 0)", type=float, default=None),
        option("--seeds", "run every setting once per seed (data order, head initialization, rounding); the "
               "table gives means and the spread of the paired differences to fp32 (default: 0)", type=ints,
               default=[0], metavar="N[,N...]"),
        option("--tag", "suffix of the result files: convergence-TASK-TAG.json/.png (use it with another "
               "--runs-dir when overriding the task's settings)", default=None),
        option("--keep-checkpoints", "keep every finished run's checkpoints (default: delete them once the "
               "run is recorded; an LLM run's take gigabytes)", action="store_true"),
    ]


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("convergence", description=DESCRIPTION,
                         help="fp32 vs direct quantization vs AQ-SGD vs TopK/EF, same seed and data")
    add_options(p, _options())
    p.set_defaults(func=run_convergence)


_COLUMNS = ("setting", "forward", "backward", "train loss", "metric", "eval (comp. on)", "eval (comp. off)",
            "on vs fp32", "off vs fp32", "best off", "best vs fp32", "loss gap", "fw bits/value",
            "traffic ratio")
_LEFT = ("setting", "forward", "backward", "metric")


def run_convergence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aqsgd.bench.codecs import machine_description
    from aqsgd.bench.convergence import STUDIES, run_study, study_table, write_results

    console = wide_console()
    overrides = {k: v for k, v in (("epochs", args.epochs), ("max_train_samples", args.max_train_samples),
                                   ("max_eval_samples", args.max_eval_samples)) if v}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line
    for task in args.tasks:
        if task not in STUDIES[args.study] and not args.settings:
            raise SpecError(f"--study {args.study} has no settings for {task}; its tasks: "
                            f"{', '.join(STUDIES[args.study])} (or give --settings)")
    for task in args.tasks:
        results = run_study(task, args.runs_dir, settings=args.settings, overrides=overrides,
                            seeds=args.seeds, progress=lambda m: console.print(m), command=command,
                            keep_checkpoints=args.keep_checkpoints, study=args.study)
        path, png = write_results(task, results, args.runs_dir, out, command=command,
                                  machine=machine_description(torch.device("cpu")), tag=args.tag,
                                  study=args.study, settings=args.settings)
        rows = [r for r in study_table(results) if args.study == "convergence"
                or r["setting"] in STUDIES[args.study][task] or r["setting"] in (args.settings or [])]
        console.print(_table(rows, f"{args.study}: {task}"
                             + (f" (means over seeds {args.seeds})" if len(args.seeds) > 1 else "")))
        console.print(f"wrote {path}"
                      + (f" and {png}" if png else " (the plot needs every seed-0 run directory)"))
    return 0


def _table(rows: list[dict], title: str) -> Table:
    """One task's study as a table: each setting's losses and metrics, relative to fp32."""
    from aqsgd.bench.convergence import format_relative

    table = Table(title=title)
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col in _LEFT else "right")
    for r in rows:
        fmt = lambda v, p=4: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        table.add_row(r["setting"], r["forward"], r["backward"], fmt(r["final_train_loss"]), r["metric"],
                      fmt(r["eval_on"]), fmt(r["eval_off"]),
                      format_relative(r["rel_vs_fp32"], r["rel_vs_fp32_std"]),
                      format_relative(r["rel_off_vs_fp32"], r["rel_off_vs_fp32_std"]), fmt(r["best_off"]),
                      format_relative(r["rel_best_off_vs_fp32"], r["rel_best_off_vs_fp32_std"]),
                      fmt(r["train_loss_gap"], 3), fmt(r["wire_bits_per_value"], 2),
                      fmt(r["compression_ratio"], 2))
    return table
