"""The ``aqsgd`` command line. Each subcommand lives in its own module and registers its parser here."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Any, Sequence

from aqsgd import __version__
from aqsgd.cli.options import plain_text
from aqsgd.errors import AqsgdError, Interrupted
from aqsgd.interrupts import stop_on_signals
from aqsgd.logs import configure

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from aqsgd.cli import bench, codecs, data, evaluate, export, generate, models, report, train

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
    generate.register(sub)
    _plain_descriptions(parser)
    return parser


def _plain_descriptions(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's description (often its module's docstring) as plain text: ``--help`` prints it in a
    terminal, where reST roles and double backquotes are noise."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.description = plain_text(sub.description)
                _plain_descriptions(sub)


class _Value(str):
    """A command-line word that starts with "-" but is the value of the option before it (``--lr -1e-3``)."""


def _plain(value: Any) -> Any:
    """``value`` with :class:`_Value` words back to plain strings (also inside the list of a multi-value
    option)."""
    if isinstance(value, _Value):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _Parser(argparse.ArgumentParser):
    """Bad options end with one line that names the option (and a pointer to --help), not the full usage.

    A word that starts with "-" right after an option that takes a value, and is no option itself, is that
    option's value (``--lr -1e-3``, ``--link -5mbit``): argparse would take it for an unknown option and say
    "expected one argument", where the option's own check says what is wrong with the value."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = _mark_values(self, list(sys.argv[1:] if args is None else args))
        namespace, extras = super().parse_known_args(args, namespace)
        for key, value in list(vars(namespace).items()):
            setattr(namespace, key, _plain(value))
        return namespace, _plain(extras)

    def _parse_optional(self, arg_string: str):  # type: ignore[override]
        if isinstance(arg_string, _Value):  # (None: a positional word, here an option's value)
            return None
        return super()._parse_optional(arg_string)


def _mark_values(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with each word that follows one of ``parser``'s options taking a value, starts with "-" and is
    no option of ``parser`` made a :class:`_Value`. The words of a subcommand (and those after ``--``) are
    left to the subcommand's parser."""
    commands = {name for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                for name in a.choices}
    out = list(args)
    for i, word in enumerate(out[:-1]):
        if word == "--" or word in commands:
            break
        action = _option(parser, word)
        following = out[i + 1]
        if (action is not None and action.nargs != 0 and "=" not in word and following.startswith("-")
                and following != "--" and not _is_option(parser, following)):
            out[i + 1] = _Value(following)
    return out


def _option(parser: argparse.ArgumentParser, word: str) -> argparse.Action | None:
    """The option of ``parser`` that ``word`` names (``--opt``, ``--opt=value`` or an unambiguous prefix of a
    long option, as argparse reads it), or None."""
    if isinstance(word, _Value) or not word.startswith("-"):
        return None
    name = word.split("=", 1)[0] if word.startswith("--") else word
    if name in parser._option_string_actions:
        return parser._option_string_actions[name]
    if parser.allow_abbrev and name.startswith("--"):
        found = {a for s, a in parser._option_string_actions.items() if s.startswith(name)}
        if len(found) == 1:
            return found.pop()
    return None


def _is_option(parser: argparse.ArgumentParser, word: str) -> bool:
    """Whether argparse reads ``word`` as one of ``parser``'s options (an ambiguous prefix included: argparse
    then says which options it could be)."""
    name = word.split("=", 1)[0] if word.startswith("--") else word
    if name in parser._option_string_actions:
        return True
    return parser.allow_abbrev and name.startswith("--") and any(
        s.startswith(name) for s in parser._option_string_actions)


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
