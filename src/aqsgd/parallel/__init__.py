"""Pipeline x data parallelism: the process grid and (compressed) gradient synchronization."""

from aqsgd.parallel.grid import GridLayout, ProcessGrid
from aqsgd.parallel.sync import (
    GRAD_SYNC_HELP,
    AllReduceSync,
    GradSync,
    GradSyncSpec,
    PowerSGDSync,
    QuantizedSync,
    allreduce_bytes,
    make_grad_sync,
    parse_grad_sync,
)

__all__ = [
    "GRAD_SYNC_HELP",
    "AllReduceSync",
    "GradSync",
    "GradSyncSpec",
    "GridLayout",
    "PowerSGDSync",
    "ProcessGrid",
    "QuantizedSync",
    "allreduce_bytes",
    "make_grad_sync",
    "parse_grad_sync",
]
