"""Pipeline x data parallelism: the process grid, (compressed) gradient synchronization and outer steps."""

from aqsgd.parallel.grid import GridLayout, ProcessGrid
from aqsgd.parallel.outer import OuterSync, make_outer_sync
from aqsgd.parallel.sync import (
    GRAD_SYNC_HELP,
    AllReduceSync,
    GradSync,
    GradSyncSpec,
    PowerSGDSync,
    QuantizedSync,
    TopKSync,
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
    "OuterSync",
    "PowerSGDSync",
    "ProcessGrid",
    "QuantizedSync",
    "TopKSync",
    "allreduce_bytes",
    "make_grad_sync",
    "make_outer_sync",
    "parse_grad_sync",
]
