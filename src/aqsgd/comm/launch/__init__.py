"""Launching a distributed job: the one place that decides how its processes start.

:func:`launch` runs a function as every rank of a job of N processes:

* **started as one rank already** (by ``torchrun`` across machines, or by a launcher that sets ``RANK`` and
  ``WORLD_SIZE`` as torchrun does, such as the network-namespace benchmark's): this process runs its own rank
  (:mod:`aqsgd.comm.launch.rank`), which its machine's node rank may place
  (:mod:`aqsgd.comm.launch.placement`);
* **otherwise** N processes are spawned on this machine through PyTorch's elastic launcher, bound to the
  loopback interface (:mod:`aqsgd.comm.launch.local`).

Either way each process computes on its share of its machine's cores (:mod:`aqsgd.comm.launch.threads`):
the run's ``--threads``, else ``OMP_NUM_THREADS`` (which torchrun sets to 1 where it starts several
processes per machine), else ``cores // processes on the machine``; the launcher says which in one line.

A failed run ends in one line naming the process at fault (:mod:`aqsgd.comm.launch.forensics`, with the
watchdog of :mod:`aqsgd.comm.launch.watchdog`); SIGINT or SIGTERM in :class:`~aqsgd.errors.Interrupted`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from aqsgd.comm.launch.forensics import RankOutcome, RootCause, find_root_cause
from aqsgd.comm.launch.local import LOOPBACK, address_towards, free_port, interface_of, launch_local
from aqsgd.comm.launch.rank import leave_process_group, run_as_rank, started_as_rank
from aqsgd.comm.launch.threads import ThreadShare, apply_threads, thread_share

__all__ = ["LOOPBACK", "RankOutcome", "RootCause", "address_towards", "find_root_cause", "free_port",
           "interface_of", "launch", "launch_local", "leave_process_group", "rank_thread_share",
           "run_as_rank", "started_as_rank"]

log = logging.getLogger(__name__)


def launch(fn: Callable[..., Any], world_size: int, *args: Any,
           before_spawn: Callable[[], None] | None = None,
           rank_names: Callable[[int], str] | None = None, threads: int | None = None,
           host: str = LOOPBACK) -> list[Any]:
    """``fn(*args)`` as every rank of a job of ``world_size`` processes; the values of the ranks that ran
    here, in rank order: all of them when they were spawned here, this process's alone when it was started as
    one rank (see the module docstring).

    ``before_spawn`` runs once in this process before it spawns the ranks (preparing what every rank would
    otherwise prepare at the same time: downloads, weights files); it does not run where each process is
    already a rank. ``rank_names`` names a rank in messages (``stage 1``). ``threads``: the threads each
    process computes with (default: its share of its machine's cores, see the module docstring). ``host``: the
    address of this machine that spawned ranks listen on (default 127.0.0.1: see
    :mod:`aqsgd.comm.launch.local`). Raises
    :class:`~aqsgd.errors.StageFailedError` naming the process at fault, or
    :class:`~aqsgd.errors.Interrupted`.
    """
    if started_as_rank():
        _take_rank_threads(threads)
        return [run_as_rank(fn, world_size, *args)]
    if before_spawn is not None:
        before_spawn()
    return launch_local(fn, world_size, *args, rank_names=rank_names, threads=threads, host=host)


def rank_thread_share(threads: int | None) -> ThreadShare:
    """A process started as one rank: its share among the ``LOCAL_WORLD_SIZE`` processes torchrun started on
    its machine (1 where the launcher does not say). What torchrun set (``OMP_NUM_THREADS``) is kept, unless
    ``threads`` is given."""
    return thread_share(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), threads=threads)


def _take_rank_threads(threads: int | None) -> None:
    """Apply :func:`rank_thread_share` before the rank's work (the run says it once it knows its stage)."""
    apply_threads(rank_thread_share(threads).threads)
