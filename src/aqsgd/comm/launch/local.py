"""Start N local processes through PyTorch's elastic launcher (the machinery behind ``torchrun``).

Ranks, world size and the rendezvous come from the launcher's environment, never hand-set; the rendezvous is a
c10d store on a loopback port. :func:`launch_local` returns the processes' values in rank order, or raises
:class:`~aqsgd.errors.StageFailedError`, whose message is one line naming the process at fault and why
(:mod:`aqsgd.comm.launch.forensics`).

Loopback only (or one address)
------------------------------
Nothing a local run opens listens beyond 127.0.0.1 (a ``TCPStore`` server otherwise listens on every
interface, and gloo on the address the host name resolves to). A launch given another ``host`` (a replica
pipeline that meets replicas on other machines: :mod:`aqsgd.parallel.elastic`) listens on that address alone,
in the same three places:

* the rendezvous store: :func:`launch_local` binds a socket to 127.0.0.1 and hands it to a multi-tenant
  ``TCPStore`` (``master_listen_fd``) before the launcher starts; the c10d rendezvous then opens its store
  on the same port, and a multi-tenant store reuses the server already running in the process;
* the workers' store (``MASTER_ADDR:MASTER_PORT``): the launcher's shared store would be a second server on
  every interface, so sharing it is turned off for the launch (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
  then rank 0 hosts the workers' store, multi-tenant (PyTorch's documented ``env://`` behaviour), and the
  stage entry opens it on a 127.0.0.1 socket first, which ``init_process_group`` reuses. ``MASTER_ADDR``
  is 127.0.0.1 (the launcher's ``local_addr``);
* gloo: ``GLOO_SOCKET_IFNAME`` is the loopback interface (the interface holding ``host``) in every process
  started here.

Each process runs ``fn`` inside a stage entry. An exception from ``fn`` is not re-raised there: the entry
writes a report (:func:`~aqsgd.comm.launch.forensics.failure_report`), leaves the process group (so that peers
blocked on it see the connection close) and returns a failure marker; at the end of the run such a process
exits without the interpreter's teardown (gloo aborts when its objects are destroyed under a blocked thread).
The process stays until the run ends, so the launcher does not stop the other processes at the first failure:
they get to report too, which finding the process at fault needs. A watchdog thread
(:mod:`aqsgd.comm.launch.watchdog`) ends the processes that can no longer report.

Threads: the processes share this machine's cores (:mod:`aqsgd.comm.launch.threads`). Each computes on
``max(1, cores // processes)`` threads (``threads``, the run's ``--threads``, or an ``OMP_NUM_THREADS`` set in
the environment instead), set in its environment (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
``NUMBA_NUM_THREADS``, where unset) and in PyTorch before ``fn`` runs; the launcher says so in one line.

SIGINT or SIGTERM to the launching process: PyTorch's launcher forwards the signal to every process, waits up
to 3 s for them to end (then SIGKILL), and :func:`launch_local` raises :class:`~aqsgd.errors.Interrupted`.
The launcher installs its signal handlers for the launch; they are put back as they were when it ends.

Where the details go: every process's outcome, the launcher's ``ChildFailedError`` and PyTorch's launcher log
are written to a file (``failure_log``, default a new ``RUN_ID-*-failure.log`` in the temp directory) whose
path ends the one-line message, and logged at DEBUG level on ``aqsgd.comm.launch`` (``aqsgd -v`` shows them).
During the launch the loggers of PyTorch's launcher (``torch.distributed.elastic``, ``torch.multiprocessing``)
go to that log instead of the terminal (at DEBUG level): on a failure they print the failed process's
traceback and one line per process they stop.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from aqsgd.comm.launch.forensics import UNGUARDED, failure_report, stage_failed
from aqsgd.comm.launch.rank import exit_without_finalizing, leave_process_group
from aqsgd.comm.launch.threads import apply_threads, thread_share
from aqsgd.comm.launch.watchdog import Watchdog
from aqsgd.errors import Interrupted

__all__ = ["LOOPBACK", "address_towards", "free_port", "interface_of", "launch_local"]

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_SHUTDOWN_S = 3  # SIGTERM-to-SIGKILL grace when the launcher is interrupted (LaunchConfig.shutdown_timeout)
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_KEEP_ALIVE: list[Any] = []  # the workers' store server that rank 0 opened: it lives as long as the process
_CTL_ENV = "AQSGD_LAUNCH_CTL"  # the launch's control directory, inherited by the processes it spawns
# the signals PyTorch's launcher may take over during a launch (TORCHELASTIC_SIGNALS_TO_HANDLE, whose default
# is the first four)
_LAUNCHER_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                                        "SIGUSR2") if hasattr(signal, n))


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, run_id: str | None = None,
                 rank_names: Callable[[int], str] | None = None, grace_s: float = 5.0,
                 failure_log: str | os.PathLike[str] | None = None, threads: int | None = None,
                 host: str = LOOPBACK) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned processes on this machine; their return values in rank order.

    ``fn`` must be a picklable module-level function that initializes ``torch.distributed`` from the
    environment. The processes are spawned and re-import the main module, so a script calls this under
    ``if __name__ == "__main__":`` (a call while a spawned process imports the script is refused, naming the
    fix). ``rank_names`` names a global rank in messages (e.g. ``stage 1``; default ``rank 1``, or the label a
    peer's ``PeerFailure`` gave it). ``grace_s``: after the first failure, how long the launcher
    waits without news from any process before it kills those that neither returned nor reported (a stopped
    process is not waited for; see the module docstring). ``failure_log``: where the details of a failure are
    written (default: a new file in the temp directory). ``threads``: the threads each process computes with
    (default: its share of this machine's cores, or ``OMP_NUM_THREADS`` where set; see the module docstring).
    ``host``: the one address of this machine that the launch listens on (default 127.0.0.1; an IPv4 address
    of one of its interfaces).

    Raises :class:`~aqsgd.errors.StageFailedError` if any process fails, naming the process at fault, with
    that process's exit status (the ``exit_code`` of its exception, where it has one). Raises
    :class:`~aqsgd.errors.Interrupted` if this process got SIGINT or SIGTERM (PyTorch's launcher forwards it
    to every process and waits a few seconds for them to end), or if the process at fault was interrupted
    itself.
    """
    _refuse_nested_launch()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    share = thread_share(nprocs, threads=threads)
    log.info("%s", share.describe())
    run_id = run_id or f"aqsgd-{os.getpid()}"
    ctl = tempfile.mkdtemp(prefix=f"{run_id}-launch-")
    torch_log: list[str] = []
    try:
        try:
            rdzv_store, port = _store_on(host, 0)
        except Exception as e:  # noqa: BLE001 - an old torch without master_listen_fd: torch opens its own store
            log.debug("could not open the rendezvous store on a socket of %s (%s); it listens on all "
                      "interfaces", host, e)
            rdzv_store, port = None, free_port(host)
        # shutdown_timeout is newer than the torch versions supported (2.12): older ones wait their own 30 s
        grace = {"shutdown_timeout": _SHUTDOWN_S} if "shutdown_timeout" in _fields(LaunchConfig) else {}
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=run_id,
                              rdzv_backend="c10d", rdzv_endpoint=f"{host}:{port}", local_addr=host,
                              max_restarts=0, monitor_interval=0.2, start_method="spawn",
                              logs_specs=DefaultLogsSpecs(log_dir=os.path.join(ctl, "torchelastic")), **grace)
        watchdog = Watchdog(ctl, nprocs, grace_s)
        out: dict[int, Any] = {}
        failure: ChildFailedError | None = None
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", _CTL_ENV: ctl, **share.child_environ(os.environ)}
        with _environ(**env), _torch_logs_to(torch_log), _signal_handlers_kept():
            watchdog.start()
            try:
                out = elastic_launch(config, _stage_entry)(ctl, fn, tuple(args), share.threads, host)
            except ChildFailedError as e:
                failure = e
            except SignalException as e:  # the launcher's handler: the processes got the signal and ended
                raise Interrupted(int(e.sigval)) from None
            finally:
                watchdog.stop()
        del rdzv_store
        if failure is None and len(out) == nprocs and all(ok for ok, _ in out.values()):
            return [out[r][1] for r in sorted(out)]
        raise stage_failed(ctl, nprocs, out, failure, watchdog, rank_names, torch_log, run_id, failure_log)
    finally:
        shutil.rmtree(ctl, ignore_errors=True)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def spawned_here() -> bool:
    """Whether this process is one that :func:`launch_local` spawned (it said the thread share already)."""
    return _CTL_ENV in os.environ


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
            _write(ctl, f"unguarded-{os.getpid()}", UNGUARDED)
    raise RuntimeError(UNGUARDED)


