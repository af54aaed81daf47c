"""Logging set-up shared by the command line and the stage processes it starts."""

from __future__ import annotations

import logging


def configure(level: int = logging.INFO, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
    """Log to stderr at ``level`` in format ``fmt`` (``logging.basicConfig``: nothing changes where the root
    logger has a handler already).

    huggingface_hub gives its logger a stderr handler of its own and still propagates its records to the
    root logger, so with a root handler each of its warnings (a failed download's retries, say) would print
    twice: its records stay with its own handler."""
    logging.basicConfig(level=level, format=fmt)
    logging.getLogger("huggingface_hub").propagate = False
