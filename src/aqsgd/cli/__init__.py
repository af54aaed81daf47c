"""The ``aqsgd`` command line. Each subcommand lives in its own module and registers its parser here."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Sequence

from aqsgd import __version__
from aqsgd.errors import AqsgdError, Interrupted
from aqsgd.interrupts import stop_on_signals
from aqsgd.logs import configure

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from aqsgd.cli import bench, codecs, data, evaluate, export, models, report, train

    parser = _Parser(
        prog="aqsgd",
        description="Pipeline-parallel training over slow networks with compressed activations and "
                    "gradients.",
    )
    parser.add_argument("--version", action="version", version=f"aqsgd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    train.register(sub)
    codecs.register(sub)
    bench.register(sub)
    data.register(sub)
    models.register(sub)
    report.register(sub)
    export.register(sub)
    evaluate.register(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """Bad options end with one line that names the option (and a pointer to --help), not the full usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = "aqsgd " + shlex.join(argv)  # what result files record as the command that made them
    configure(logging.DEBUG if args.verbose else logging.INFO)
    with stop_on_signals(again="exit"):  # SIGINT/SIGTERM: one line, exit 130/143 (a second one: at once)
        try:
            return int(args.func(args) or 0)
        except AqsgdError as e:  # bad input, a failed or diverged run: one clear line, no traceback
            print(f"aqsgd: error: {e}", file=sys.stderr)
            return e.exit_code
        except Interrupted as e:
            print(f"aqsgd: {e}", file=sys.stderr)
            return e.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
