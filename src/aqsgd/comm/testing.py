"""Run a function in N local processes joined by a gloo process group (for tests and examples).

:func:`run_processes` spawns ``world_size`` fresh interpreters (start method ``spawn``: no forked torch
state), points them at ``127.0.0.1`` and a free port through the usual ``MASTER_ADDR``/``MASTER_PORT``/
``RANK``/``WORLD_SIZE`` variables, initializes ``torch.distributed`` with gloo, calls
``fn(rank, world_size, *args)`` and sends its return value back to the parent through a queue.

The parent returns the ranks' values in rank order, or re-raises the first failure as
:class:`ProcessFailure` whose message starts with the rank and carries the child's traceback. The whole run
is bounded by ``timeout_s``: on expiry every child still alive is killed and :class:`ProcessTimeout` names
the ranks that had not finished. ``fn`` and ``args`` must be picklable (a module-level function).

For fault tests on Linux: :func:`child_processes` lists a process's children (e.g. the stage processes of a
launcher, to freeze one with SIGSTOP) and :func:`listening_sockets` the TCP addresses a process listens on.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch.multiprocessing as mp

from aqsgd.comm.launch import free_port
from aqsgd.errors import AqsgdError

__all__ = ["ProcessFailure", "ProcessTimeout", "child_processes", "free_port", "listening_sockets",
           "run_processes"]

log = logging.getLogger(__name__)


class ProcessFailure(AqsgdError):
    """A rank raised an exception or exited without a result; the message names the rank."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (str(self), self.rank))


class ProcessTimeout(ProcessFailure, TimeoutError):
    """The ranks did not all finish within the run's timeout (they were killed)."""


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """The TCP sockets (IPv4 and IPv6) that process ``pid`` listens on, as ``(address, port)``: read from
    ``/proc/PID/net/tcp{,6}`` (the listening sockets of its network namespace) and kept if one of the
    process's file descriptors is the socket. Linux only; ``0.0.0.0`` or ``::`` means every interface."""
    import ipaddress

    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: TCP_LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # the kernel prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return sorted(found)


def child_processes(pid: int) -> list[int]:
    """The ids of the live processes whose parent is ``pid``, in increasing order (Linux ``/proc``)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            kids.append(int(entry))
    return sorted(kids)


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    pg_timeout_s: float,
    backend: str,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before it kills
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - everything a rank raises goes back to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    results.put((rank, True, value))
    # The result reaches the parent before the teardown: the queue's feeder thread writes it, and a
    # destroy_process_group that blocks holding the GIL (seen with torch 2.6's gloo once the peer had gone)
    # would keep it from ever doing so.
    results.close()
    results.join_thread()
    # Tear down without a collective: peers may already be gone, and a barrier here could hang.
    try:
        dist.destroy_process_group()
    except Exception:
        log.debug("rank %d: destroy_process_group failed", rank, exc_info=True)


def _dump_stacks(procs: Sequence[Any]) -> None:
    """Ask the ranks that did not finish to print every thread's stack to stderr (where the test's output is
    captured), so that a hang names where it hung; they are killed afterwards."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(1.0)


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    pg_timeout_s: float = 60.0,
    backend: str = "gloo",
    may_exit: Collection[int] = (),
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes and return their values.

    ``may_exit`` lists ranks allowed to end without a result (a test that kills a rank on purpose); their
    value is None. ``pg_timeout_s`` is the process group's own timeout; ``timeout_s`` bounds the whole run
    (spawning included). ``env`` adds environment variables in the children.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, tuple(args), results, pg_timeout_s, backend, dict(env or {})),
            name=f"aqsgd-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.05)
            except queue_mod.Empty:
                now = time.monotonic()
                for rank, p in enumerate(procs):
                    if rank in values or p.is_alive():
                        continue
                    # Give the queue's feeder a moment: a result may still be in flight after the exit.
                    first = exited_at.setdefault(rank, now)
                    if now - first < 1.0:
                        continue
                    if rank in may_exit:
                        values[rank] = None
                    else:
                        raise ProcessFailure(
                            f"rank {rank} exited with code {p.exitcode} without returning a result", rank
                        )
                if now > deadline:
                    missing = [r for r in range(world_size) if r not in values]
                    _dump_stacks([procs[r] for r in missing])
                    raise ProcessTimeout(
                        f"ranks {missing} did not finish within {timeout_s:g} s (killed)",
                        missing[0] if missing else None,
                    )
                continue
            if not ok:
                raise ProcessFailure(f"rank {rank} failed: {value}", rank)
            values[rank] = value
        finished = True
    finally:
        if finished:  # let the children tear down their process group; kill stragglers after a grace period
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    return [values[r] for r in range(world_size)]
