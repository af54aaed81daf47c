"""Start N local processes through PyTorch's elastic launcher (the machinery behind ``torchrun``).

Ranks, world size and the rendezvous come from the launcher's environment, never hand-set; the rendezvous is a
c10d store on a loopback port. :func:`launch_local` returns the processes' values in rank order, or raises
:class:`~aqsgd.errors.StageFailedError`, whose message is one line naming the process at fault and why.

Loopback only
-------------
Nothing a local run opens listens beyond 127.0.0.1 (a ``TCPStore`` server otherwise listens on every
interface, and gloo on the address the host name resolves to):

* the rendezvous store: :func:`launch_local` binds a socket to 127.0.0.1 and hands it to a multi-tenant
  ``TCPStore`` (``master_listen_fd``) before the launcher starts; the c10d rendezvous then opens its store
  on the same port, and a multi-tenant store reuses the server already running in the process;
* the workers' store (``MASTER_ADDR:MASTER_PORT``): the launcher's shared store would be a second server on
  every interface, so sharing it is turned off for the launch (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
  then rank 0 hosts the workers' store, multi-tenant (PyTorch's documented ``env://`` behaviour), and the
  stage entry opens it on a 127.0.0.1 socket first, which ``init_process_group`` reuses. ``MASTER_ADDR``
  is 127.0.0.1 (the launcher's ``local_addr``);
* gloo: ``GLOO_SOCKET_IFNAME`` is the loopback interface in every process started here.

Runs under ``torchrun`` (across machines) do not go through :func:`launch_local` and are unchanged.

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
  other process (the launcher's first failure).

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

import atexit
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from aqsgd.errors import Interrupted, PeerFailure, StageFailedError, signal_name

__all__ = ["LOOPBACK", "RankOutcome", "RootCause", "find_root_cause", "free_port", "launch_local",
           "leave_process_group"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_SHUTDOWN_S = 3  # SIGTERM-to-SIGKILL grace when the launcher is interrupted (LaunchConfig.shutdown_timeout)
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_STOPPED = ("T", "t")  # /proc/PID/stat states of a stopped process (SIGSTOP, or stopped by a tracer)
# a torch.distributed RuntimeError (gloo) that says a connection was lost, without naming the peer
_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo")
_KEEP_ALIVE: list[Any] = []  # the workers' store server that rank 0 opened: it lives as long as the process
_CTL_ENV = "AQSGD_LAUNCH_CTL"  # the launch's control directory, inherited by the processes it spawns
_UNGUARDED = ("launch_local was called again while a spawned process imported the main module: put the "
              "script's launch under `if __name__ == \"__main__\":` (every spawned process re-imports the script)")


# ---------------------------------------------------------------------------------------------- launching
def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, run_id: str | None = None,
                 rank_names: Callable[[int], str] | None = None, grace_s: float = 5.0,
                 failure_log: str | os.PathLike[str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned processes on this machine; their return values in rank order.

    ``fn`` must be a picklable module-level function that initializes ``torch.distributed`` from the
    environment. The processes are spawned and re-import the main module, so a script calls this under
    ``if __name__ == "__main__":`` (a call while a spawned process imports the script is refused, naming the
    fix). ``rank_names`` names a global rank in messages (e.g. ``stage 1``; default ``rank 1``, or the label a
    peer's ``PeerFailure`` gave it). ``grace_s``: after the first failure, how long the launcher
    waits without news from any process before it kills those that neither returned nor reported (a stopped
    process is not waited for; see the module docstring). ``failure_log``: where the details of a failure are
    written (default: a new file in the temp directory).

    Raises :class:`~aqsgd.errors.StageFailedError` if any process fails, naming the process at fault, with
    that process's exit status (the ``exit_code`` of its exception, where it has one). Raises
    :class:`~aqsgd.errors.Interrupted` if this process got SIGINT or SIGTERM (PyTorch's launcher forwards it to
    every process and waits a few seconds for them to end), or if the process at fault was interrupted itself.
    """
    _refuse_nested_launch()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = run_id or f"aqsgd-{os.getpid()}"
    ctl = tempfile.mkdtemp(prefix=f"{run_id}-launch-")
    torch_log: list[str] = []
    try:
        try:
            rdzv_store, port = _loopback_store(0)
        except Exception as e:  # noqa: BLE001 - an old torch without master_listen_fd: torch opens its own store
            log.debug("could not open the rendezvous store on a loopback socket (%s); it listens on all "
                      "interfaces", e)
            rdzv_store, port = None, free_port()
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=run_id,
                              rdzv_backend="c10d", rdzv_endpoint=f"{LOOPBACK}:{port}", local_addr=LOOPBACK,
                              max_restarts=0, monitor_interval=0.2, start_method="spawn",
                              logs_specs=DefaultLogsSpecs(log_dir=os.path.join(ctl, "torchelastic")),
                              shutdown_timeout=_SHUTDOWN_S)
        watchdog = _Watchdog(ctl, nprocs, grace_s)
        out: dict[int, Any] = {}
        failure: ChildFailedError | None = None
        with _environ(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **{_CTL_ENV: ctl}), _torch_logs_to(torch_log):
            watchdog.start()
            try:
                out = elastic_launch(config, _stage_entry)(ctl, fn, tuple(args))
            except ChildFailedError as e:
                failure = e
            except SignalException as e:  # the launcher's handler: the processes got the signal and ended
                raise Interrupted(int(e.sigval)) from None
            finally:
                watchdog.stop()
        del rdzv_store
        if failure is None and len(out) == nprocs and all(ok for ok, _ in out.values()):
            return [out[r][1] for r in sorted(out)]
        raise _stage_failed(ctl, nprocs, out, failure, watchdog, rank_names, torch_log, run_id, failure_log)
    finally:
        shutil.rmtree(ctl, ignore_errors=True)


