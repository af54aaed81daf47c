"""Real slow links: stage processes in Linux network namespaces joined by shaped veth links.

``aqsgd bench pipeline`` emulates links inside the transport (a pacer per directed link). This module runs
the same jobs over *real* TCP links instead: every stage process lives in its own network namespace, the
namespaces are joined by veth pairs, and each direction of each link is shaped with ``tc``. It needs root
and the ``ip``/``tc`` tools of iproute2 (and the kernel's veth, bridge and ``sch_tbf``); without them every
entry point raises :class:`NetemUnavailable` saying what is missing.

Topology: a chain
-----------------
Namespace ``i`` runs stage ``i``. Consecutive stages ``i`` and ``i+1`` are joined through a *wire*
namespace ``w<i>``: device ``east`` (address ``10.77.i.1``) in namespace ``i`` is a veth to ``wa`` in ``w<i>``, device
``west`` (``10.77.i.2``) in namespace ``i+1`` one to ``wb``, and ``w<i>`` joins ``wa`` and ``wb`` with a kernel bridge
(layer 2: both stages are on subnet ``10.77.i.0/24``). Every stage namespace forwards IPv4 and has routes to
every other link subnet through its left or right neighbour, so non-neighbours reach each other too (gloo
opens a TCP full mesh at start-up, and tied weights are all-reduced between the first and the last stage);
that traffic crosses the intermediate stages' shaped links, as it would on a real chain of hosts.

We chose a chain over a star (one veth per process into one switch) because it gives *one dedicated link
per pipeline boundary and direction*, exactly the model of the in-process emulation and of the ideal
speed-up in :mod:`aqsgd.bench.pipeline`: forward activations (``i -> i+1``) and backward gradients
(``i+1 -> i``) each get their own full-duplex line, shaped on the sending device's egress. In a star a
process has a single uplink shared by everything it sends (forward to ``i+1`` *and* backward to ``i-1``),
like a host's NIC, and per-boundary shaping needs per-destination classes and filters. The price of the
chain is that non-neighbour traffic is forwarded through (and shaped by) the stages in between.

Shaping
-------
Rate: a ``tbf`` root qdisc on the sending device (``east`` for ``i -> i+1``, ``west`` for ``i+1 -> i``). Its sizes
matter for accuracy: the *burst* is one millisecond at line rate (at least 4 KiB; a larger bucket lets short
messages leave faster than the line), and the queue *limit* is at least 100 ms at line rate (256 KiB
minimum) so that TCP's bursts are not tail-dropped (drops make TCP back off below the configured rate).
:meth:`NetemCluster.measure_goodput` checks the outcome with a TCP bulk transfer between two namespaces;
the benchmark records it per bandwidth and its ideal model uses it.

Delay, jitter, loss: the usual tool is ``netem`` (as the root qdisc with ``tbf`` as its child, so that
packets are delayed and dropped first and then leave at the token rate; netem's packet limit must then
hold every packet in flight during the delay). Kernels without ``sch_netem`` (common in VMs and
containers, including the one this was developed on: only ``tbf``, ``htb`` and ``pfifo`` and no tc
classifiers) cannot do that, so an impaired link's wire namespace instead takes its two ends off the bridge
and runs :mod:`aqsgd.bench.netem_wire`, a user-space forwarder that delays (uniform jitter, reordering like
netem), drops and forwards frames per direction; the ``tbf`` rate stays on the stages' devices. A link
whose two directions both lose 100% is simply taken off the bridge (a black hole, no forwarder). The
forwarder is a Python loop (tens of MB/s): fine for fault tests, not for bulk Gbit/s links, so the
benchmark keeps delay 0 unless asked (``--delay-ms`` then uses the forwarder).

Processes
---------
:meth:`NetemCluster.run_job` starts ``python -m aqsgd.train.job JOB.json --result ...`` in each namespace
(``ip netns exec``) with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``GLOO_SOCKET_IFNAME`` set,
waits for all of them within a deadline (killing the rest when it passes), and returns each stage's exit
code, its :class:`~aqsgd.train.job.JobResult` and, for a failed stage, the exception it ended with. A
``during`` callback runs while the job trains (fault injection: :meth:`NetemCluster.wait_for_traffic`,
:meth:`NetemCluster.shape`, :meth:`NetemJob.kill`). ``extra_args`` is passed to every stage's command line.
:meth:`NetemCluster.run_train` does the same for the real trainer: ``python -m aqsgd.cli train ARGS --runtime
distributed`` in each namespace, started the way torchrun starts it, with checkpoints in a run directory
that all processes share, so that a run killed by a fault can be continued with ``--resume``.

Clean-up
--------
Namespace names are ``aqsgd-<pid>-<random>-<i>`` (stages) and ``aqsgd-<pid>-<random>-w<i>`` (wires). :class:`NetemCluster` kills its processes and deletes its
namespaces (which deletes their veths and qdiscs) on exit from the ``with`` block, on an exception, on
Ctrl-C and on SIGTERM (turned into ``SystemExit`` while the cluster is open), and from an ``atexit`` hook
as a last resort. :func:`cleanup_stale` deletes namespaces with our prefix whose creating process is gone
(it runs when a cluster is opened).

The benchmark (:func:`bench_netem`, ``aqsgd bench netem``)
----------------------------------------------------------
First a calibration run of fp32 at the top bandwidth measures the compute time per micro-batch ``c`` and
the fp32 message size; the sweep then goes down from the top bandwidth in steps of ``sqrt(10)`` to the
bandwidth where the fp32 link time per micro-batch is ``target_ratio`` (10) times ``c``. At each bandwidth
every setting runs ``runs`` times (fresh processes each time) with one uncompressed warm-up epoch (not
timed: AQ-SGD fills its cache there) and ``measure_steps`` timed steps; samples/s is the median over the
runs of each run's median-step throughput. Speed-ups, ideal speed-ups (``max(c, l)`` per micro-batch and
stage, :func:`aqsgd.bench.pipeline.summarize`), efficiency and the fp32 comm:compute ratio follow. The ideal
model uses the *measured* TCP goodput of the link (``link_mbps``), not the nominal rate, so that
efficiency measures how well the pipeline overlaps communication and compute rather than TCP/IP header
overhead; the nominal rate is reported next to it.

Data parallelism (``--data-parallel D``): the ``dp_settings`` also run on ``D`` replicas of the pipeline with
each gradient sync of ``grad_syncs`` (fp32 ``allreduce`` the baseline, ``q8``, ``powersgd:rank4``, ...).
The ``S x D`` processes lie along the one chain (:func:`snake_nodes`: replica 0 forwards, replica 1
backwards, ...), so every pipeline boundary keeps a dedicated link, the last stages of replicas 0 and 1
are neighbours, and the other stages' replicas reach each other through the chain, as on a real line of
hosts. Their syncs then share links: with 2 stages x 2 replicas the middle link carries both stages'
syncs, and the ideal model multiplies the sync time by that load (:func:`sync_link_load`). Speed-ups of
data-parallel rows are against the fp32 pipeline with the fp32 all-reduce at the same ``D``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import aqsgd
from aqsgd.bench.pipeline import _measure, summarize
from aqsgd.errors import AqsgdError
from aqsgd.parallel import parse_grad_sync
from aqsgd.train.job import JobConfig, JobResult, ensure_weights, tiny_lm_recipe

__all__ = [
    "NetemUnavailable",
    "NetemError",
    "LinkShape",
    "StageOutcome",
    "NetemJob",
    "NetemCluster",
    "Setting",
    "NETEM_SETTINGS",
    "NetemBenchConfig",
    "netem_unavailable_reason",
    "check_netem",
    "cleanup_stale",
    "bench_netem",
    "bandwidth_grid",
    "markdown_table",
    "write_json",
    "plot_speedups",
    "register_cli",
    "run_cli",
]

log = logging.getLogger(__name__)

PREFIX = "aqsgd-"
SUBNET = "10.77"
MASTER_PORT = 29500  # every run has its own namespaces, so a fixed port never collides
_NS_RE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-([0-9a-f]+)-(\d+)$")


class NetemUnavailable(AqsgdError, RuntimeError):
    """Network namespaces or ``tc`` shaping cannot be used here (not root, ``ip``/``tc`` missing, or the
    kernel refuses); the message says which and how to fix it."""


class NetemError(AqsgdError, RuntimeError):
    """An ``ip``/``tc`` command failed while building or shaping the namespaces (the message has its
    command line and stderr)."""


# --------------------------------------------------------------------------------------------------------
# availability


def _run_cmd(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


_availability: str | None | bool = False  # False: not probed yet; None: available; str: why not


def netem_unavailable_reason() -> str | None:
    """Why namespaces + tc shaping cannot be used here, or None when they can (probed once: creates and
    deletes a namespace with a veth pair, a bridge and a tbf qdisc)."""
    global _availability
    if _availability is not False:
        return _availability  # type: ignore[return-value]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "network namespaces and tc need root (run as root, e.g. with sudo)"
    else:
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            reason = f"{' and '.join(missing)} not found (install iproute2: apt-get install iproute2)"
    if reason is None:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
        try:
            _run_cmd(["ip", "netns", "add", name])
            try:
                _run_cmd(["ip", "-n", name, "link", "set", "dev", "lo", "up"])
                _run_cmd(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
                _run_cmd(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
                _run_cmd(["tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit",
                          "burst", "4096", "limit", "65536"])
            finally:
                _run_cmd(["ip", "netns", "del", name], check=False)
        except (NetemError, OSError, subprocess.TimeoutExpired) as e:
            reason = f"cannot create a shaped network namespace here: {e}"
    _availability = reason
    return reason


def check_netem() -> None:
    """Raise :class:`NetemUnavailable` unless namespaces and tc shaping work here."""
    reason = netem_unavailable_reason()
    if reason:
        raise NetemUnavailable(f"real-link benchmark/tests unavailable: {reason}")


def _list_namespaces() -> list[str]:
    out = _run_cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(*, prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix><pid>-...`` whose creating process no longer exists (left by a
    run that was SIGKILLed); returns their names. Namespaces of live processes are left alone."""
    removed = []
    for name in _list_namespaces():
        if not name.startswith(prefix):
            continue
        m = re.match(rf"^{re.escape(prefix)}(\d+)-", name)
        if m and _pid_alive(int(m.group(1))):
            continue
        _kill_namespace_processes(name)
        if _run_cmd(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    if removed:
        log.info("removed stale namespaces: %s", ", ".join(removed))
    return removed


def _kill_namespace_processes(name: str) -> None:
    pids = _run_cmd(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


# --------------------------------------------------------------------------------------------------------
# link shaping


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """How one direction of a link is shaped: ``rate_mbit`` (None: unlimited, veth speed; kernel ``tbf``),
    one-way ``delay_ms`` with uniform ``jitter_ms`` (reorders frames, like netem; TCP copes) and random
    ``loss_pct`` (100: the direction is cut). Delay, jitter and loss below 100% go through the user-space
    wire (:mod:`aqsgd.bench.netem_wire`)."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {self.rate_mbit}")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter_ms <= delay_ms, got delay {self.delay_ms}, jitter {self.jitter_ms}")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss_pct must be in [0, 100], got {self.loss_pct}")

    @property
    def impaired(self) -> bool:
        """Whether the wire must do something (delay, jitter or loss) in this direction."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"]
        if self.delay_ms or self.jitter_ms:
            parts.append(f"{self.delay_ms:g}±{self.jitter_ms:g} ms" if self.jitter_ms else f"{self.delay_ms:g} ms")
        if self.loss_pct:
            parts.append(f"{self.loss_pct:g}% loss")
        return ", ".join(parts)

    def tc_commands(self, ns: str, dev: str) -> list[list[str]]:
        """The tc command lines that put this shape's rate on ``dev`` in namespace ``ns`` (after a root
        delete; none without a rate)."""
        if not self.rate_mbit:
            return []
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(4096, int(rate_bytes * 1e-3))  # 1 ms at line rate
        limit = max(256 * 1024, int(rate_bytes * 0.1))  # >= 100 ms of queue: no tail drops on TCP bursts
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                 "rate", f"{int(self.rate_mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]]

    def impairment_json(self) -> str:
        return json.dumps({"delay_ms": self.delay_ms, "jitter_ms": self.jitter_ms, "loss_pct": self.loss_pct})


_IPERF_SERVER = r"""
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; first = None; buf = bytearray(1 << 20)
while True:
    k = c.recv_into(buf)
    if not k: break
    now = time.perf_counter()
    if first is None: first, first_n = now, k
    n += k; last = now
print(json.dumps({"bytes": n - first_n, "seconds": last - first}), flush=True)
"""

_IPERF_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
total = int(sys.argv[3]); chunk = b"\0" * (1 << 20); sent = 0
while sent < total:
    sent += c.send(chunk[: min(len(chunk), total - sent)])
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


# --------------------------------------------------------------------------------------------------------
# running a job


@dataclasses.dataclass
class StageOutcome:
    """How one stage process ended: exit code (negative: killed by that signal; None: still running when
    the deadline passed and then killed), seconds from start to exit, its result (when it finished), and
    for a failure the exception line it ended with (e.g. ``aqsgd.errors.PeerTimeout: stage 1 did not ...``)
    plus the tail of its log."""

    stage: int
    returncode: int | None
    elapsed_s: float
    result: JobResult | dict[str, Any] | None  # JobResult (run_job) or the run's summary (run_train)
    error: str | None
    log_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None


# torch prefixes an uncaught exception's traceback lines with "[rankN]: " under torch.distributed
_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Failure|Timeout|Exception|Interrupt): .*)$")


