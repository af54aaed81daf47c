"""``aqsgd eval``: evaluate a run's checkpoint with compression on and off.

The run's pipeline is rebuilt from its own settings in this process, its newest complete checkpoint
(or ``--checkpoint STEP``'s) is loaded, and its evaluation data, or ``--eval-file F`` in the format of its
training file, are evaluated with the run's codecs at every stage boundary and uncompressed. Nothing is
written into the run; ``--out FILE.json`` keeps the result.
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a run's checkpoint (compression on and off)",
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


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from aqsgd.train.evaluate import evaluate_run

    result = evaluate_run(args.run, checkpoint=args.checkpoint, eval_file=args.eval_file,
                          max_eval_samples=args.max_eval_samples, device=args.device)
    table = Table(title=f"{result['checkpoint']} (step {result['step']}, {result['samples']} samples)")
    table.add_column("metric")
    table.add_column("compression on", justify="right")
    table.add_column("compression off", justify="right")
    on, off = result["eval"].get("compressed", {}), result["eval"].get("uncompressed", {})
    for name in off:
        table.add_row(name, f"{on.get(name, float('nan')):.4f}", f"{off[name]:.4f}")
    Console().print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0
