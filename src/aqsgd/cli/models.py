"""``aqsgd models``: the model families ``--model`` accepts, by task kind and transformers ``model_type``."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from aqsgd.models import families


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the supported model families",
                       description="The model families aqsgd can cut into pipeline stages: for a hub name or "
                                   "a local folder given to --model, the config's model_type must be one of "
                                   "these.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    table = Table(title="model families for --model (a hub name or a local folder)")
    for col in ("task kind", "model_type (config.json)", "recipe kind"):
        table.add_column(col)
    rows = []
    for f in families():
        if f.task_kind is None:
            continue
        types = ", ".join(f.model_types) if f.model_types else ("any with its layout" if f.model_types is None
                                                                  else "bundled")
        rows.append((f.task_kind, types, f.kind))
    for row in sorted(rows):
        table.add_row(*row)
    Console().print(table)
    return 0
