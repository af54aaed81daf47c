"""Who is at fault when a launched run fails, and the one line and the details file that say so.

Failures: who is at fault
-------------------------
Each process runs ``fn`` inside a stage entry. An exception from ``fn`` is not re-raised there: the entry
writes a report (its rank, the time the exception left ``fn``, the exception's type, message and traceback,
and for :class:`~aqsgd.errors.PeerFailure`/:class:`~aqsgd.errors.PeerTimeout` the peer it names), leaves the
process group (so that peers blocked on it see the connection close) and returns a failure marker; at the end
of the run such a process exits without the interpreter's teardown (gloo aborts when its objects are destroyed
under a blocked thread). The process stays until the run ends, so the launcher does not stop the other
processes at the first failure: they get to report too, which the rule below needs. From the first failure
(a report, or a process that exited without one) a watchdog thread in the launcher waits until every process
has returned, exited or is *stopped* (SIGSTOP, or a tracer: a stopped process cannot report), or until
``grace_s`` pass without news (a report, a return or an exit; each one restarts the wait, so that processes
failing one after another all get to report); then it kills (SIGKILL: a stopped process does not act on
SIGTERM) each process that has neither returned nor reported. The elastic launcher sees it die and ends the
run at once, all the others being responsive. A frozen stage therefore costs nothing once every other stage
has reported; a stage that hangs without being stopped costs ``grace_s`` after the last news. When a thread of
a failed process is still blocked in gloo, its process group cannot be freed under it and its connections
stay open until the run ends: a peer blocked on it then fails at its own timeout, or is killed by the watchdog
(it is not at fault unless someone blames it).

The process at fault (:func:`find_root_cause`) is found by following blame, not by who exited first (the first
to fail is usually a healthy neighbour that timed out waiting for the culprit). A report blames the peers its
``PeerFailure``/``PeerTimeout`` names (the exception's ``rank``, else the ranks its message names); a
``torch.distributed`` communication error that names no peer (gloo's ``RuntimeError``: timed out, connection
closed) blames the processes that did not report (killed as unresponsive, or died); any other exception is an
error of the process's own. Start at the earliest report and, while the current process blames
peers, move to one it names that is not on the path yet (preferring one that did not report, then the earliest
reporter). Stop at a process that

* reported an error of its own: that error is the cause;
* did not report: it stopped responding (killed by the watchdog), crashed (exited, or died of a signal), or
  had returned while a peer still waited on it: that is the cause;
* was stopped by the launcher while it tore the run down after another process died: the cause is that
  other process (the launcher's first failure). So is a process whose report is an interruption (SIGTERM,
  SIGINT) while the launcher's first failure is another process that died without a report: that signal
  was the tear-down, sent before the process could report what it saw (a stage whose peer was killed).

If every peer named is already on the path (a cycle: typically two processes that each report losing the
other, the later report being a consequence of the earlier one's departure), the process at fault is the one
named by the earliest report. With no report at all it is the first process that exited.

A process that exits (a crash) is seen by the elastic launcher at its next poll (every 0.2 s), which then
stops the others at once: a peer that has not yet noticed the loss does not get to report. The process at
fault is still the one that exited, but without ``rank_names`` it may then be named by its rank, since its
label comes from the peers' reports.

Where the details go
--------------------
Every process's outcome (error, time, traceback; how a silent one ended), the launcher's
``ChildFailedError`` and PyTorch's launcher log are written to a file (``failure_log``, default a new
``RUN_ID-*-failure.log`` in the temp directory) whose path ends the one-line message, and logged at DEBUG
level on ``aqsgd.comm.launch`` (``aqsgd -v`` shows them). During the launch the loggers of PyTorch's launcher
(``torch.distributed.elastic``, ``torch.multiprocessing``) go to that log instead of the terminal (at DEBUG
level): on a failure they print the failed process's traceback and one line per process they stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from aqsgd.errors import Interrupted, PeerFailure, StageFailedError, signal_name

if TYPE_CHECKING:
    from aqsgd.comm.launch.watchdog import Watchdog

__all__ = ["RankOutcome", "RootCause", "find_root_cause", "failure_report", "stage_failed", "UNGUARDED"]

log = logging.getLogger(__name__)

# a torch.distributed RuntimeError (gloo) that says a connection was lost, without naming the peer
_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo")
UNGUARDED = ("launch_local was called again while a spawned process imported the main module: put the "
             "script's launch under `if __name__ == \"__main__\":` (every spawned process re-imports the "
             "script)")


def failure_report(rank: int, e: BaseException) -> dict[str, Any]:
    """What a process writes when its function failed: the exception, whom it blames, its exit status."""
    peer = e if isinstance(e, PeerFailure) else None
    comm = peer is None and isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _COMM_HINTS)
    return {"rank": rank, "pid": os.getpid(), "time": time.time(), "type": type(e).__name__,
            "message": str(e), "traceback": traceback.format_exc(), "peer_failure": peer is not None,
            "comm_error": comm, "peer_rank": peer.rank if peer is not None else None,
            "peer_label": peer.label if peer is not None else None,
            "exit_code": getattr(e, "exit_code", None),
            "signum": e.signum if isinstance(e, Interrupted) else None}


@dataclasses.dataclass
class RankOutcome:
    """How one process of a failed run ended.

    ``status``: ``ok`` (returned), ``error`` (reported an exception), ``hung`` (neither returned nor reported
    in time: killed by the launcher), ``exited`` (died without a report: ``detail`` says how), ``terminated``
    (stopped by the launcher while it tore the run down after another process died). ``blames``: the peers an
    ``error`` report names (a PeerFailure/PeerTimeout); empty for an error of the process's own."""

    rank: int
    status: str
    error_type: str | None = None
    message: str | None = None
    blames: tuple[int, ...] = ()
    time: float | None = None
    detail: str | None = None
    traceback: str | None = None
    exit_code: int | None = None  # of an ``error``: the exception's exit_code, where it has one
    # of an ``error`` that was an interruption (aqsgd.errors.Interrupted): its signal
    signum: int | None = None


