"""Tokenizing in bounded pieces: memory in proportion to the tokens kept, not to a text's length.

A fast tokenizer holds the ``Encoding`` of every text it is given in one call (ids, offsets, type ids, masks,
word ids, the normalized text and its alignments): 60-140 bytes per character (eight 2 MB lines took 1 GB with
SmolLM2's tokenizer, a 45 MB line over 6 GB), for ids that take 4 bytes per token. Here:

* :func:`pieces`: a long document is tokenized as pieces of at most :data:`PIECE_CHARS` characters;
* :func:`leading`: of a text whose first ``n`` tokens alone are kept (truncated classification), only a
  beginning with more than ``n`` tokens is tokenized.

Both cut a text at a *seam*: a newline, or else a space, between two characters that are not whitespace,
where the tokenizer splits anyway. Each seam is checked before it is used: the tokens of the text on either
side of it (:data:`WINDOW` characters each way), joined, must equal the tokens of that stretch in one call. A
tokenizer that would join tokens across it fails the check (no pre-tokenizer splitting there, a prefix marker
added at the start of every text), the next candidate is tried, and a text without a seam that passes is
tokenized whole as before. What a tokenizer does at a place depends on the text near it (its pre-tokenizer's
words, the merges inside them), well within the window: the pieces give the tokens of the whole text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["BATCH_CHARS", "PIECE_CHARS", "WINDOW", "count", "encode", "id_dtype", "leading", "pieces", "seam"]

PIECE_CHARS = 1 << 16
"""The longest piece of a document tokenized in one call (64 Ki characters)."""
BATCH_CHARS = 1 << 18
"""The most characters of texts or pieces tokenized in one batched call (256 Ki characters: some tens of MB of
the tokenizer's intermediate results)."""
WINDOW = 512
"""Characters tokenized on each side of a seam to check that the tokenizer splits there."""
_TRIES = 3  # candidate seams of each kind checked before a stretch is given up on


def encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """The token ids of each text, without special tokens (one batched call)."""
    return tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]


def id_dtype(*largest: int | None) -> type[np.integer]:
    """The numpy type that holds ids up to the largest of ``largest``: int32 where it fits, int64 where one is
    unknown (None) or too large."""
    if any(v is None for v in largest) or max(largest) >= 2**31:  # type: ignore[type-var]
        return np.int64
    return np.int32


def pieces(text: str, tokenizer: Any, size: int | None = None) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` (default :data:`PIECE_CHARS`) characters, cut at
    seams where ``tokenizer`` splits (see the module docstring), whose tokens joined are the tokens of
    ``text``. Where no seam passes in the last half of a piece, the rest of ``text`` is one piece."""
    size = PIECE_CHARS if size is None else size
    start = 0
    while len(text) - start > size:
        cut = seam(text, tokenizer, start + max(size // 2, 1), start + size)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text


def leading(text: str, tokenizer: Any, more_than: int) -> tuple[str, int | None]:
    """A beginning of ``text`` cut at a seam whose tokens are the first tokens of ``text`` and number more
    than ``more_than``, and that number; ``(text, None)`` where there is none shorter than ``text``.

    The first try is ``16 * more_than`` characters (at least 1,024), then four times as many each time."""
    size = max(16 * more_than, 1024)
    while size < len(text):
        cut = seam(text, tokenizer, size // 2, size)
        if cut is not None:
            count = len(encode(tokenizer, [text[:cut]])[0])
            if count > more_than:
                return text[:cut], count
        size *= 4
    return text, None


def count(text: str, tokenizer: Any) -> int:
    """How many tokens ``text`` has (without special tokens), tokenized in pieces."""
    total = 0
    batch: list[str] = []
    chars = 0
    for piece in pieces(text, tokenizer):
        batch.append(piece)
        chars += len(piece)
        if chars >= BATCH_CHARS:
            total += sum(len(ids) for ids in encode(tokenizer, batch))
            batch, chars = [], 0
    if batch:
        total += sum(len(ids) for ids in encode(tokenizer, batch))
    return total


def seam(text: str, tokenizer: Any, lo: int, hi: int) -> int | None:
    """A position in ``[lo, hi)`` where ``text`` can be cut without changing its tokens, the last one there
    that passes the check: after a newline, else before a space, each between two characters that are not
    whitespace. None if none of the last few candidates of each kind passes."""
    lo = max(lo, 2)
    hi = min(hi, len(text) - 1)
    for mark, after in (("\n", 1), (" ", 0)):
        end, tries = hi, 0
        while tries < _TRIES:
            at = text.rfind(mark, lo, end)
            if at < 0:
                break
            end = at
            if text[at - 1].isspace() or text[at + 1].isspace():
                continue
            tries += 1
            if _splits_at(text, tokenizer, at + after):
                return at + after
    return None


def _splits_at(text: str, tokenizer: Any, cut: int) -> bool:
    """Whether the tokens of the text before and after ``cut`` (a window each way), joined, are the tokens of
    the window in one call."""
    left, right = text[max(0, cut - WINDOW):cut], text[cut:cut + WINDOW]
    a, b, both = encode(tokenizer, [left, right, left + right])
    return [*a, *b] == list(both)