_CLI_ERROR = re.compile(r"^aqsgd: error: (.*)$")  # how the ``aqsgd`` command reports an AqsgdError


def _last_exception(text: str) -> str | None:
    found = [m.group(1) for line in text.splitlines() for m in (_EXC_LINE.match(line) or _CLI_ERROR.match(line),) if m]
    return found[-1] if found else None


class NetemJob:
    """A job's stage processes while they run (handed to the ``during`` callback of
    :meth:`NetemCluster.run_job`)."""

    def __init__(self, procs: list[subprocess.Popen], started: float) -> None:
        self.procs = procs
        self.started = started

    def kill(self, stage: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to the stage's process."""
        log.info("sending signal %d to stage %d (pid %d)", sig, stage, self.procs[stage].pid)
        with contextlib.suppress(ProcessLookupError):
            self.procs[stage].send_signal(sig)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)


def snake_nodes(stages: int, replicas: int = 1) -> list[int]:
    """The chain node of each rank (``rank = replica * stages + stage``, :mod:`aqsgd.parallel.grid`):
    replicas lie along the chain alternately forwards and backwards (``0 1 | 3 2 | 4 5 ...``), so that every
    pipeline boundary is one dedicated link and replica ``r``'s last (or first) stage is the neighbour of
    replica ``r+1``'s."""
    if stages < 1 or replicas < 1:
        raise ValueError(f"stages and replicas must be >= 1, got {stages} and {replicas}")
    return [r * stages + (s if r % 2 == 0 else stages - 1 - s) for r in range(replicas) for s in range(stages)]