@dataclasses.dataclass
class RootCause:
    """The process at fault (``rank``), the blame path that led there (``path[0]`` the earliest report,
    ``rank`` last), and whether the path ran into a cycle."""

    rank: int
    path: list[int]
    cycle: bool = False


def find_root_cause(outcomes: Mapping[int, RankOutcome], first_exit: int | None = None) -> RootCause:
    """The process at fault in a failed run (the rule is in the module docstring). ``first_exit``: the first
    process the launcher saw die (its ``ChildFailedError``), if any."""
    reports = sorted((o for o in outcomes.values() if o.status == "error"),
                     key=lambda o: (math.inf if o.time is None else o.time, o.rank))
    if not reports:
        if first_exit is not None and first_exit in outcomes:
            return RootCause(first_exit, [first_exit])
        for status in ("exited", "hung", "terminated"):
            ranks = sorted(r for r, o in outcomes.items() if o.status == status)
            if ranks:
                return RootCause(ranks[0], [ranks[0]])
        rank = min(outcomes)
        return RootCause(rank, [rank])
    path = [reports[0].rank]
    while True:
        cur = outcomes[path[-1]]
        if cur.status != "error" or not cur.blames:
            break
        named = [r for r in cur.blames if r in outcomes and r not in path]
        if not named:
            if len(path) > 1:  # a cycle: the process named by the earliest report
                return RootCause(path[1], path[:2], cycle=True)
            break
        named.sort(key=lambda r: (outcomes[r].status == "error",
                                  math.inf if outcomes[r].time is None else outcomes[r].time, r))
        path.append(named[0])
    if outcomes[path[-1]].status == "terminated" and first_exit is not None and first_exit not in path:
        path.append(first_exit)
    elif (outcomes[path[-1]].signum is not None and first_exit is not None and first_exit not in path
          and first_exit in outcomes and outcomes[first_exit].status in ("exited", "hung")):
        # interrupted by the tear-down that another process's death started, before it could report it
        return RootCause(first_exit, [first_exit])
    return RootCause(path[-1], path)


