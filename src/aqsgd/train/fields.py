"""The fields of a config section as options: each field's docstring (its ``--help``), its flat name, its
type and default, the type a value read from TOML or JSON must have, and the range or choices a value must be
in. :mod:`aqsgd.train.config` lists the sections; this module only knows how one documented dataclass reads
and checks its fields (a field states its own range where it is declared: ``field(4, check=at_least(1))``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from aqsgd.errors import SpecError

__all__ = ["Option", "section_options", "typed", "field", "Check", "at_least", "above", "fraction", "one_of",
           "check_fields", "check_finite", "check_ranges", "flat_values", "bad", "parsed",
           "flatten_tables", "read_toml"]

Check = tuple[Callable[[Any], bool], str]
"""What a field's value must satisfy, and the error's text when it does not (``{}`` is the value)."""


def field(default: Any = dataclasses.MISSING, *, flat: str | None = None, check: Check | None = None) -> Any:
    """A section field with its flat (command-line) name where that is not its own name, and the
    :data:`Check` its value must pass (None, where the field allows it, passes)."""
    metadata = {k: v for k, v in (("flat", flat), ("check", check)) if v is not None}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def at_least(low: int, note: str = "") -> Check:
    return (lambda x: x >= low), f"must be >= {low}{note}, got {{}}"


def above(low: float, unit: str = "") -> Check:
    return (lambda x: x > low), f"must be > {low:g}{unit}, got {{}}"


def fraction(*, zero: bool = True) -> Check:
    """In [0, 1), or in (0, 1) without ``zero``."""
    if zero:
        return (lambda x: 0 <= x < 1), "must be in [0, 1), got {}"
    return (lambda x: 0 < x < 1), "must be in (0, 1), got {}"


def one_of(*valid: str) -> Check:
    return (lambda x: x in valid), f"{{!r}} is not one of {', '.join(valid)}"


def bad(flat: str, why: str) -> SpecError:
    """The one-line error for a bad value, naming the option as the command line spells it."""
    return SpecError(f"--{flat.replace('_', '-')}: {why}")


def parsed(flat: str, parse: Callable[[str], Any], text: str) -> Any:
    """``parse(text)``, a ValueError it raises turned into the one-line error naming the option."""
    try:
        return parse(text)
    except ValueError as e:
        raise bad(flat, str(e)) from None


def flat_values(section: Any) -> dict[str, Any]:
    """``{flat name: value}`` of a section's fields."""
    return {f.metadata.get("flat", f.name): getattr(section, f.name) for f in dataclasses.fields(section)}


def check_finite(section: Any) -> None:
    """No float of the section is NaN or infinite."""
    for name, value in flat_values(section).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(name, f"must be a finite number, got {value}")


def check_ranges(section: Any) -> None:
    """Every field's value passes the :data:`Check` its declaration gives (a None passes)."""
    for f in dataclasses.fields(section):
        value, check = getattr(section, f.name), f.metadata.get("check")
        if check is not None and value is not None and not check[0](value):
            raise bad(f.metadata.get("flat", f.name), check[1].format(value))


def check_fields(section: Any) -> None:
    """The checks every section's fields take: floats finite, then each field's own range or choices."""
    check_finite(section)
    check_ranges(section)


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of a dataclass (``ast``: Python keeps none at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Option:
    """One field of the config as the command line and the TOML reader see it."""

    section: str
    name: str  # the field's name inside its section
    flat: str  # its flat name (``--flat-name`` on the command line)
    help: str
    base: type  # int, float, str or bool
    optional: bool  # None allowed
    is_list: bool
    default: Any

    @property
    def flag(self) -> str:
        return "--" + self.flat.replace("_", "-")


def section_options(section: str, cls: type) -> list[Option]:
    """Every field of the section class ``cls`` as an :class:`Option`, in order; a field without a docstring
    is a TypeError (it would have no ``--help``)."""
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    defaults = cls()
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring")
        t, optional = hints[f.name], False
        args = typing.get_args(t)
        if type(None) in args:
            optional, t = True, next(a for a in args if a is not type(None))
        is_list = typing.get_origin(t) is list
        base = typing.get_args(t)[0] if is_list else t
        out.append(Option(section, f.name, f.metadata.get("flat", f.name), docs[f.name], base, optional,
                          is_list, getattr(defaults, f.name)))
    return out


def typed(opt: Option, value: Any, source: str) -> Any:
    """``value`` checked against the option's type (an int where a float is expected is converted)."""
    if value is None and opt.optional:
        return None

    def one(v: Any) -> Any:
        if opt.base is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, opt.base) and not (opt.base is int and isinstance(v, bool)):
            return v
        raise SpecError(f"{source}: {opt.flat} must be {_type_name(opt)}, got {v!r}")

    if opt.is_list:
        if not isinstance(value, list):
            raise SpecError(f"{source}: {opt.flat} must be {_type_name(opt)}, got {value!r}")
        return [one(v) for v in value]
    return one(value)


def _type_name(opt: Option) -> str:
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[opt.base]
    if opt.is_list:
        name = f"a list of {name.split(' ', 1)[1]}s"
    return name + (" (or omitted)" if opt.optional else "")


def flatten_tables(data: dict[str, Any], source: str, options: Sequence[Option]) -> dict[str, Any]:
    """``{table: {key: value}}`` to ``{flat name: value}``, naming an unknown table, an unknown key or a key
    in the wrong table. ``options``: every section's, in order (a table per section)."""
    sections = list(dict.fromkeys(o.section for o in options))
    by_section = {s: {o.name: o for o in options if o.section == s} for s in sections}
    by_flat = {o.flat: o for o in options}
    flat: dict[str, Any] = {}
    for table, values in data.items():
        if not isinstance(values, dict):
            if table in by_flat:
                o = by_flat[table]
                raise SpecError(f"{source}: {table!r} belongs in table [{o.section}] (as {o.name} = ...)")
            raise SpecError(f"{source}: unknown key {table!r}; settings go in the tables "
                            f"{', '.join(f'[{s}]' for s in sections)}")
        if table not in by_section:
            raise SpecError(f"{source}: unknown table [{table}]; tables are {', '.join(sections)}")
        for key, value in values.items():
            name = key.replace("-", "_")
            o = by_section[table].get(name)
            if o is None:
                home = [x for x in options if x.flat == name or (x.name == name and x.section != table)]
                where = ""
                if home:
                    where = f"; {key!r} belongs in [{home[0].section}]"
                    where += f" (as {home[0].name})" if home[0].name != name else ""
                raise SpecError(f"{source}: unknown key {key!r} in [{table}]{where}; see "
                                "`aqsgd train --help`")
            flat[o.flat] = value  # unique: TOML refuses a key twice in a table, and tables map to sections
    return flat


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of the TOML file of ``--config``; a missing file or bad TOML is a one-line error."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"--config: no such file {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"--config {p}: {e}") from None
