"""``aqsgd eval``: evaluate a run's checkpoint, uncompressed and through its compressed boundaries.

The run's pipeline is rebuilt from its own settings in this process, its newest complete checkpoint
(or ``--checkpoint STEP``'s) is loaded, and its evaluation data, or ``--eval-file F`` in the format of its
training file, are evaluated uncompressed (the model's quality) and with the run's codecs at every stage
boundary (a run of one stage, or whose activations cross uncompressed, shows one figure). An AQ-SGD
run's compressed evaluation has no per-sample cache (evaluation samples have none), so it reads far worse
than the model. Nothing is written into the run; ``--out FILE.json`` keeps the result (a path that cannot be
written is refused before the evaluation runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a run's checkpoint (uncompressed and through its compressed "
                                    "boundaries)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="the run directory (runs/NAME)")
    p.add_argument("--checkpoint", type=int, metavar="STEP",
                   help="the checkpoint of this step (default: the newest complete one)")
    p.add_argument("--eval-file", metavar="FILE", help="evaluate on this file (the training file's format) "
                   "instead of the run's evaluation data")
    p.add_argument("--max-eval-samples", type=int, metavar="N", help="evaluate the first N samples (0: all)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to evaluate (default: the run's)")
    p.add_argument("--out", metavar="FILE.json", help="also write the result here")
    p.set_defaults(func=run)


def _run_settings(run: str | Path) -> tuple[str | None, int | None]:
    """The run's forward setting and stages, from its ``config.json`` (None where it does not say: both
    evaluations are then shown)."""
    from aqsgd.train.config import flatten_config

    try:
        config = json.loads((Path(run) / "config.json").read_text(encoding="utf-8"))
        flat = flatten_config(config) if isinstance(config, dict) else {}
    except (OSError, ValueError):
        flat = {}
    forward, stages = flat.get("forward"), flat.get("stages")
    return (forward if isinstance(forward, str) else None,
            stages if isinstance(stages, int) and not isinstance(stages, bool) else None)


def _table(result: dict[str, Any], forward: str | None, stages: int | None) -> tuple[Any, list[str]]:
    """The result as a table, and the notes to print under it: the uncompressed evaluation first, the one
    through compressed boundaries beside it where the run has one (with the note that AQ-SGD's has no
    cache)."""
    from rich.table import Table

    from aqsgd.train.report.reader import (
        NO_CACHE_NOTE,
        compressed_eval_label,
        evaluates_compressed,
        evaluates_without_cache,
    )

    title = f"{result['checkpoint']} (step {result['step']}, {result['samples']} samples)"
    table = Table(title=title, min_width=len(title))  # (the title on one line above a narrow table)
    on, off = result["eval"].get("compressed") or {}, result["eval"].get("uncompressed") or {}
    both = evaluates_compressed(forward, stages) and bool(on)
    table.add_column("metric")
    table.add_column("uncompressed" if both else "value", justify="right")
    if both:
        table.add_column(compressed_eval_label(forward, stages), justify="right")
    for name in off:
        cells = [f"{off[name]:.4f}"] + ([f"{on.get(name, float('nan')):.4f}"] if both else [])
        table.add_row(name, *cells)
    return table, [NO_CACHE_NOTE] if both and evaluates_without_cache(forward, stages) else []


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from aqsgd.train.evaluate import evaluate_run
    from aqsgd.train.report.files import check_writable, write_replacing

    if args.out:
        check_writable(args.out, "--out")  # before the evaluation, which may take long
    result = evaluate_run(args.run, checkpoint=args.checkpoint, eval_file=args.eval_file,
                          max_eval_samples=args.max_eval_samples, device=args.device)
    table, notes = _table(result, *_run_settings(args.run))
    console = Console()
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False)
    if result.get("auto_links"):  # --forward/--backward auto: each link as the run had left it
        console.print("compressed at the levels the links had reached at the checkpoint: "
                      + ", ".join(f"{k} {v}" for k, v in result["codecs"].items()), soft_wrap=True,
                      markup=False)
    if args.out:
        text = json.dumps(result, indent=1)
        write_replacing(args.out, lambda f: f.write(text.encode("utf-8")), "--out")
    return 0
