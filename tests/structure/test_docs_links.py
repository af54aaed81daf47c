"""Every relative link of README.md and docs/*.md leads somewhere: the file (or folder) exists, and an
``#anchor`` names a heading of the target as GitHub renders it, or an explicit ``<a id=...>`` (or
``<a name=...>``).

GitHub's heading anchors: the heading's text lowercased, everything but letters, digits, spaces, ``-`` and
``_`` removed, each space made a ``-``; a heading whose anchor came before gets ``-1``, ``-2``...
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_EXPLICIT = re.compile(r"<a\s[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks (a ``# comment`` in a shell block is no
    heading, a ``](x)`` in an example no link)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading of this Markdown text (before any ``-N`` of a duplicate)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link (or image): its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)
    kept = [c for c in text.lower() if c in " -" or unicodedata.category(c)[0] in "LMN"
            or unicodedata.category(c) == "Pc"]
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a Markdown text: its headings' (with ``-1``, ``-2``... for repeats) and the explicit
    ones of ``<a id=...>`` / ``<a name=...>``."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2).strip())
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    out.update(_EXPLICIT.findall(text))
    return out


def links(text: str) -> list[str]:
    """The targets of the inline links, images and link definitions of a Markdown text, outside code."""
    prose = "\n".join(_prose_lines(text))
    prose = _CODE_SPAN.sub("", prose)
    found = _LINK.findall(prose)
    found += [m.group(1) for line in prose.splitlines() if (m := _DEFINITION.match(line))]
    return found


def broken_links(doc: Path) -> list[str]:
    """``target: why`` for each relative link of ``doc`` that leads nowhere."""
    bad = []
    for target in links(doc.read_text(encoding="utf-8")):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:): not checked here
        path, _, anchor = target.partition("#")
        dest = (doc.parent / unquote(path)).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file {os.path.relpath(dest, REPO)}")
        elif anchor and dest.is_file() and dest.suffix == ".md":
            if unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{target}: no heading or anchor #{anchor} in {os.path.relpath(dest, REPO)}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(doc):
    assert broken_links(doc) == []


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Across machines (torchrun)", "across-machines-torchrun"),
    ("The warm-up, compressed: `--warmup-codec`", "the-warm-up-compressed---warmup-codec"),
    ("vs `torch.distributed.pipelining`", "vs-torchdistributedpipelining"),
    ("LoRA: AQ-SGD with adapters (`--study lora`)", "lora-aq-sgd-with-adapters---study-lora"),
    ("All traffic compressed: pipeline + data parallel", "all-traffic-compressed-pipeline--data-parallel"),
    ("snake_case [and a link](x.md) — ünïcode", "snake_case-and-a-link--ünïcode"),
])
def test_heading_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Results\n\n## Results\n\n<a id=\"kept\"></a>\n\n"
                                       "```sh\n# Fenced\n```\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#results) [b](other.md#results-1) [c](other.md#kept) [d](https://x.org/#y)\n"
                   "[e](other.md#results-2) [f](missing.md) [g](other.md#fenced) [h](#here)\n\n## Here\n"
                   "`[code](nowhere.md)`\n")
    assert [b.split(":")[0] for b in broken_links(doc)] == ["other.md#results-2", "missing.md",
                                                           "other.md#fenced"]
