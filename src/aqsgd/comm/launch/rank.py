"""This process as one rank of a distributed job: whether it was started as one, running a job's function as
it, and leaving the process group at the end.

A process started by ``torchrun`` (or by :func:`~aqsgd.comm.launch.local.launch_local`, or by any launcher
that sets ``RANK`` and ``WORLD_SIZE`` the way torchrun does, such as the network-namespace benchmark) is one
rank of a job: it runs its own part and nothing else.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from aqsgd.errors import ConfigMismatchError

__all__ = ["started_as_rank", "run_as_rank", "leave_process_group", "exit_without_finalizing"]

log = logging.getLogger(__name__)


def started_as_rank() -> bool:
    """Whether this process was started as one rank of a job (torchrun, or a launcher that sets ``RANK`` and
    ``WORLD_SIZE``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_as_rank(fn: Callable[..., Any], world_size: int, *args: Any) -> Any:
    """``fn(*args)`` as this process's rank of a job of ``world_size`` processes (:func:`started_as_rank`).

    A world of another size is a :class:`~aqsgd.errors.ConfigMismatchError`. If ``fn`` raises, the exception
    goes on to the caller (who reports it), and the process then ends without the interpreter's teardown,
    with the exception's ``exit_code`` (1 for an exception without one): a transport thread may still be
    blocked in gloo, and tearing gloo down under it would abort the process with a fatal-error dump."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != world_size:
        raise ConfigMismatchError(f"{world} processes were started (WORLD_SIZE) for a job of {world_size}: "
                                  f"start exactly stages x data_parallel = {world_size} processes (one per "
                                  "stage and replica)")
    try:
        return fn(*args)
    except BaseException as e:
        code = getattr(e, "exit_code", None)
        atexit.register(exit_without_finalizing, code if isinstance(code, int) else 1)
        raise


def exit_without_finalizing(code: int = 0) -> None:
    """End a process whose job failed without running the interpreter's and C++'s teardown: a transport
    thread may still be blocked inside gloo, and destroying gloo's objects under it aborts the process
    ("terminate called without an active exception", a fatal-error dump on stderr). Registered with
    ``atexit`` by the failure paths only, once the failure is reported."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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