def _stage_entry(ctl: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 threads: int | None = None, host: str = LOOPBACK) -> tuple[bool, Any]:
    """One process: take its ``threads``, bind to ``host``, run ``fn``; on an exception write a report, leave
    the process group and return a failure marker (the process stays until the launcher ends the run: see the
    module docstring)."""
    apply_threads(threads)  # first: no parallel work has run in this process yet (the inter-op pool's size)
    rank = int(os.environ["RANK"])
    _bind_to(rank, host)
    _write(ctl, f"pid-{rank}", str(os.getpid()))
    try:
        value = fn(*args)
    except Interrupted as e:
        # SIGINT/SIGTERM: reported, then gone (the launcher forwards its own, then waits)
        _write(ctl, f"failed-{rank}.json", json.dumps(failure_report(rank, e)))
        _write(ctl, f"end-{rank}", "")
        exit_without_finalizing(e.exit_code)
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which names the process at fault
        _write(ctl, f"failed-{rank}.json", json.dumps(failure_report(rank, e)))
        try:
            leave_process_group(clean=False)
        except Exception:  # the report is written; peers will time out instead
            log.debug("rank %d: leaving the process group failed", rank, exc_info=True)
        _write(ctl, f"end-{rank}", "")
        atexit.register(exit_without_finalizing)
        return False, None
    _write(ctl, f"end-{rank}", "")
    return True, value


