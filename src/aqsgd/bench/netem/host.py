"""What the netem benchmark needs of the host: root, the ``ip``/``tc`` tools of iproute2 and a kernel with
veth, bridge and ``sch_tbf`` (:func:`netem_unavailable_reason` probes once; :class:`NetemUnavailable` says
what is missing), the commands that build and shape namespaces (:func:`run_cmd`, :class:`NetemError` when one
fails), and the clean-up of namespaces that a killed run left behind (:func:`cleanup_stale`).

Namespace names are ``aqsgd-<pid>-<random>-...`` (:data:`PREFIX`): the creating process's id tells a stale
namespace from a live one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from aqsgd.errors import AqsgdError

__all__ = [
    "PREFIX",
    "NetemError",
    "NetemUnavailable",
    "check_netem",
    "cleanup_stale",
    "kill_namespace_processes",
    "netem_unavailable_reason",
    "run_cmd",
]

log = logging.getLogger("aqsgd.bench.netem.cluster")  # the cluster's logger: one name for its messages

PREFIX = "aqsgd-"


class NetemUnavailable(AqsgdError, RuntimeError):
    """Network namespaces or ``tc`` shaping cannot be used here (not root, ``ip``/``tc`` missing, or the
    kernel refuses); the message says which and how to fix it."""


class NetemError(AqsgdError, RuntimeError):
    """An ``ip``/``tc`` command failed while building or shaping the namespaces (the message has its
    command line and stderr)."""


def run_cmd(argv: Sequence[str], *, check: bool = True,
             timeout: float = 30.0) -> subprocess.CompletedProcess:
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
            run_cmd(["ip", "netns", "add", name])
            try:
                run_cmd(["ip", "-n", name, "link", "set", "dev", "lo", "up"])
                run_cmd(["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
                run_cmd(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
                run_cmd(["tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit",
                          "burst", "4096", "limit", "65536"])
            finally:
                run_cmd(["ip", "netns", "del", name], check=False)
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
    out = run_cmd(["ip", "netns", "list"], check=False).stdout
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
        kill_namespace_processes(name)
        if run_cmd(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    if removed:
        log.info("removed stale namespaces: %s", ", ".join(removed))
    return removed


def kill_namespace_processes(name: str) -> None:
    pids = run_cmd(["ip", "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
