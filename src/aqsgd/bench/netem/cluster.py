"""Stage processes in Linux network namespaces joined by shaped veth links (:class:`NetemCluster`).

Every process lives in its own network namespace, the namespaces are joined by veth pairs, and each direction
of each link is shaped with ``tc``. It needs root and the ``ip``/``tc`` tools of iproute2 (and the kernel's
veth, bridge and ``sch_tbf``); without them every entry point raises :class:`NetemUnavailable` saying what is
missing. What it asks of the host (the probe, the commands, stale clean-up) is :mod:`aqsgd.bench.netem.host`,
a link's shape :mod:`aqsgd.bench.netem.shape`, and a training run's command line, processes and outcomes
:mod:`aqsgd.bench.netem.runs`.

Topology: a chain
-----------------
Namespace ``i`` runs node ``i``. Consecutive nodes ``i`` and ``i+1`` are joined through a *wire* namespace
``w<i>``: device ``east`` (address ``10.77.i.1``) in namespace ``i`` is a veth to ``wa`` in ``w<i>``, device
``west`` (``10.77.i.2``) in namespace ``i+1`` one to ``wb``, and ``w<i>`` joins ``wa`` and ``wb`` with a
kernel bridge (layer 2: both nodes are on subnet ``10.77.i.0/24``). Every node forwards IPv4 and has routes to
every other link subnet through its left or right neighbour, so non-neighbours reach each other too (gloo
opens a TCP full mesh at start-up, and tied weights are all-reduced between the first and the last stage);
that traffic crosses the intermediate nodes' shaped links, as it would on a real chain of hosts.

A chain rather than a star (one veth per process into one switch) because it gives *one dedicated link per
pipeline boundary and direction*, exactly the model of the in-process emulation and of the ideal speed-up in
:mod:`aqsgd.bench.pipeline`: forward activations (``i -> i+1``) and backward gradients (``i+1 -> i``) each get
their own full-duplex line, shaped on the sending device's egress. In a star a process has a single uplink
shared by everything it sends (forward to ``i+1`` *and* backward to ``i-1``), like a host's NIC, and
per-boundary shaping needs per-destination classes and filters. The price of the chain is that non-neighbour
traffic is forwarded through (and shaped by) the nodes in between. With data parallelism the ranks lie along
the chain as :func:`snake_nodes` places them.

Shaping
-------
Rate: a ``tbf`` root qdisc on the sending device (``east`` for ``i -> i+1``, ``west`` for ``i+1 -> i``). Its
sizes matter for accuracy: the *burst* is one millisecond at line rate (at least 4 KiB; a larger bucket lets
short messages leave faster than the line), and the queue *limit* is at least 100 ms at line rate (256 KiB
minimum) so that TCP's bursts are not tail-dropped (drops make TCP back off below the configured rate).
:meth:`NetemCluster.measure_goodput` checks the outcome with a TCP bulk transfer between two namespaces.

Delay, jitter, loss: the usual tool is ``netem`` (as the root qdisc with ``tbf`` as its child, so that packets
are delayed and dropped first and then leave at the token rate; netem's packet limit must then hold every
packet in flight during the delay). Kernels without ``sch_netem`` (common in VMs and containers, including the
one this was developed on: only ``tbf``, ``htb`` and ``pfifo`` and no tc classifiers) cannot do that, so an
impaired link's wire namespace instead takes its two ends off the bridge and runs
:mod:`aqsgd.bench.netem_wire`, a user-space forwarder that delays (uniform jitter, reordering like netem),
drops and forwards frames per direction; the ``tbf`` rate stays on the nodes' devices. A link whose two
directions both lose 100% is simply taken off the bridge (a black hole, no forwarder). The forwarder is a
Python loop (tens of MB/s): fine for fault tests, not for bulk Gbit/s links. It is a module of its own,
outside this package, so that it starts in a moment (it imports the standard library only) while a run is
live.

Processes
---------
:meth:`NetemCluster.run_train` runs ``python -m aqsgd train OPTIONS --runtime distributed`` across the
namespaces, one process per rank, each started the way torchrun starts it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, plus ``GLOO_SOCKET_IFNAME``); it waits
for all of them within a deadline (killing the rest when it passes) and returns each rank's
:class:`StageOutcome`: exit code, the run's summary for the rank that writes the metrics, and for a failed
rank the error it ended with. The trainer's ``metrics.jsonl`` (:func:`train_rows`) has every step's figures.
All processes share one run directory, so that a run killed by a fault can be continued with ``--resume``.

Faults are injected from outside, by a ``during`` callback that runs while the processes train and gets a
:class:`NetemRun`: wait until training is under way (:meth:`NetemCluster.wait_for_traffic`, or
:meth:`NetemRun.wait_for_step` on the metrics), then cut or impair a link (:meth:`NetemCluster.shape`), or
kill or stop a rank's process (:meth:`NetemRun.kill`, with SIGKILL or SIGSTOP).

Clean-up
--------
Namespace names are ``aqsgd-<pid>-<random>-<i>`` (nodes) and ``aqsgd-<pid>-<random>-w<i>`` (wires).
:class:`NetemCluster` kills its processes and deletes its namespaces (which deletes their veths and qdiscs) on
exit from the ``with`` block, on an exception, on Ctrl-C and on SIGTERM (turned into ``SystemExit`` while the
cluster is open), and from an ``atexit`` hook as a last resort. :func:`cleanup_stale` deletes namespaces with
our prefix whose creating process is gone (it runs when a cluster is opened).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Self

import aqsgd
from aqsgd.bench.netem.host import (PREFIX, NetemError, check_netem, cleanup_stale, kill_namespace_processes,
                                    run_cmd)
from aqsgd.bench.netem.runs import NetemRun, StageOutcome, snake_nodes, train_argv
from aqsgd.bench.netem.shape import LinkShape
from aqsgd.train.config import TrainConfig

__all__ = ["NetemCluster"]

log = logging.getLogger(__name__)

SUBNET = "10.77"
MASTER_PORT = 29500  # every run has its own namespaces, so a fixed port never collides

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


# torch prefixes an uncaught exception's traceback lines with "[rankN]: " under torch.distributed
_EXC_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?"
                       r"([A-Za-z_][\w.]*(?:Error|Failure|Timeout|Exception|Interrupt): .*)$")


_CLI_ERROR = re.compile(r"^aqsgd: error: (.*)$")  # how the ``aqsgd`` command reports an AqsgdError


def _last_exception(text: str) -> str | None:
    found = [m.group(1) for line in text.splitlines()
             for m in (_EXC_LINE.match(line) or _CLI_ERROR.match(line),) if m]
    return found[-1] if found else None


class NetemCluster:
    """``num_nodes`` network namespaces in a chain of veth links (see the module docs); a context manager
    that always removes them again.

    >>> with NetemCluster(2) as cluster:                                  # doctest: +SKIP
    ...     cluster.shape_all(LinkShape(rate_mbit=100, delay_ms=5))
    ...     outcomes = cluster.run_train({"task": "synthetic-lm", "stages": 2, "output_dir": "/tmp/runs",
    ...                                   "run_name": "r"}, "/tmp/logs")
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

    def __enter__(self) -> Self:
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
            run_cmd(["ip", "netns", "add", ns])
            run_cmd(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
        for ns in self.namespaces:
            run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.rp_filter=0"])
        for i, wire in enumerate(self.wires):
            left, right = self.namespaces[i], self.namespaces[i + 1]
            run_cmd(["ip", "link", "add", "name", "east", "netns", left, "type", "veth", "peer", "name",
                      "wa", "netns", wire])
            run_cmd(["ip", "link", "add", "name", "west", "netns", right, "type", "veth", "peer", "name",
                      "wb", "netns", wire])
            run_cmd(["ip", "-n", wire, "link", "add", "br0", "type", "bridge"])
            for dev in ("wa", "wb", "br0"):
                run_cmd(["ip", "-n", wire, "link", "set", "dev", dev, "up"])
            self._bridge(i, attach=True)
            run_cmd(["ip", "-n", left, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", "east"])
            run_cmd(["ip", "-n", right, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", "west"])
            run_cmd(["ip", "-n", left, "link", "set", "dev", "east", "up"])
            run_cmd(["ip", "-n", right, "link", "set", "dev", "west", "up"])
        for node, ns in enumerate(self.namespaces):
            for link in range(self.num_nodes - 1):
                if link < node - 1:  # left of the left neighbour: via the left neighbour's right address
                    run_cmd(["ip", "-n", ns, "route", "add", f"{SUBNET}.{link}.0/24", "via",
                              f"{SUBNET}.{node - 1}.1"])
                elif link > node:
                    run_cmd(["ip", "-n", ns, "route", "add", f"{SUBNET}.{link}.0/24", "via",
                              f"{SUBNET}.{node}.2"])
        for i in range(self.num_nodes - 1):
            self.shapes[(i, i + 1)] = self.shapes[(i + 1, i)] = LinkShape()
        log.info("network namespaces %s: chain of %d links", ", ".join(self.namespaces), self.num_nodes - 1)

    def _bridge(self, link: int, *, attach: bool) -> None:
        wire = self.wires[link]
        for dev in ("wa", "wb"):
            run_cmd(["ip", "-n", wire, "link", "set", "dev", dev]
                     + (["master", "br0"] if attach else ["nomaster"]))

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
                kill_namespace_processes(ns)
                run_cmd(["ip", "netns", "del", ns], check=False)
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
        run trains)."""
        ns, dev = self.namespaces[src], self.device(src, dst)
        old = self.shapes.get((src, dst), LinkShape())
        if shape.rate_mbit != old.rate_mbit:
            run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            for cmd in shape.tc_commands(ns, dev):
                run_cmd(cmd)
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
        return int(run_cmd(["ip", "netns", "exec", self.namespaces[src], "cat", path]).stdout)

    def wait_for_traffic(self, src: int, dst: int, nbytes: int, *, timeout_s: float = 60.0,
                         run: NetemRun | None = None) -> int:
        """Block until ``nbytes`` more bytes went ``src -> dst`` (e.g. a few training steps' worth, so a fault
        lands mid-training); returns the bytes seen. Raises TimeoutError (or returns early when ``run``'s
        processes have all exited)."""
        start = self.tx_bytes(src, dst)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = self.tx_bytes(src, dst) - start
            if seen >= nbytes or (run is not None and not run.running()):
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"fewer than {nbytes} bytes went {src} -> {dst} within {timeout_s:g} s")

    # -- processes -------------------------------------------------------------------------------------

    def popen_wire(self, link: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside the wire namespace of ``link`` (tracked: killed on close)."""
        src_dir = str(Path(aqsgd.__file__).resolve().parent.parent)
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(p for p in (src_dir, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen(["ip", "netns", "exec", self.wires[link], *argv], env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def popen(self, node: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (tracked: killed on close). ``ip netns exec`` execs
        the command, so the Popen's pid is the command's own."""
        # the emulated nodes place their ranks themselves: a node rank exported in this shell is not theirs
        full_env = {k: v for k, v in os.environ.items() if k != "AQSGD_NODE_RANK"}
        full_env.update(env or {})
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
                raise NetemError("goodput server did not start: "
                                 f"{server.stderr.read() if server.stderr else ''}")
            client = self.popen(src, [sys.executable, "-c", _IPERF_CLIENT, self.address(dst), str(port),
                                      str(nbytes)],
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

    def run_train(self, opts: Mapping[str, Any], workdir: str | Path, *, deadline_s: float = 600.0,
                  env: Mapping[str, str] | None = None,
                  stage_env: Mapping[int, Mapping[str, str]] | None = None,
                  during: Callable[[NetemRun], None] | None = None, threads: int = 1) -> list[StageOutcome]:
        """Run ``python -m aqsgd train OPTIONS --runtime distributed`` across the namespaces, one process per
        rank (placed by :func:`snake_nodes`), each started the way torchrun starts it (module docs). ``opts``
        are the trainer's options by their flat names (:func:`train_argv`); they are checked here first (a bad
        option raises :class:`~aqsgd.errors.SpecError` before any process starts), and must name the run
        directory (``run_name``), which all processes share, as checkpoints need. Logs go to
        ``workdir/stage{rank}.log``.

        Returns every rank's outcome, in rank order, once all have exited, or after ``deadline_s`` (the rest
        are killed and have ``returncode`` None). The outcome of the rank that writes the metrics (last stage
        of replica 0) carries the run's ``summary.json`` as ``result``. ``env`` goes to every process,
        ``stage_env[rank]`` to that rank's only; ``during(run)`` runs on this thread while the processes train
        (fault injection); ``threads``: torch threads per process (``OMP_NUM_THREADS``)."""
        opts = {**opts, "runtime": "distributed"}
        cfg = TrainConfig.from_flat(dict(opts), source="run_train").validate()
        if cfg.run.run_name is None:
            raise ValueError("run_train needs a run_name (--run-name): every process must write into the "
                             "same run directory")
        run_dir = Path(cfg.run.output_dir) / cfg.run.run_name
        summary_path = run_dir / "summary.json"
        started = summary_path.stat().st_mtime_ns if summary_path.exists() else None
        argv = [sys.executable, "-m", "aqsgd", "train", *train_argv(opts)]
        outcomes = self._run_processes(snake_nodes(cfg.pipeline.stages, cfg.pipeline.data_parallel), argv,
                                       Path(workdir), run_dir, deadline_s=deadline_s, env=env,
                                       stage_env=stage_env, during=during, threads=threads)
        writer = cfg.pipeline.stages - 1  # replica 0's last stage writes the metrics
        fresh = summary_path.exists() and summary_path.stat().st_mtime_ns != started
        for outcome in outcomes:
            if outcome.returncode == 0:
                outcome.result = (json.loads(summary_path.read_text())
                                  if outcome.stage == writer and fresh else {})
        return outcomes

    def _run_processes(self, nodes: Sequence[int], argv: Sequence[str], workdir: Path, run_dir: Path, *,
                       deadline_s: float, env: Mapping[str, str] | None,
                       stage_env: Mapping[int, Mapping[str, str]] | None,
                       during: Callable[[NetemRun], None] | None, threads: int) -> list[StageOutcome]:
        """Start ``argv`` as rank ``i`` of ``len(nodes)`` in namespace ``nodes[i]`` (logs to
        ``workdir/stage{i}.log``), run ``during``, wait for all to exit or the deadline; outcomes without
        results."""
        world = len(nodes)
        if max(nodes) >= self.num_nodes:
            raise ValueError(f"{world} processes need {max(nodes) + 1} namespaces; the cluster has "
                             f"{self.num_nodes}")
        workdir.mkdir(parents=True, exist_ok=True)
        src_dir = str(Path(aqsgd.__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join(p for p in (src_dir, os.environ.get("PYTHONPATH", "")) if p)
        procs, logs = [], []
        t0 = time.monotonic()
        for rank in range(world):
            rank_vars = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                         "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                         "MASTER_ADDR": self.address(nodes[0]), "MASTER_PORT": str(MASTER_PORT),
                         "GLOO_SOCKET_IFNAME": self.ifname(nodes[rank]), "OMP_NUM_THREADS": str(threads),
                         "PYTHONPATH": pythonpath, **(env or {}), **((stage_env or {}).get(rank, {}))}
            log_file = open(workdir / f"stage{rank}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(log_file)
            procs.append(self.popen(nodes[rank], argv, env=rank_vars, stdout=log_file,
                                    stderr=subprocess.STDOUT))
        handle = NetemRun(procs, t0, run_dir)
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
            error = None if code == 0 else (_last_exception(text)
                                            or (f"exit code {code}" if code is not None else None))
            if ended[rank] is None:  # say so: a hang leaves no exception in the log
                last = f"; last error: {error}" if error else ""
                error = f"still running at the {deadline_s:g} s deadline (killed){last}"
            outcomes.append(StageOutcome(rank, code, ended[rank] if ended[rank] is not None else deadline_s,
                                         None, error, text[-3000:]))
        return outcomes