def sync_link_load(stages: int, replicas: int = 1) -> int:
    """How many stages' gradient synchronizations cross the busiest link of the chain under
    :func:`snake_nodes` (each stage's replicas talk along the stretch of chain between them): the factor by
    which the ideal model stretches the sync time. 0 without data parallelism."""
    if replicas < 2:
        return 0
    nodes = snake_nodes(stages, replicas)
    spans = [(min(g), max(g)) for g in ([nodes[r * stages + s] for r in range(replicas)] for s in range(stages))]
    return max(sum(lo <= link < hi for lo, hi in spans) for link in range(stages * replicas - 1))


class NetemCluster:
    """``num_nodes`` network namespaces in a chain of veth links (see the module docs); a context manager
    that always removes them again.

    >>> with NetemCluster(2) as cluster:                                  # doctest: +SKIP
    ...     cluster.shape_all(LinkShape(rate_mbit=100, delay_ms=5))
    ...     outcomes = cluster.run_job(job, workdir="/tmp/run")
    """

    def __init__(self, num_nodes: int) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.num_nodes = num_nodes
        self.run_id = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.namespaces = [f"{PREFIX}{self.run_id}-{i}" for i in range(num_nodes)]
        self.wires = [f"{PREFIX}{self.run_id}-w{i}" for i in range(num_nodes - 1)]
        self.shapes: dict[tuple[int, int], LinkShape] = {}
        self._forwarders: dict[int, subprocess.Popen] = {}  # link -> its user-space wire, while impaired
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = True
        self._old_sigterm: Any = None

    # -- addresses -------------------------------------------------------------------------------------

    def address(self, node: int) -> str:
        """The address other nodes reach ``node`` at (that of its gloo interface)."""
        return f"{SUBNET}.{node}.1" if node < self.num_nodes - 1 else f"{SUBNET}.{node - 1}.2"

    def ifname(self, node: int) -> str:
        """The device to give gloo (``GLOO_SOCKET_IFNAME``): the node's east link, the last node's west one.
        (torch ignores a GLOO_SOCKET_IFNAME of one character, hence no names like ``r``.)"""
        return "east" if node < self.num_nodes - 1 else "west"

    def device(self, src: int, dst: int) -> str:
        """The device in ``src``'s namespace whose egress carries ``src -> dst`` (neighbours only)."""
        if dst == src + 1:
            return "east"
        if dst == src - 1:
            return "west"
        raise ValueError(f"nodes {src} and {dst} are not neighbours; only neighbouring links can be shaped")

    # -- lifecycle -------------------------------------------------------------------------------------

    def __enter__(self) -> NetemCluster:
        check_netem()
        cleanup_stale()
        self._closed = False
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally/with blocks that call close()

    def _build(self) -> None:
        for ns in self.namespaces + self.wires:
            _run_cmd(["ip", "netns", "add", ns])
            _run_cmd(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        for ns in self.namespaces:
            _run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            _run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0"])
        for i, wire in enumerate(self.wires):
            left, right = self.namespaces[i], self.namespaces[i + 1]
            _run_cmd(["ip", "link", "add", "name", "east", "netns", left, "type", "veth", "peer", "name", "wa", "netns", wire])
            _run_cmd(["ip", "link", "add", "name", "west", "netns", right, "type", "veth", "peer", "name", "wb", "netns", wire])
            _run_cmd(["ip", "-n", wire, "link", "add", "br0", "type", "bridge"])
            for dev in ("wa", "wb", "br0"):
                _run_cmd(["ip", "-n", wire, "link", "set", "dev", dev, "up"])
            self._bridge(i, attach=True)
            _run_cmd(["ip", "-n", left, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", "east"])
            _run_cmd(["ip", "-n", right, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", "west"])
            _run_cmd(["ip", "-n", left, "link", "set", "dev", "east", "up"])
            _run_cmd(["ip", "-n", right, "link", "set", "dev", "west", "up"])
        for node, ns in enumerate(self.namespaces):
            for link in range(self.num_nodes - 1):
                if link < node - 1:  # left of the left neighbour: via the left neighbour's right address
                    _run_cmd(["ip", "-n", ns, "route", "add", f"{SUBNET}.{link}.0/24", "via", f"{SUBNET}.{node - 1}.1"])
                elif link > node:
                    _run_cmd(["ip", "-n", ns, "route", "add", f"{SUBNET}.{link}.0/24", "via", f"{SUBNET}.{node}.2"])
        for i in range(self.num_nodes - 1):
            self.shapes[(i, i + 1)] = self.shapes[(i + 1, i)] = LinkShape()
        log.info("network namespaces %s: chain of %d links", ", ".join(self.namespaces), self.num_nodes - 1)

    def _bridge(self, link: int, *, attach: bool) -> None:
        wire = self.wires[link]
        for dev in ("wa", "wb"):
            _run_cmd(["ip", "-n", wire, "link", "set", "dev", dev] + (["master", "br0"] if attach else ["nomaster"]))

    def _stop_forwarder(self, link: int) -> None:
        proc = self._forwarders.pop(link, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _rewire(self, link: int) -> None:
        """Bridge the link's two ends in the kernel, or run the user-space wire, or cut it, as its two
        directions' shapes require."""
        there, back = self.shapes[(link, link + 1)], self.shapes[(link + 1, link)]
        self._stop_forwarder(link)
        if not (there.impaired or back.impaired):
            self._bridge(link, attach=True)
            return
        self._bridge(link, attach=False)
        if there.loss_pct == 100 and back.loss_pct == 100:
            return  # both directions cut: the ends stay unconnected
        proc = self.popen_wire(link, [sys.executable, "-m", "aqsgd.bench.netem_wire", "wa", "wb",
                                      there.impairment_json(), back.impairment_json(), str(link)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            err = proc.stderr.read() if proc.stderr else ""
            raise NetemError(f"the user-space wire of link {link} did not start: {err.strip()}")
        self._forwarders[link] = proc

    def close(self) -> None:
        """Kill this cluster's processes and delete its namespaces (idempotent; never raises)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for ns in self.namespaces + self.wires:
            try:
                _kill_namespace_processes(ns)
                _run_cmd(["ip", "netns", "del", ns], check=False)
            except (OSError, subprocess.TimeoutExpired) as e:  # keep deleting the others
                log.warning("could not delete namespace %s: %s", ns, e)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        log.info("removed network namespaces of run %s", self.run_id)

    # -- shaping ---------------------------------------------------------------------------------------

    def shape(self, src: int, dst: int, shape: LinkShape) -> None:
        """Shape the direction ``src -> dst`` of a link (replaces its previous shape at once, also while a
        job runs)."""
        ns, dev = self.namespaces[src], self.device(src, dst)
        old = self.shapes.get((src, dst), LinkShape())
        if shape.rate_mbit != old.rate_mbit:
            _run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            for cmd in shape.tc_commands(ns, dev):
                _run_cmd(cmd)
        self.shapes[(src, dst)] = shape
        if (shape.impaired or old.impaired) and shape != old:
            self._rewire(min(src, dst))
        log.debug("link %d -> %d: %s", src, dst, shape.describe())

    def shape_link(self, a: int, b: int, shape: LinkShape) -> None:
        """Shape both directions of the link between neighbours ``a`` and ``b``."""
        self.shape(a, b, shape)
        self.shape(b, a, shape)

    def shape_all(self, shape: LinkShape) -> None:
        """Shape both directions of every link."""
        for i in range(self.num_nodes - 1):
            self.shape_link(i, i + 1, shape)

    def tx_bytes(self, src: int, dst: int) -> int:
        """Bytes sent so far on the device carrying ``src -> dst`` (the kernel's counter)."""
        path = f"/sys/class/net/{self.device(src, dst)}/statistics/tx_bytes"
        return int(_run_cmd(["ip", "netns", "exec", self.namespaces[src], "cat", path]).stdout)

    def wait_for_traffic(self, src: int, dst: int, nbytes: int, *, timeout_s: float = 60.0,
                         job: NetemJob | None = None) -> int:
        """Block until ``nbytes`` more bytes went ``src -> dst`` (e.g. a few training steps' worth, so a fault
        lands mid-training); returns the bytes seen. Raises TimeoutError (or returns early when ``job``'s
        processes have all exited)."""
        start = self.tx_bytes(src, dst)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = self.tx_bytes(src, dst) - start
            if seen >= nbytes or (job is not None and not job.running()):
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"fewer than {nbytes} bytes went {src} -> {dst} within {timeout_s:g} s")

    # -- processes -------------------------------------------------------------------------------------

    def popen_wire(self, link: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside the wire namespace of ``link`` (tracked: killed on close)."""
        src_dir = str(Path(aqsgd.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src_dir, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen(["ip", "netns", "exec", self.wires[link], *argv], env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def popen(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (tracked: killed on close). ``ip netns exec`` execs
        the command, so the Popen's pid is the command's own."""
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def measure_goodput(self, src: int, dst: int, *, seconds: float = 0.5, port: int = 5201) -> float:
        """TCP goodput ``src -> dst`` (any two nodes) in Mbit/s: one bulk transfer sized for about ``seconds``
        at the path's narrowest configured rate (at least 256 KiB), timed at the receiver from first to last
        byte."""
        step = 1 if dst > src else -1
        hops = [self.shapes.get((n, n + step), LinkShape()).rate_mbit for n in range(src, dst, step)]
        rate = min((r for r in hops if r), default=10_000.0)  # the path's narrowest hop
        nbytes = int(min(256 << 20, max(256 << 10, rate * 1e6 / 8 * seconds)))
        server = self.popen(dst, [sys.executable, "-c", _IPERF_SERVER, self.address(dst), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise NetemError(f"goodput server did not start: {server.stderr.read() if server.stderr else ''}")
            client = self.popen(src, [sys.executable, "-c", _IPERF_CLIENT, self.address(dst), str(port), str(nbytes)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            out, err = server.communicate(timeout=120)
            client.wait(timeout=30)
        finally:
            for p in (server,):
                if p.poll() is None:
                    p.kill()
        if server.returncode != 0:
            raise NetemError(f"goodput measurement {src} -> {dst} failed: {err.strip()}")
        m = json.loads(out.strip().splitlines()[-1])
        return m["bytes"] * 8 / m["seconds"] / 1e6

    def run_job(self, job: JobConfig, workdir: str | Path, *, deadline_s: float = 600.0,
                env: Mapping[str, str] | None = None, stage_env: Mapping[int, Mapping[str, str]] | None = None,
                extra_args: Sequence[str] = (), during: Callable[[NetemJob], None] | None = None,
                threads: int = 1) -> list[StageOutcome]:
        """Run the synthetic ``job`` (:mod:`aqsgd.train.job`) with one process per stage, stage ``i`` in
        namespace ``i``; returns every stage's outcome (in stage order, ``result`` a :class:`JobResult`) once
        all have exited, or after ``deadline_s`` (the rest are killed and have ``returncode`` None). ``env``
        goes to every stage, ``stage_env[i]`` to stage ``i`` only (e.g. ``AQSGD_FAULT``); ``extra_args`` to
        every command line; ``during(job)`` runs on this thread while the processes run (fault injection).
        ``threads``: torch threads per process (OMP_NUM_THREADS)."""
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        job_path = workdir / "job.json"
        job_path.write_text(job.to_json())
        world = job.num_stages * job.data_parallel
        results = [workdir / f"result{rank}.json" for rank in range(world)]
        for path in results:
            path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "aqsgd.train.job", str(job_path), "--result", str(workdir / "result{rank}.json"),
                *extra_args]
        outcomes = self._run_processes(snake_nodes(job.num_stages, job.data_parallel), argv, workdir,
                                       deadline_s=deadline_s, env=env, stage_env=stage_env, during=during,
                                       threads=threads)
        for outcome, path in zip(outcomes, results):
            if path.exists():
                outcome.result = JobResult(**json.loads(path.read_text()))
        return outcomes

    def run_train(self, args: Sequence[str], workdir: str | Path, *, deadline_s: float = 600.0,
                  env: Mapping[str, str] | None = None, stage_env: Mapping[int, Mapping[str, str]] | None = None,
                  during: Callable[[NetemJob], None] | None = None, threads: int = 1) -> list[StageOutcome]:
        """Run ``aqsgd train ARGS --runtime distributed`` across the namespaces, one process per rank (rank
        ``i`` in namespace ``i``), each started the way torchrun starts it (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``/``MASTER_PORT``). The trainer's options are checked here first (a bad option raises
        :class:`~aqsgd.errors.SpecError` before any process starts). The run directory (``--output-dir`` /
        ``--run-name``) is shared by the processes, as checkpoints need. The outcome of the rank that writes
        the metrics (last stage of replica 0) carries the run's ``summary.json`` as ``result``; the others'
        ``result`` is ``{}`` when they exited cleanly. Other keywords as for :meth:`run_job`."""
        from aqsgd.cli import build_parser
        from aqsgd.cli.train import build_config

        argv = ["train", *args, "--runtime", "distributed"]
        cfg = build_config(build_parser().parse_args(argv))
        if cfg.run_name is None:
            raise ValueError("run_train needs --run-name (every process must write into the same run directory)")
        summary_path = Path(cfg.output_dir) / cfg.run_name / "summary.json"
        started = summary_path.stat().st_mtime_ns if summary_path.exists() else None
        outcomes = self._run_processes(snake_nodes(cfg.stages, cfg.data_parallel),
                                       [sys.executable, "-m", "aqsgd.cli", *argv], Path(workdir),
                                       deadline_s=deadline_s, env=env, stage_env=stage_env, during=during,
                                       threads=threads)
        writer = cfg.stages - 1  # replica 0's last stage writes the metrics
        fresh = summary_path.exists() and summary_path.stat().st_mtime_ns != started
        for outcome in outcomes:
            if outcome.returncode == 0:
                outcome.result = json.loads(summary_path.read_text()) if outcome.stage == writer and fresh else {}
        return outcomes

    def _run_processes(self, nodes: Sequence[int], argv: Sequence[str], workdir: Path, *, deadline_s: float,
                       env: Mapping[str, str] | None, stage_env: Mapping[int, Mapping[str, str]] | None,
                       during: Callable[[NetemJob], None] | None, threads: int) -> list[StageOutcome]:
        """Start ``argv`` as rank ``i`` of ``len(nodes)`` in namespace ``nodes[i]`` (logs to
        ``workdir/stage{i}.log``), run ``during``, wait for all to exit or the deadline; outcomes without
        results."""
        world = len(nodes)
        if max(nodes) >= self.num_nodes:
            raise ValueError(f"{world} processes need {max(nodes) + 1} namespaces; the cluster has {self.num_nodes}")
        workdir.mkdir(parents=True, exist_ok=True)
        src_dir = str(Path(aqsgd.__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join(p for p in (src_dir, os.environ.get("PYTHONPATH", "")) if p)
        procs, logs = [], []
        t0 = time.monotonic()
        for rank in range(world):
            rank_vars = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                         "MASTER_ADDR": self.address(nodes[0]), "MASTER_PORT": str(MASTER_PORT),
                         "GLOO_SOCKET_IFNAME": self.ifname(nodes[rank]), "OMP_NUM_THREADS": str(threads),
                         "PYTHONPATH": pythonpath, **(env or {}), **((stage_env or {}).get(rank, {}))}
            log_file = open(workdir / f"stage{rank}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log_file)
            procs.append(self.popen(nodes[rank], argv, env=rank_vars, stdout=log_file, stderr=subprocess.STDOUT))
        handle = NetemJob(procs, t0)
        ended: list[float | None] = [None] * len(procs)
        try:
            if during is not None:
                during(handle)
            deadline = t0 + deadline_s
            while time.monotonic() < deadline and any(e is None for e in ended):
                for i, p in enumerate(procs):
                    if ended[i] is None and p.poll() is not None:
                        ended[i] = time.monotonic() - t0
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
        outcomes = []
        for rank, p in enumerate(procs):
            text = (workdir / f"stage{rank}.log").read_text(errors="replace")
            code = p.returncode if ended[rank] is not None else None
            error = None if code == 0 else (_last_exception(text) or (f"exit code {code}" if code is not None else None))
            if ended[rank] is None:  # say so: a hang leaves no exception in the log
                last = f"; last error: {error}" if error else ""
                error = f"still running at the {deadline_s:g} s deadline (killed){last}"
            outcomes.append(StageOutcome(rank, code, ended[rank] if ended[rank] is not None else deadline_s,
                                         None, error, text[-3000:]))
        return outcomes


# --------------------------------------------------------------------------------------------------------
# the benchmark


@dataclasses.dataclass(frozen=True)
class Setting:
    """One compression setting of the sweep: the boundary codecs, plus ``job_overrides`` (more
    :class:`JobConfig` fields). Data parallelism and its gradient sync are swept separately
    (:attr:`NetemBenchConfig.data_parallel`, :attr:`NetemBenchConfig.grad_syncs`)."""

    forward: str
    backward: str
    job_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


NETEM_SETTINGS: dict[str, Setting] = {
    "fp32": Setting("none", "none"),
    "fp16": Setting("fp16", "fp16"),
    "direct fw2/bw4": Setting("direct:q2", "direct:q4"),
    "aqsgd fw2/bw4": Setting("delta:q2", "direct:q4"),
    "aqsgd fw4/bw8": Setting("delta:q4", "direct:q8"),
}


@dataclasses.dataclass
class NetemBenchConfig:
    """What :func:`bench_netem` sweeps. ``bandwidths_mbps`` None: from ``max_mbps`` down in steps of
    sqrt(10) to where fp32's link time is ``target_ratio`` x compute (from a calibration run)."""

    stages: int = 2
    bandwidths_mbps: Sequence[float] | None = None
    max_mbps: float = 1000.0
    target_ratio: float = 10.0
    settings: Sequence[str] = tuple(NETEM_SETTINGS)
    delay_ms: float = 0.0
    hidden: int = 256
    layers: int = 4
    seq_len: int = 128
    vocab: int = 512
    microbatch_size: int = 4
    num_microbatches: int = 4
    measure_steps: int = 6
    runs: int = 1
    timeout_s: float = 120.0  # the job's transport timeout
    threads: int = 1  # torch threads per stage process
    grid_step: float = math.sqrt(10)  # ratio between consecutive bandwidths of the derived grid
    # data parallelism: with data_parallel D > 1, dp_settings also run on D replicas of the pipeline (S x D
    # processes along the chain, see snake_nodes) with each gradient sync of grad_syncs
    data_parallel: int = 1
    dp_settings: Sequence[str] = ("fp32", "aqsgd fw2/bw4")
    grad_syncs: Sequence[str] = ("allreduce", "q8")

    @classmethod
    def quick(cls, **kw: Any) -> NetemBenchConfig:
        """A smaller sweep (about 5 minutes on 2 cores): 3 timed steps, bandwidths a factor 10 apart."""
        return cls(**{"measure_steps": 3, "grid_step": 10.0, **kw})


def _base_job(cfg: NetemBenchConfig, weights_dir: str) -> JobConfig:
    recipe = tiny_lm_recipe("llama", layers=cfg.layers, hidden=cfg.hidden, vocab=cfg.vocab, seq_len=cfg.seq_len)
    batch = cfg.microbatch_size * cfg.num_microbatches
    job = JobConfig(recipe=recipe.to_dict(), num_stages=cfg.stages, num_microbatches=cfg.num_microbatches,
                    microbatch_size=cfg.microbatch_size, seq_len=cfg.seq_len, num_samples=batch,
                    steps=1 + cfg.measure_steps, warmup_steps=1, timeout_s=cfg.timeout_s)
    return ensure_weights(job, weights_dir)


def _variants(cfg: NetemBenchConfig) -> list[tuple[str, int, str]]:
    """(setting, replicas, gradient sync) of one bandwidth: every setting on one pipeline, then the
    data-parallel ones."""
    out = [(name, 1, "allreduce") for name in cfg.settings]
    if cfg.data_parallel > 1:
        out += [(name, cfg.data_parallel, sync) for name in cfg.dp_settings for sync in cfg.grad_syncs]
    return out


def _variant_job(base: JobConfig, name: str, replicas: int, sync: str) -> JobConfig:
    s = NETEM_SETTINGS[name]
    return dataclasses.replace(base, forward=s.forward, backward=s.backward, data_parallel=replicas, grad_sync=sync,
                               num_samples=base.num_samples * replicas, **dict(s.job_overrides))


def variant_label(row: Mapping[str, Any]) -> str:
    """A row's setting with its data parallelism, e.g. ``aqsgd fw2/bw4, D=2 q8``."""
    dp = row.get("data_parallel", 1)
    return row["setting"] if dp == 1 else f"{row['setting']}, D={dp} {row.get('grad_sync', 'allreduce')}"


def bandwidth_grid(max_mbps: float, min_mbps: float, *, step: float = math.sqrt(10)) -> list[float]:
    """``max_mbps``, ``max_mbps/step``, ... while above ``min_mbps``, then ``min_mbps`` itself (3
    significant digits), descending."""
    if min_mbps >= max_mbps:
        return [float(f"{max_mbps:.3g}")]
    grid, bw = [], max_mbps
    while bw > min_mbps * 1.3:  # no point a hair above the last one
        grid.append(float(f"{bw:.3g}"))
        bw /= step
    grid.append(float(f"{min_mbps:.3g}"))
    return grid


def _row(name: str, bw: float, link_mbps: float, job: JobConfig, runs: list[list[JobResult]]) -> dict[str, Any]:
    measured = [_measure(job, per_stage) for per_stage in runs]
    mid = statistics.median(m["samples_per_s"] for m in measured)
    return {"setting": name, "stages": job.num_stages, "data_parallel": job.data_parallel,
            "grad_sync": job.grad_sync, "sync_load": sync_link_load(job.num_stages, job.data_parallel),
            "bandwidth_mbps": bw, "link_mbps": link_mbps,
            "forward": job.forward, "backward": job.backward, "runs": len(runs),
            "samples_per_s": mid, "samples_per_s_runs": [m["samples_per_s"] for m in measured],
            "step_s": statistics.median(m["step_s"] for m in measured),
            "compute_per_mb_s": statistics.median(m["compute_per_mb_s"] for m in measured),
            "bytes_per_mb": statistics.median(m["bytes_per_mb"] for m in measured),
            "sync_bytes": statistics.median(m["sync_bytes"] for m in measured),
            "num_microbatches": job.num_microbatches}


def _summarize_with_link_rate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`aqsgd.bench.pipeline.summarize` over the measured goodput instead of the nominal rate."""
    for r in rows:
        r["nominal_mbps"], r["bandwidth_mbps"] = r["bandwidth_mbps"], r["link_mbps"]
    # rows of one nominal bandwidth share one goodput measurement, so the grouping is unchanged
    summarize(rows)
    for r in rows:
        r["bandwidth_mbps"] = r.pop("nominal_mbps")
    return rows


def bench_netem(cfg: NetemBenchConfig, workdir: str | Path,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sweep over real shaped links; returns ``{"calibration": ..., "links": ..., "rows": ...}``
    with one summarized row per (bandwidth, setting) (see the module docs)."""
    check_netem()
    unknown = [s for s in cfg.settings if s not in NETEM_SETTINGS]
    if unknown or "fp32" not in cfg.settings:
        raise ValueError(f"settings must include fp32 and come from {list(NETEM_SETTINGS)}; got {list(cfg.settings)}")
    say = progress or (lambda msg: log.info("%s", msg))
    workdir = Path(workdir)
    base = _base_job(cfg, str(workdir / "weights"))
    unknown = [s for s in cfg.dp_settings if s not in NETEM_SETTINGS] if cfg.data_parallel > 1 else []
    if unknown or (cfg.data_parallel > 1 and "fp32" not in cfg.dp_settings):
        raise ValueError(f"dp_settings must include fp32 and come from {list(NETEM_SETTINGS)}; got {list(cfg.dp_settings)}")
    for sync in cfg.grad_syncs:
        parse_grad_sync(sync)
    if cfg.data_parallel > 1 and "allreduce" not in cfg.grad_syncs:
        raise ValueError(f"grad_syncs must include allreduce (the baseline); got {list(cfg.grad_syncs)}")
    results: dict[tuple[float, str, int, str], list[list[JobResult]]] = {}
    links: dict[float, dict[str, float]] = {}

    def run(cluster: NetemCluster, name: str, bw: float, tag: str, replicas: int = 1,
            sync: str = "allreduce") -> list[JobResult]:
        job = _variant_job(base, name, replicas, sync)
        label = variant_label({"setting": name, "data_parallel": replicas, "grad_sync": sync})
        t0 = time.monotonic()
        outcomes = cluster.run_job(job, workdir / "runs" / tag, deadline_s=900, threads=cfg.threads)
        bad = [o for o in outcomes if not o.ok]
        if bad:
            raise NetemError(f"{label} at {bw:g} Mbit/s: rank {bad[0].stage} failed "
                             f"({bad[0].error or bad[0].returncode}):\n{bad[0].log_tail}")
        per_stage = [o.result for o in outcomes]
        m = _measure(job, per_stage)  # type: ignore[arg-type]
        say(f"  {label:<30} {bw:>7g} Mbit/s: {m['samples_per_s']:8.1f} samples/s "
            f"(step {m['step_s'] * 1e3:.0f} ms, run {time.monotonic() - t0:.1f} s)")
        return per_stage  # type: ignore[return-value]

    def measure_links(cluster: NetemCluster, bw: float) -> dict[str, float]:
        fw = cluster.measure_goodput(0, 1)
        bwd = cluster.measure_goodput(1, 0)
        say(f"link {bw:g} Mbit/s (delay {cfg.delay_ms:g} ms): TCP goodput 0->1 {fw:.1f}, 1->0 {bwd:.1f} Mbit/s "
            f"({min(fw, bwd) / bw:.1%} of nominal)")
        return {"forward_mbps": fw, "backward_mbps": bwd}

    with NetemCluster(cfg.stages * max(cfg.data_parallel, 1)) as cluster:
        top = cfg.bandwidths_mbps[0] if cfg.bandwidths_mbps else cfg.max_mbps
        cluster.shape_all(LinkShape(rate_mbit=top, delay_ms=cfg.delay_ms))
        links[top] = measure_links(cluster, top)
        say(f"calibration: fp32 at {top:g} Mbit/s, {cfg.stages} stages")
        calib = run(cluster, "fp32", top, "calibration")
        m = _measure(dataclasses.replace(base, forward="none", backward="none"), calib)
        c, nbytes = m["compute_per_mb_s"], m["bytes_per_mb"]
        target_mbps = nbytes * 8 / (cfg.target_ratio * c) / 1e6
        grid = list(cfg.bandwidths_mbps) if cfg.bandwidths_mbps else bandwidth_grid(cfg.max_mbps, target_mbps,
                                                                                       step=cfg.grid_step)
        calibration = {"compute_per_mb_s": c, "fp32_bytes_per_mb": nbytes, "bandwidth_mbps": top,
                       "target_ratio": cfg.target_ratio, "target_mbps": target_mbps, "grid_mbps": grid}
        say(f"compute {c * 1e3:.1f} ms per micro-batch, fp32 message {nbytes / 1024:.0f} KiB: link time = "
            f"{cfg.target_ratio:g}x compute at {target_mbps:.1f} Mbit/s; sweep {grid} Mbit/s, "
            f"{len(_variants(cfg))} settings x {cfg.runs} run(s)")
        for bw in grid:
            if bw not in links:
                cluster.shape_all(LinkShape(rate_mbit=bw, delay_ms=cfg.delay_ms))
                links[bw] = measure_links(cluster, bw)
            for name, replicas, sync in _variants(cfg):
                for rep in range(cfg.runs):
                    key = (bw, name, replicas, sync)
                    if bw == top and name == "fp32" and replicas == 1 and rep == 0:
                        results.setdefault(key, []).append(calib)
                        continue
                    tag = f"{bw:g}-{name}-D{replicas}-{sync}-{rep}".replace(" ", "_").replace("/", "").replace(":", "")
                    results.setdefault(key, []).append(run(cluster, name, bw, tag, replicas, sync))
    rows = []
    for bw in grid:
        link = links[bw]
        # the ideal model's line: the slower direction's measured goodput
        link_mbps = min(link["forward_mbps"], link["backward_mbps"], bw)
        for name, replicas, sync in _variants(cfg):
            rows.append(_row(name, bw, link_mbps, _variant_job(base, name, replicas, sync),
                             results[(bw, name, replicas, sync)]))
    return {"calibration": calibration, "links": {f"{bw:g}": v for bw, v in links.items()},
            "rows": _summarize_with_link_rate(rows)}


# --------------------------------------------------------------------------------------------------------
# reporting


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The sweep's rows as a markdown table (one line per bandwidth and setting)."""
    head = ("| Mbit/s | link goodput | setting | samples/s | speed-up vs fp32 | ideal | efficiency | "
            "fp32 comm:compute |")
    lines = [head, "|" + "---:|" * 2 + ":---|" + "---:|" * 5]
    for r in rows:
        lines.append(f"| {r['bandwidth_mbps']:g} | {r['link_mbps']:.1f} | {variant_label(r)} | "
                     f"{r['samples_per_s']:.1f} | {r['speedup_vs_fp32']:.2f} | {r['ideal_speedup']:.2f} | "
                     f"{r['efficiency']:.2f} | {r['comm_compute_ratio']:.2f} |")
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], path: str | Path, *, cfg: NetemBenchConfig, command: str,
               machine: str) -> None:
    """The report, the configuration, the command and the machine as JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": "netem", "command": command, "machine": machine,
                                      "config": dataclasses.asdict(cfg), **report}, indent=1, default=list))


def plot_speedups(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> None:
    """PNG of measured (solid) and ideal (dotted) speed-up vs fp32 against bandwidth, one colour per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    names = list(dict.fromkeys(variant_label(r) for r in rows))
    for k, name in enumerate(names):
        pts = sorted((r["bandwidth_mbps"], r["speedup_vs_fp32"], r["ideal_speedup"]) for r in rows
                     if variant_label(r) == name)
        colour = f"C{k}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=name)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=colour, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per direction (Mbit/s, tc tbf)")
    ax.set_ylabel("speed-up vs fp32 (samples/s)")
    ax.set_title(title or "pipeline over shaped veth links (dotted: ideal)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# command line


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def register_cli(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``netem`` to the ``aqsgd bench`` sub-commands; returns its parser."""
    p = bench_subparsers.add_parser(
        "netem", help="pipeline throughput over real shaped links (network namespaces, tc; needs root)",
        description="Runs stage processes in Linux network namespaces joined by veth links shaped with tc "
                    "(tbf; delay and loss by a user-space wire), over gloo/TCP, for fp32, fp16, direct and AQ-SGD "
                    "compression (with --data-parallel also gradient syncs between replicas), from "
                    "--max-mbps down to where the fp32 link time is --target-ratio x the compute time. "
                    "Reports samples/s, speed-up vs fp32, the ideal speed-up (max(compute, link) per "
                    "micro-batch), efficiency and the fp32 comm:compute ratio. Needs root and iproute2.")
    p.add_argument("--stages", type=int, choices=(2, 4), default=2, help="pipeline stages (default: 2)")
    p.add_argument("--bandwidths", type=_positive_float, nargs="+", default=None, metavar="MBPS",
                   help="explicit bandwidths in Mbit/s, highest first (default: derived from a calibration run)")
    p.add_argument("--max-mbps", type=_positive_float, default=1000.0, help="top of the sweep (default: 1000)")
    p.add_argument("--target-ratio", type=_positive_float, default=10.0,
                   help="sweep down to where fp32 link time = this x compute time (default: 10)")
    p.add_argument("--settings", nargs="+", choices=list(NETEM_SETTINGS), default=list(NETEM_SETTINGS),
                   metavar="SETTING", help=f"settings to run (default: all: {', '.join(NETEM_SETTINGS)})")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (default: 0)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 6; 3 with --quick)")
    p.add_argument("--runs", type=int, default=1, help="runs per (bandwidth, setting); median (default: 1)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default: 256)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (default: 128)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="D",
                   help="also run --dp-settings on D replicas of the pipeline (S x D processes) with each "
                        "--grad-syncs (default: 1, off)")
    p.add_argument("--dp-settings", nargs="+", choices=list(NETEM_SETTINGS), default=["fp32", "aqsgd fw2/bw4"],
                   metavar="SETTING", help="settings run with data parallelism (default: fp32, aqsgd fw2/bw4)")
    p.add_argument("--grad-syncs", nargs="+", default=["allreduce", "q8"], metavar="SYNC",
                   help="gradient syncs between replicas: allreduce | q<b>[:block<N>] | powersgd[:rank<R>] "
                        "(default: allreduce q8)")
    p.add_argument("--quick", action="store_true", help="fewer timed steps (about 5 minutes on 2 cores)")
    p.add_argument("--workdir", default=None, help="where job files and logs go (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON to PATH")
    p.add_argument("--png", metavar="PATH", default=None, help="plot speed-up vs bandwidth to PATH")
    p.set_defaults(func=run_cli)
    return p


def _config_from_args(args: argparse.Namespace) -> NetemBenchConfig:
    kw: dict[str, Any] = {"stages": args.stages, "bandwidths_mbps": args.bandwidths, "max_mbps": args.max_mbps,
                          "target_ratio": args.target_ratio, "settings": tuple(args.settings),
                          "delay_ms": args.delay_ms, "runs": args.runs, "hidden": args.hidden,
                          "seq_len": args.seq_len, "data_parallel": args.data_parallel,
                          "dp_settings": tuple(args.dp_settings), "grad_syncs": tuple(args.grad_syncs)}
    if args.steps:
        kw["measure_steps"] = args.steps
    return NetemBenchConfig.quick(**kw) if args.quick else NetemBenchConfig(**kw)


def run_cli(args: argparse.Namespace) -> int:
    """``aqsgd bench netem``: run the sweep, print the table, write JSON/PNG when asked."""
    import platform
    import shlex
    import tempfile

    cfg = _config_from_args(args)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="aqsgd-netem-"))
        report = bench_netem(cfg, workdir, progress=print)
    rows = report["rows"]
    print(markdown_table(rows))
    at = rows[-1]["bandwidth_mbps"]
    aq = next((r for r in rows if r["bandwidth_mbps"] == at and variant_label(r) == "aqsgd fw2/bw4"), None)
    if aq is not None:
        print(f"at {at:g} Mbit/s (fp32 comm:compute {aq['comm_compute_ratio']:.1f}): AQ-SGD fw2/bw4 is "
              f"{aq['speedup_vs_fp32']:.2f}x fp32; lowest efficiency {min(r['efficiency'] for r in rows):.2f}")
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}"
    argv = sys.argv[1:]
    command = "aqsgd bench netem " + shlex.join(argv[argv.index("netem") + 1:] if "netem" in argv else argv)
    if args.json:
        write_json(report, args.json, cfg=cfg, command=command, machine=machine)
        print(f"wrote {args.json}")
    if args.png:
        plot_speedups(rows, args.png, title=f"{cfg.stages} stages over shaped veth links (dotted: ideal)")
        print(f"wrote {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aqsgd.bench.netem``: the same as ``aqsgd bench netem`` until the CLI wires it in."""
    parser = argparse.ArgumentParser(prog="python -m aqsgd.bench.netem")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    register_cli(sub)
    args = parser.parse_args(["netem", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except AqsgdError as e:
        print(f"aqsgd: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
