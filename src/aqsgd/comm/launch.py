"""Start N local processes through PyTorch's elastic launcher (the machinery behind ``torchrun``).

Ranks, world size and the rendezvous come from the launcher's environment, never hand-set; the rendezvous is a
c10d store on a free loopback port. A process that fails makes the launcher stop the others and raise
``ChildFailedError`` naming the failed rank.
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["launch_local"]


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