def _first_line(text: str | None, limit: int = 300) -> str:
    lines = (text or "").strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _blames(report: Mapping[str, Any], nprocs: int, name: Callable[[int], str],
            silent: Collection[int] = ()) -> tuple[int, ...]:
    """The ranks a report's PeerFailure names: its ``rank``, else the ``(rank N)``s or the names in its
    message. A communication error naming no peer (gloo's RuntimeError) blames the ``silent`` processes."""
    if report.get("comm_error"):
        return tuple(r for r in sorted(silent) if r != report.get("rank"))
    if not report.get("peer_failure"):
        return ()
    if report.get("peer_rank") is not None:
        ranks = [int(report["peer_rank"])]
    else:
        message = str(report.get("message", ""))
        ranks = [int(m) for m in re.findall(r"\(rank (\d+)\)", message)]
        if not ranks:
            ranks = [r for r in range(nprocs) if re.search(rf"(?<!\w){re.escape(name(r))}(?!\w)", message)]
    return tuple(dict.fromkeys(r for r in ranks if 0 <= r < nprocs and r != report.get("rank")))


def _outcomes(ctl: str, nprocs: int, out: Mapping[int, Any], failure: Any, watchdog: Watchdog,
              name: Callable[[int], str]) -> dict[int, RankOutcome]:
    reports: dict[int, dict[str, Any]] = {}
    for r in range(nprocs):
        try:
            with open(os.path.join(ctl, f"failed-{r}.json")) as f:
                reports[r] = json.load(f)
        except (OSError, ValueError):
            pass
    agent_failures = failure.failures if failure is not None else {}
    silent = [r for r in range(nprocs) if r not in reports and (r in watchdog.killed or r in agent_failures)]
    outcomes = {}
    for r in range(nprocs):
        if r in reports:
            rep = reports[r]
            outcomes[r] = RankOutcome(r, "error", rep.get("type"), rep.get("message"),
                                      _blames(rep, nprocs, name, silent), rep.get("time"),
                                      traceback=rep.get("traceback"), exit_code=rep.get("exit_code"),
                                      signum=rep.get("signum"))
        elif r in watchdog.killed:
            k = watchdog.killed[r]
            how = ("its process was stopped (SIGSTOP) and was killed" if k["stopped"]
                   else "it neither returned nor reported, and was killed")
            outcomes[r] = RankOutcome(r, "hung", detail=f"{how} {k['after_s']:.1f} s after the first failure")
        elif (r in out and out[r][0]) or os.path.exists(os.path.join(ctl, f"end-{r}")):
            outcomes[r] = RankOutcome(r, "ok")
        elif r in agent_failures and os.path.exists(os.path.join(ctl, f"unguarded-{agent_failures[r].pid}")):
            outcomes[r] = RankOutcome(r, "error", "RuntimeError", UNGUARDED,
                                      time=agent_failures[r].timestamp or None)
        elif r in agent_failures:
            pf = agent_failures[r]
            how = (f"was killed by signal {pf.signal_name()}" if pf.exitcode is not None and pf.exitcode < 0
                   else f"exited with code {pf.exitcode}")
            outcomes[r] = RankOutcome(r, "exited", detail=how, time=pf.timestamp or None)
        else:
            outcomes[r] = RankOutcome(r, "terminated",
                                      detail="stopped by the launcher after another process died")
    return outcomes


def _reason(cause: RootCause, outcomes: Mapping[int, RankOutcome], name: Callable[[int], str]) -> str:
    o = outcomes[cause.rank]
    blamer = outcomes[cause.path[-2]] if len(cause.path) > 1 else None
    said = (f"{name(blamer.rank)} reported {blamer.error_type}: {_first_line(blamer.message, 200)}"
            if blamer is not None and blamer.status == "error" else None)
    if o.status == "error":
        own = f"{o.error_type}: {_first_line(o.message)}"
        return f"{said} (its own report came later: {own})" if cause.cycle and said else own
    if o.status == "hung":
        text = f"stopped responding: {o.detail}"
    elif o.status == "exited":
        text = f"{o.detail} without reporting an error"
    elif o.status == "ok":
        text = "had returned while a peer still waited on it"
    else:
        text = o.detail or "ended without a report"
    return f"{text}; {said}" if said else text


