"""Logging set-up shared by the command line and the stage processes it starts, a prefix that tells the log
lines of interleaved processes apart, and progress lines for long work."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator

__all__ = ["configure", "prefixed", "ProgressLog"]


def configure(level: int = logging.INFO,
              fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Log to stderr at ``level`` in format ``fmt`` (``logging.basicConfig``: nothing changes where the root
    logger has a handler already).

    huggingface_hub gives its logger a stderr handler of its own and still propagates its records to the
    root logger, so with a root handler each of its warnings (a failed download's retries, say) would print
    twice: its records stay with its own handler."""
    logging.basicConfig(level=level, format=fmt)
    logging.getLogger("huggingface_hub").propagate = False


class _Prefixed(logging.Formatter):
    """A handler's formatter with ``prefix`` put before every message (on a copy of the record: other handlers
    see it unchanged)."""

    def __init__(self, inner: logging.Formatter, prefix: str) -> None:
        super().__init__()
        self.inner, self.prefix = inner, prefix

    def format(self, record: logging.LogRecord) -> str:
        record = copy.copy(record)
        record.msg, record.args = f"{self.prefix} {record.getMessage()}", None
        return self.inner.format(record)


@contextlib.contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Within the block, every message that reaches the root logger's handlers starts with ``prefix`` (a
    stage process's ``[stage 1/4 replica 0]``), whatever their format: the formatter of each handler is
    wrapped, and restored at the end. A prefix inside another replaces it; handlers added within the block
    and loggers that do not propagate to the root (huggingface_hub's) are left as they are."""
    handlers = list(logging.getLogger().handlers)
    saved = [h.formatter for h in handlers]
    for h, formatter in zip(handlers, saved):
        inner = formatter.inner if isinstance(formatter, _Prefixed) else formatter
        h.setFormatter(_Prefixed(inner or logging.Formatter(), prefix))
    try:
        yield
    finally:
        for h, formatter in zip(handlers, saved):
            h.setFormatter(formatter)


class ProgressLog:
    """Progress of long work as log lines, at most one every ``every_s`` seconds: ``reading --train-file
    big.txt: 512 of 2,048 MB (25%)``. Work that ends within ``every_s`` logs nothing. ``total`` (None:
    unknown) and the values given to :meth:`update` count in ``unit``."""

    def __init__(self, logger: logging.Logger, what: str, *, total: float | None = None, unit: str = "",
                 every_s: float = 5.0) -> None:
        self.logger, self.what, self.total, self.unit, self.every_s = logger, what, total, unit, every_s
        self._next = time.monotonic() + every_s

    def update(self, done: float) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            self.logger.info("%s: %s of %s%s (%.0f%%)", self.what, f"{done:,.0f}", f"{self.total:,.0f}", unit,
                             100.0 * done / self.total)
        else:
            self.logger.info("%s: %s%s", self.what, f"{done:,.0f}", unit)
