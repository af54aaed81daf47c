"""``--trace``: one training step profiled with :mod:`torch.profiler` (the runner labels every schedule
action), written as a chrome trace: ``trace.json`` locally, ``trace.stage<i>[.replica<r>].json`` per process
of a distributed run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["profiled", "trace_name"]


def trace_name(stage: int | None, replica: int | None) -> str:
    """The trace file's name for a process (``stage`` None: the local runtime; ``replica`` None: no data
    parallelism)."""
    name = "trace"
    if stage is not None:
        name += f".stage{stage}" + (f".replica{replica}" if replica is not None else "")
    return f"{name}.json"


@contextlib.contextmanager
def profiled(on: bool, device: torch.device, path: Path) -> Iterator[None]:
    """Profile the enclosed code (where ``on``) and write its chrome trace to ``path``."""
    if not on:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
