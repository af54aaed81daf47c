"""Probing the Hugging Face hub before a hub-backed task loads from it, so an offline machine fails fast.

:func:`_hub_datasets` returns the ``datasets`` module only when the hub is enabled, the package is
installed and the hub endpoint accepts a TCP connection within :data:`HUB_PROBE_TIMEOUT_S`; otherwise it
raises a :class:`~aqsgd.errors.DataSourceError` naming the offline task to use instead.
:func:`_hub_probe` is the same check for any subject (``--dataset NAME`` of the user's own data) and hint.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

from aqsgd.errors import DataSourceError

__all__ = ["HUB_PROBE_TIMEOUT_S"]

HUB_PROBE_TIMEOUT_S = 5.0
"""Seconds to wait for a TCP connection to the Hugging Face hub before declaring it unreachable."""

_TRUE = ("1", "true", "yes", "on")


def _hub_datasets(task: str, alternative: str) -> Any:
    """The ``datasets`` module if the hub can be used now; a DataSourceError otherwise (never hangs)."""
    hint = f"offline alternative: load_task({alternative!r}) (`--task {alternative}`)"
    return _hub_probe(f"task {task!r}", hint)


def _hub_probe(subject: str, hint: str) -> Any:
    """The ``datasets`` module if the hub can be used now, else a one-line DataSourceError.

    ``subject`` names what needs the hub (``task 'glue-cola'``, ``--dataset imdb``) and ``hint`` what to do
    instead; both go into the message.
    """
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            raise DataSourceError(f"{subject} loads from the Hugging Face hub, which {var} disables; {hint}")
    try:
        import datasets
    except ImportError:
        raise DataSourceError(f"{subject} needs the `datasets` package and the Hugging Face hub: run "
                              f"`pip install datasets`; {hint}") from None
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint:
        try:
            from huggingface_hub import constants

            endpoint = constants.ENDPOINT
        except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
            endpoint = None
    if endpoint:
        url = urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
                pass
        except OSError as e:
            raise DataSourceError(f"{subject} needs the Hugging Face hub, which is unreachable "
                                  f"({url.hostname}:{port}: {e}); {hint}") from None
    return datasets


def _hub_split(split: str, eval_name: str) -> str:
    return "train" if split == "train" else eval_name