def _write(ctl: str, name: str, text: str) -> None:
    """Write ``ctl/name`` atomically (the launcher may read it at any moment, or the process be killed)."""
    tmp = os.path.join(ctl, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(ctl, name))


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _store_on(host: str, port: int) -> tuple[Any, int]:
    """A multi-tenant ``TCPStore`` server listening on ``host``:``port`` only (0: a free port), and its port.
    A store opened later in this process on the same port with ``multi_tenant=True`` reuses this server.

    The server takes a socket bound here (``master_listen_fd``). The libuv server (torch's default) takes one
    from torch 2.8 on; before, the legacy server does (it serves the libuv clients that reuse it alike)."""
    import torch.distributed as dist

    failure: Exception | None = None
    for libuv in (True, False):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(socket.SOMAXCONN)
            bound = int(sock.getsockname()[1])
        except BaseException:
            sock.close()
            raise
        fd = sock.detach()  # the store owns the descriptor from here on (it closes it)
        try:
            store = dist.TCPStore(host, bound, is_master=True, multi_tenant=True, master_listen_fd=fd,
                                  wait_for_workers=False, **({} if libuv else {"use_libuv": False}))
        except (RuntimeError, TypeError, ValueError) as e:
            with contextlib.suppress(OSError):
                os.close(fd)
            failure = e
            continue
        return store, bound
    assert failure is not None
    raise failure


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (``http://host:port``): the source address the
    kernel picks for it (a UDP socket's ``connect`` sends nothing). 127.0.0.1 for a loopback host."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in the address {url!r} (expected http://HOST:PORT)")
    try:
        info = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)
        family, addr = info[0][0], info[0][4]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise OSError(f"{url}: no route from this machine to its host ({e.strerror or e})") from None


def interface_of(host: str) -> str | None:
    """The name of the network interface holding the IPv4 address ``host`` (``lo`` for 127.0.0.1), or None."""
    import fcntl
    import struct

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    if host == LOOPBACK:
        return next((n for n in ("lo", "lo0") if n in names), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == host:
                return name
    return None


def _bind_to(rank: int, host: str) -> None:
    """In a process started by :func:`launch_local`: gloo on the interface holding ``host``, and on rank 0
    the workers' store opened on a socket of ``host`` before ``init_process_group`` opens it (module
    docstring)."""
    ifname = interface_of(host)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    if os.environ.get("MASTER_ADDR") != host or not os.environ.get("MASTER_PORT"):
        return
    try:
        _KEEP_ALIVE.append(_store_on(host, int(os.environ["MASTER_PORT"]))[0])
    except Exception as e:  # noqa: BLE001 - init_process_group opens the store itself then (on all interfaces)
        log.debug("could not open the workers' store on %s:%s (%s)", host, os.environ["MASTER_PORT"], e)


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


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The signal handlers of this process as they were before the block, after it: PyTorch's launcher
    installs its own (which raise its ``SignalException``) and leaves them installed, so a later SIGTERM or
    SIGINT to this process would be turned into that exception long after the launch."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread sets handlers)
        yield
        return
    saved = {s: signal.getsignal(s) for s in _LAUNCHER_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if signal.getsignal(s) is not handler:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


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
