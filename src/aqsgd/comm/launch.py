"""Start N local processes through PyTorch's elastic launcher (the machinery behind ``torchrun``).

Ranks, world size and the rendezvous come from the launcher's environment, never hand-set; the rendezvous is a
c10d store on a free loopback port. A process that fails makes the launcher stop the others and raise
``ChildFailedError`` naming the failed rank.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable

__all__ = ["launch_local", "leave_process_group"]

log = logging.getLogger(__name__)


def launch_local(fn: Callable[..., Any], nprocs: int, *args: Any, run_id: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` spawned processes on this machine; their return values in rank order.
    ``fn`` must be a picklable module-level function that initializes ``torch.distributed`` from the environment."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from aqsgd.comm.testing import free_port

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=run_id or f"aqsgd-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    out = elastic_launch(config, fn)(*args)
    return [out[r] for r in sorted(out)]


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
