"""Argument types shared by subcommands, each raising argparse errors that name the bad value; and
:func:`plain_text`, which turns the reST of docstrings shown by ``--help`` into plain text."""

from __future__ import annotations

import argparse
import re


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be comma-separated integers, got {text!r}") from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"shape dims must be positive, got {text!r}")
    return shape


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


# :role:`text`, with an optional domain (:py:class:): Sphinx cross-references in docstrings
_ROLE = re.compile(r":(?:[A-Za-z]+:)?[A-Za-z]+:`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain_text(text: str | None) -> str | None:
    """``text`` (a docstring in reStructuredText) as plain text for the terminal: the help of a subcommand or
    an option is read there, not rendered by Sphinx. A cross-reference becomes the name it points to
    (``:class:`~a.b.C``` -> ``C``, ``:func:`a.b``` -> ``a.b``, ``:ref:`title <target>``` -> ``title``), an
    inline literal its text, and the ``::`` that opens a literal block a colon (``e.g.::`` -> ``e.g.:``); the
    indented block after it is left exactly as written."""
    if text is None:
        return None
    out: list[str] = []
    prose: list[str] = []
    block_indent: int | None = None  # the indent of the paragraph that opened the literal block being copied
    for line in text.split("\n"):
        if block_indent is not None:
            indent = len(line) - len(line.lstrip())
            if not line.strip() or indent > block_indent:
                out.append(line)
                continue
            block_indent = None
        stripped = line.rstrip()
        if stripped.endswith("::"):
            prose.append(_literal_block_marker(stripped))
            out.append(_inline(prose))
            prose = []
            block_indent = len(line) - len(line.lstrip())
        else:
            prose.append(line)
            if not line.strip():
                out.append(_inline(prose))
                prose = []
    if prose:
        out.append(_inline(prose))
    return "\n".join(out)


def _literal_block_marker(line: str) -> str:
    """The line that ends in ``::`` as reST shows it: ``text::`` -> ``text:``, ``text ::`` -> ``text``."""
    head = line[:-2]
    return head.rstrip() if not head or head[-1].isspace() else head + ":"


def _inline(lines: list[str]) -> str:
    """The lines of one paragraph with their roles and inline literals as plain text (a literal may span a
    line break)."""
    text = "\n".join(lines)
    text = _ROLE.sub(lambda m: _reference(m.group(1)), text)
    return _LITERAL.sub(r"\1", text)


def _reference(target: str) -> str:
    """What a cross-reference shows: its title (``title <target>``), the last name of a ``~``-target, or the
    target as written."""
    titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", target, re.DOTALL)
    if titled:
        return titled.group(1)
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target.lstrip("!")
