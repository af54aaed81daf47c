"""The launcher's watchdog: after the first failure, end the processes that can no longer report.

From the first failure (a report, or a process that exited without one) it waits until every process has
returned, exited or is *stopped* (SIGSTOP, or a tracer: a stopped process cannot report), or until ``grace_s``
pass without news (a report, a return or an exit; each one restarts the wait, so that processes failing one
after another all get to report); then it kills (SIGKILL: a stopped process does not act on SIGTERM) each
process that has neither returned nor reported, and records it for :mod:`aqsgd.comm.launch.forensics`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)

_STOPPED = ("T", "t")  # /proc/PID/stat states of a stopped process (SIGSTOP, or stopped by a tracer)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


class Watchdog(threading.Thread):
    """After the first failure, kill the processes that neither return nor report once no process has
    returned, reported or exited for ``grace_s``, or at once if all of them are stopped (module docstring).

    ``killed`` maps a rank to ``{"after_s": seconds after the first failure, "stopped": was it stopped}``."""

    def __init__(self, ctl: str, nprocs: int, grace_s: float, poll_s: float = 0.1) -> None:
        super().__init__(name="aqsgd-launch-watchdog", daemon=True)
        self.ctl, self.nprocs, self.grace_s, self.poll_s = ctl, nprocs, grace_s, poll_s
        self.first_failure: float | None = None
        self._heard, self._last_news = 0, 0.0
        self.killed: dict[int, dict[str, Any]] = {}
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5.0)

    def run(self) -> None:
        if not os.path.isdir("/proc/self"):
            return  # no /proc: nothing to watch with; the elastic launcher's own shutdown applies
        while not self._stop_event.wait(self.poll_s):
            try:
                if self._check():
                    return
            except Exception:  # the watchdog must not take the launcher down
                log.debug("launch watchdog", exc_info=True)

    def _check(self) -> bool:
        files = set(os.listdir(self.ctl))
        pids: dict[int, int] = {}
        for r in range(self.nprocs):
            if f"pid-{r}" in files:
                with open(os.path.join(self.ctl, f"pid-{r}")) as f:
                    pids[r] = int(f.read())
        ended = {r for r in range(self.nprocs) if f"end-{r}" in files}
        reported = {r for r in range(self.nprocs) if f"failed-{r}.json" in files}
        stats = {r: _proc_stat(pid) for r, pid in pids.items()}
        exited = {r for r, st in stats.items() if r not in ended and (st is None or st[0] in ("Z", "X"))}
        now = time.monotonic()
        if self.first_failure is None:
            if not reported and not exited:
                return False
            self.first_failure = now
        heard = len(reported | ended | exited)
        if heard > self._heard:  # news from a process: the others get grace_s more
            self._heard, self._last_news = heard, now
        pending = [r for r in range(self.nprocs) if r not in ended and r not in exited]
        stopped = {r for r in pending if stats.get(r) is not None and stats[r][0] in _STOPPED}
        if any(r not in stopped for r in pending) and now - self._last_news < self.grace_s:
            return False
        for r in pending:
            st = stats.get(r)
            if st is None or st[1] != os.getpid():  # not started yet, or no (longer a) child of this process
                continue
            self.killed[r] = {"after_s": now - self.first_failure, "stopped": r in stopped}
            log.debug("rank %d (pid %d) %s %.1f s after the first failure: killing it", r, pids[r],
                      "is stopped" if r in stopped else "has not reported", now - self.first_failure)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[r], signal.SIGKILL)
        return True
