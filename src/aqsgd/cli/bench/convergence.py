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
        option("tasks", f"tasks, of {', '.join(TASKS)} (default: the study's; {' '.join(DEFAULT_TASKS)} for "
               "the convergence study)", nargs="*", choices=list(TASKS), default=None, metavar="TASK"),
        option("--study", "which study: its default settings and the name of its result files, "
               "<study>-TASK.json (default: convergence; fewer-bits: rotated tiles, outlier rows, zstd, "
               "1-bit AQ-SGD, TAH-Quant; lora: LoRA in fp32 and with AQ-SGD against full fine-tuning; "
               "instruct: instruction tuning; subspace: both directions in learned bases, pca/4; diloco: the "
               "replicas' sync per step against DiLoCo's outer steps, on the data-parallel tasks)",
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
    from aqsgd.bench.convergence import STUDIES, default_tasks, run_study, study_table, write_results

    console = wide_console()
    overrides = {k: v for k, v in (("epochs", args.epochs), ("max_train_samples", args.max_train_samples),
                                   ("max_eval_samples", args.max_eval_samples)) if v}
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command_line
    tasks = args.tasks or default_tasks(args.study)
    for task in tasks:
        if task not in STUDIES[args.study] and not args.settings:
            raise SpecError(f"--study {args.study} has no settings for {task}; its tasks: "
                            f"{', '.join(STUDIES[args.study])} (or give --settings)")
    machine = machine_description(torch.device("cpu"))
    for task in tasks:
        results = run_study(task, args.runs_dir, settings=args.settings, overrides=overrides,
                            seeds=args.seeds, progress=lambda m: console.print(m), command=command,
                            keep_checkpoints=args.keep_checkpoints, study=args.study, machine=machine)
        path, png = write_results(task, results, args.runs_dir, out, command=command, machine=machine,
                                  tag=args.tag, study=args.study, settings=args.settings)
        rows = [r for r in study_table(results) if args.study == "convergence"
                or r["setting"] in STUDIES[args.study][task] or r["setting"] in (args.settings or [])]
        title = f"{args.study}: {task}" + _seeds_note(rows)
        sync = all("sync_bytes_per_step" in r for r in rows)
        console.print(_sync_table(rows, title) if sync else _table(rows, title))
        console.print(f"wrote {path}"
                      + (f" and {png}" if png else " (the plot needs every seed-0 run directory)"))
    return 0


def _seeds_note(rows: list[dict]) -> str:
    """The title's word on seeds, from the rows themselves (a study continued from its JSON can hold
    settings run with more seeds than this command's): the seeds the means are over, and a row's own where
    it has fewer (its setting then reads ``name (seed 0)``)."""
    every = sorted({s for r in rows for s in r["seeds"]})
    if len(every) < 2:
        return ""
    for r in rows:
        if r["seeds"] != every:
            r["setting"] = f"{r['setting']} (seed{'s' if len(r['seeds']) > 1 else ''} "
            r["setting"] += ", ".join(map(str, r["seeds"])) + ")"
    return f" (means over seeds {', '.join(map(str, every))})"


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


_SYNC_COLUMNS = ("setting", "grad sync", "sync MB/step", "fewer than q8", "run at {mbit} Mbit/s",
                 "to fp32's loss", "sooner than fp32", "metric", "eval (comp. off)", "off vs fp32",
                 "best vs fp32")


def _sync_table(rows: list[dict], title: str) -> Table:
    """A data-parallel study (the ``diloco`` study) as a table: what the replicas' sync sent per step, the
    run's length over the slow link, how soon it reached fp32's final training loss, and its evaluation."""
    from aqsgd.bench.convergence import format_relative

    mbit = rows[0]["link_mbit"] if rows else 0
    q8 = next((r["sync_bytes_per_step"] for r in rows if r["grad_sync"] == "q8"), None)
    table = Table(title=title)
    for col in _SYNC_COLUMNS:
        table.add_column(col.format(mbit=f"{mbit:g}"), no_wrap=col in ("setting", "grad sync"),
                         justify="left" if col in ("setting", "grad sync", "metric") else "right")
    for r in rows:
        minutes = lambda s: "-" if s is None else f"{s:.1f} s" if s < 60 else f"{s / 60:.1f} min"  # noqa: E731
        reached = [t for t in r["time_to_target_runs"] if t is not None]
        to_target = (minutes(r["time_to_target_s"]) if reached else "never") + (
            f" ({len(reached)}/{len(r['seeds'])})" if len(reached) < len(r["seeds"]) else "")
        sooner = r["sooner_than_fp32"]
        per_step = r["sync_bytes_per_step"]
        table.add_row(r["setting"], r["grad_sync"], f"{per_step / 1e6:.3f}",
                      "-" if not q8 or not per_step else f"{q8 / per_step:.1f}x",
                      minutes(r["link_run_s"]), to_target, "-" if sooner is None else f"{sooner:.2f}x",
                      r["metric"], "-" if r["eval_off"] is None else f"{r['eval_off']:.4f}",
                      format_relative(r["rel_off_vs_fp32"], r["rel_off_vs_fp32_std"]),
                      format_relative(r["rel_best_off_vs_fp32"], r["rel_best_off_vs_fp32_std"]))
    return table