def _refuse_nested_launch() -> None:
    """Raise if this is a process spawned by :func:`launch_local` importing the main module: a script that
    launches at import time without a ``__main__`` guard would otherwise start a launch in every process,
    which dies without a report. The process leaves a note the launcher reads (its rank is not known yet,
    so the note is named by its pid). ``_inheriting`` is the flag multiprocessing itself sets while a spawned
    process imports the parent's main module, and checks before starting a process."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    ctl = os.environ.get(_CTL_ENV)
    if ctl and os.path.isdir(ctl):
        with contextlib.suppress(OSError):
            _write(ctl, f"unguarded-{os.getpid()}", _UNGUARDED)
    raise RuntimeError(_UNGUARDED)


def _stage_entry(ctl: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """One process: bind to loopback, run ``fn``; on an exception write a report, leave the process group and
    return a failure marker (the process stays until the launcher ends the run: see the module docstring)."""
    rank = int(os.environ["RANK"])
    _bind_to_loopback(rank)
    _write(ctl, f"pid-{rank}", str(os.getpid()))
    try:
        value = fn(*args)
    except (Exception, Interrupted) as e:  # noqa: BLE001 - reported to the launcher, which names the process at fault
        _write(ctl, f"failed-{rank}.json", json.dumps(_report(rank, e)))
        try:
            leave_process_group(clean=False)
        except Exception:  # the report is written; peers will time out instead
            log.debug("rank %d: leaving the process group failed", rank, exc_info=True)
        _write(ctl, f"end-{rank}", "")
        atexit.register(_exit_without_finalizing)
        return False, None
    _write(ctl, f"end-{rank}", "")
    return True, value


def _exit_without_finalizing() -> None:
    """End a process whose ``fn`` failed without running the interpreter's and C++'s teardown: a transport
    thread may still be blocked inside gloo, and destroying gloo's objects under it aborts the process
    ("terminate called without an active exception", a fatal-error dump on stderr). The failure is already
    reported and the return value handed to the launcher (a ``SimpleQueue``: written synchronously), so there
    is nothing left to do. Registered with ``atexit`` by the failure path only."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _report(rank: int, e: BaseException) -> dict[str, Any]:
    peer = e if isinstance(e, PeerFailure) else None
    comm = peer is None and isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _COMM_HINTS)
    return {"rank": rank, "pid": os.getpid(), "time": time.time(), "type": type(e).__name__,
            "message": str(e), "traceback": traceback.format_exc(), "peer_failure": peer is not None,
            "comm_error": comm, "peer_rank": peer.rank if peer is not None else None,
            "peer_label": peer.label if peer is not None else None,
            "exit_code": getattr(e, "exit_code", None),
            "signum": e.signum if isinstance(e, Interrupted) else None}


