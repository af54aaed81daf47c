"""How a benchmark's options are declared: one :class:`BenchOption` per option, most filling one field of the
benchmark's settings dataclass. Such an option's default is the field's default (and its help shows it where
the help says ``{default}``), and the settings are built from the parsed options by the same table
(:func:`settings_from`): adding a setting is one line, and a default lives only with the settings."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

__all__ = ["BenchOption", "option", "add_options", "settings_from", "ints", "floats", "words", "wide_console",
           "columns"]


@dataclasses.dataclass(frozen=True)
class BenchOption:
    """One option of ``aqsgd bench NAME``: its flag (or positional name), its help, the settings field it
    fills (None: an option of the command alone, such as ``--json``) and the rest of ``add_argument``'s
    arguments."""

    flag: str
    help: str
    field: str | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value in."""
        return self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_")


def option(flag: str, help: str, *, field: str | None = None, **kwargs: Any) -> BenchOption:
    return BenchOption(flag, help, field, kwargs)


def add_options(parser: argparse.ArgumentParser, options: Sequence[BenchOption],
                defaults: Any = None) -> None:
    """Add ``options`` to ``parser``; one that fills a field takes the field's value in ``defaults`` (an
    instance of the settings dataclass) as its default, a tuple as a list (what the command line gives)."""
    for o in options:
        kwargs = dict(o.kwargs)
        if o.field is not None and "default" not in kwargs:
            value = getattr(defaults, o.field)
            kwargs["default"] = list(value) if isinstance(value, tuple) else value
        parser.add_argument(o.flag, help=o.help.replace("{default}", _shown(kwargs.get("default"))), **kwargs)


def settings_from(cls: type, args: argparse.Namespace, options: Sequence[BenchOption]) -> Any:
    """The benchmark's settings (an instance of ``cls``) from the parsed options that fill its fields."""
    return cls(**{o.field: getattr(args, o.dest) for o in options if o.field is not None})


def _shown(value: Any) -> str:
    """A default as the help shows it: a list comma-separated, a float without a needless ``.0``."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(_shown, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def words(text: str) -> list[str]:
    """A comma-separated list of names."""
    return text.split(",")


def wide_console() -> Any:
    """A console at least 150 columns wide: the benchmarks' tables are wide."""
    from rich.console import Console

    return Console(width=max(Console().width, 150))


def columns(names: Sequence[str], *, left: Sequence[str] = (), title: str | None = None) -> Any:
    """A table with these columns, right-aligned but for those in ``left``."""
    from rich.table import Table

    table = Table(title=title)
    for name in names:
        table.add_column(name, justify="left" if name in left else "right")
    return table
