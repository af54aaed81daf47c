"""Stopping on SIGINT (Ctrl-C) and SIGTERM: one line and the conventional exit status, never a traceback.

:func:`stop_on_signals` makes either signal raise :class:`~aqsgd.errors.Interrupted` in the main thread, a
:class:`KeyboardInterrupt` (as Python's own Ctrl-C is) that carries the signal: ordinary error handlers let it
pass, ``finally`` blocks run (run-directory locks are released, a half-written checkpoint stays a ``.tmp``
folder that is never loaded), and whoever knows where the run stands adds it to the message (the trainer: the
step and the checkpoint that continues it). ``aqsgd`` prints that one line and exits with 128 + the signal's
number (130 for SIGINT, 143 for SIGTERM).

A second signal while the first is being handled either ends the process at once (``again="exit"``: an
impatient Ctrl-C on the command line) or is ignored (``again="ignore"``: a stage process, whose launcher
forwards the signal it got itself, and escalates to SIGKILL if the stage does not end in time).

Work that must not be cut in half runs under :func:`signals_held`: a signal that arrives within it is raised
when the block ends (a checkpoint being written is finished and published first; an exception raised inside
a file writer would otherwise surface as the writer's own error, not as the interruption).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from aqsgd.errors import Interrupted

__all__ = ["stop_on_signals", "signals_held", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Held:
    """Whether the main thread is in a :func:`signals_held` block, and the signal held back meanwhile."""

    depth = 0
    pending: int | None = None


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within the block, a stop signal caught by :func:`stop_on_signals` is held back; it raises
    :class:`~aqsgd.errors.Interrupted` when the (outermost) block ends, unless the block raised an error of
    its own. A second signal is handled at once, as ``stop_on_signals`` says (an impatient Ctrl-C still
    ends the process). Outside the main thread the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
    if _Held.depth == 0 and _Held.pending is not None:
        signum, _Held.pending = _Held.pending, None
        raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals(*, again: str = "exit") -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`~aqsgd.errors.Interrupted` in the main thread;
    ``again``: what a later signal does (``exit`` at once with 128 + its number, or ``ignore`` it). The
    previous handlers come back when the block ends, however it ends (also where installing them failed
    part-way). Outside the main thread (where Python cannot install handlers) the block runs unchanged."""
    if again not in ("exit", "ignore"):
        raise ValueError(f"again must be 'exit' or 'ignore', got {again!r}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    fired = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if fired.is_set():
            if again == "exit":
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(128 + signum)
            return
        fired.set()
        if _Held.depth:
            _Held.pending = signum
            return
        raise Interrupted(signum)

    try:
        for s in STOP_SIGNALS:  # (within the try: one that cannot be installed puts back those that were)
            signal.signal(s, handler)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
