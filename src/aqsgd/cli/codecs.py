"""``aqsgd codecs``: list the codec spec grammar, or describe given specs (wire bytes, ratio)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from aqsgd.cli.options import parse_shape
from aqsgd.compress import SPEC_HELP, make_codec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codecs", help="list codec specs or describe some",
                       description="Without arguments, print the codec spec grammar. With specs, print each "
                                   "one's canonical form, wire bytes and compression ratio for --shape.")
    p.add_argument("specs", nargs="*", help="codec specs, e.g. q2 q4:token topk0.1+q8")
    p.add_argument("--shape", type=parse_shape, default=(8, 512, 768),
                   help="tensor shape for byte counts, comma-separated (default: 8,512,768)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if not args.specs:
        console.print(SPEC_HELP)
        return 0
    table = Table(title=f"codecs for an fp32 tensor of shape {tuple(args.shape)}")
    for col in ("spec", "canonical", "wire bytes", "ratio vs fp32"):
        table.add_column(col, justify="right" if col != "spec" else "left")
    for spec in args.specs:
        c = make_codec(spec)
        bound = "" if c.fixed_size else "≤ "  # the size depends on the data: the largest there can be
        table.add_row(spec, c.spec, f"{bound}{c.wire_bytes(args.shape):,}",
                      f"{'≥ ' if bound else ''}{c.ratio(args.shape):.2f}x")
    console.print(table)
    if any(not make_codec(s).fixed_size for s in args.specs):
        console.print("≤: the packet size depends on the data (outlier rows, zstd); shown is the largest")
    return 0