def _write(ctl: str, name: str, text: str) -> None:
    """Write ``ctl/name`` atomically (the launcher may read it at any moment, or the process be killed)."""
    tmp = os.path.join(ctl, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(ctl, name))


# ---------------------------------------------------------------------------------------------- loopback
def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _loopback_store(port: int) -> tuple[Any, int]:
    """A multi-tenant ``TCPStore`` server listening on 127.0.0.1:``port`` only (0: a free port), and its port.
    A store opened later in this process on the same port with ``multi_tenant=True`` reuses this server."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on (it closes it)
    try:
        store = dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=fd,
                              wait_for_workers=False)
    except BaseException:
        os.close(fd)
        raise
    return store, port


def _loopback_interface() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _bind_to_loopback(rank: int) -> None:
    """In a process started by :func:`launch_local`: gloo on the loopback interface, and on rank 0 the
    workers' store opened on a loopback socket before ``init_process_group`` opens it (module docstring)."""
    ifname = _loopback_interface()
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    if os.environ.get("MASTER_ADDR") != LOOPBACK or not os.environ.get("MASTER_PORT"):
        return
    try:
        _KEEP_ALIVE.append(_loopback_store(int(os.environ["MASTER_PORT"]))[0])
    except Exception as e:  # noqa: BLE001 - init_process_group opens the store itself then (on all interfaces)
        log.debug("could not open the workers' store on %s:%s (%s)", LOOPBACK, os.environ["MASTER_PORT"], e)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Capture(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - a log record must never break the launch
            return
        self.lines.append(text)
        log.debug("[torch] %s", text)


@contextlib.contextmanager
def _torch_logs_to(lines: list[str]) -> Iterator[None]:
    """Route PyTorch's launcher loggers to ``lines`` (and DEBUG on this module's logger) during the launch."""
    handler = _Capture(lines)
    saved = []
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate


# ---------------------------------------------------------------------------------------------- watchdog
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


class _Watchdog(threading.Thread):
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


# ---------------------------------------------------------------------------------------------- root cause
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
    signum: int | None = None  # of an ``error`` that was an interruption (aqsgd.errors.Interrupted): its signal


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


def _outcomes(ctl: str, nprocs: int, out: Mapping[int, Any], failure: Any, watchdog: _Watchdog,
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
            outcomes[r] = RankOutcome(r, "error", "RuntimeError", _UNGUARDED, time=agent_failures[r].timestamp or None)
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


def _stage_failed(ctl: str, nprocs: int, out: Mapping[int, Any], failure: Any, watchdog: _Watchdog,
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


# ---------------------------------------------------------------------------------------------- leaving
def leave_process_group(*, clean: bool, timeout_s: float = 60.0) -> None:
    """Destroy this process's ``torch.distributed`` groups at the end of a job.

    After a clean finish (``clean=True``) every rank first meets the others at a barrier, so that no process
    closes its connections while a peer still has messages in flight to it or from it: a socket closed with
    unread data in it is reset, and a peer reset in the middle of gloo's own teardown can abort (seen as
    "terminate called without an active exception" on slow, lossy links). With gloo the barrier is
    ``monitored_barrier``, whose error names the ranks that did not arrive within ``timeout_s``. After a
    failure there is no collective at all: peers may be gone, and waiting for them would hang."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if clean:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - the job's work is done; leave anyway, and say why it was not clean
            log.warning("rank %d: the closing barrier failed (%s); leaving without it", dist.get_rank(),
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    dist.destroy_process_group()