def _details(cause: RootCause, outcomes: Mapping[int, RankOutcome], name: Callable[[int], str], message: str,
             failure: Any, torch_log: list[str]) -> str:
    t0 = min((o.time for o in outcomes.values() if o.time is not None), default=None)
    lines = [f"distributed run failed: {message}", "",
             "process at fault: " + " -> ".join(f"{name(r)} (rank {r})" for r in cause.path)
             + (" (a cycle: the process named by the earliest report)" if cause.cycle else ""),
             ("(rule: follow the peers that PeerFailure/PeerTimeout reports name, from the earliest report, "
              "to a process with an error of its own or without a report; see aqsgd.comm.launch)"), ""]
    for r in sorted(outcomes):
        o = outcomes[r]
        head = f"== {name(r)} (rank {r}): {o.status}"
        if o.status == "error":
            when = f" at +{o.time - t0:.2f} s" if o.time is not None and t0 is not None else ""
            blame = f", blames {', '.join(map(name, o.blames))}" if o.blames else ", an error of its own"
            head += f"{when}{blame}: {o.error_type}: {_first_line(o.message, 1000)}"
        elif o.detail:
            head += f": {o.detail}"
        lines.append(head)
        if o.traceback:
            lines.append(o.traceback.rstrip())
        lines.append("")
    if failure is not None:
        lines += ["== the elastic launcher's ChildFailedError", str(failure).rstrip(), ""]
    if torch_log:
        lines += ["== PyTorch launcher log", *torch_log, ""]
    return "\n".join(lines)


def stage_failed(ctl: str, nprocs: int, out: Mapping[int, Any], failure: Any, watchdog: Watchdog,
                  rank_names: Callable[[int], str] | None, torch_log: list[str], run_id: str,
                  failure_log: str | os.PathLike[str] | None) -> StageFailedError | Interrupted:
    learned: dict[int, str] = {}
    for r in range(nprocs):
        try:
            with open(os.path.join(ctl, f"failed-{r}.json")) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            continue
        if rep.get("peer_rank") is not None and rep.get("peer_label"):
            learned.setdefault(int(rep["peer_rank"]), str(rep["peer_label"]))

    def name(rank: int) -> str:
        if rank_names is not None:
            with contextlib.suppress(Exception):
                return str(rank_names(rank))
        return learned.get(rank, f"rank {rank}")

    outcomes = _outcomes(ctl, nprocs, out, failure, watchdog, name)
    first_exit = failure.get_first_failure()[0] if failure is not None and failure.failures else None
    cause = find_root_cause(outcomes, first_exit)
    signum = outcomes[cause.rank].signum
    if signum is not None:  # a process was stopped by a signal of its own (a SIGTERM to one stage)
        return Interrupted(int(signum), f"{name(cause.rank)} was interrupted ({signal_name(int(signum))})")
    reason = _reason(cause, outcomes, name)
    label = name(cause.rank)
    head = f"{label} failed: {reason}"
    path: str | None = None
    try:
        if failure_log is not None:
            path = os.fspath(failure_log)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        else:
            fd, path = tempfile.mkstemp(prefix=f"{run_id}-", suffix="-failure.log")
            os.close(fd)
        details = _details(cause, outcomes, name, head, failure, torch_log)
        with open(path, "w") as f:
            f.write(details + "\n")
    except OSError as e:
        details = _details(cause, outcomes, name, head, failure, torch_log)
        log.warning("could not write the failure details to %s: %s", path, e)
        path = None
    log.debug("%s", details)
    message = f"{head} (details: {path})" if path else f"{head} (details: run with -v)"
    return StageFailedError(message, rank=cause.rank, label=label, reason=reason, log_path=path,
                            exit_code=outcomes[cause.rank].exit_code)
