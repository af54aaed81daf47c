"""Timing helpers: warm-up excluded, repeats interleaved across variants, medians reported; the allocator
held warm where a call's own allocation would otherwise be timed as page faults."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import statistics
import time
from collections.abc import Iterator
from typing import Callable

import torch

__all__ = ["interleaved_medians", "minor_faults", "sync", "warm_allocator"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_GLIBC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}


def minor_faults() -> int:
    """This process's minor page faults so far (a first touch of a page the kernel had to map)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextlib.contextmanager
def warm_allocator() -> Iterator[bool]:
    """Inside the block, glibc serves every allocation from its heap and keeps what is freed (no ``mmap``, no
    trimming), so that once the heap has grown to the calls' working set (a few calls: the warm-up's), a
    tensor allocated anew in each timed call reuses pages already mapped. Otherwise whether a call of a
    12.6 MB result maps fresh pages depends on the process's history (glibc's dynamic ``mmap`` threshold,
    trimming): the same ``x.clone()`` was measured at 0.5 ms in one process and 3.8 ms in
    another on one machine, its page faults timed as the copy. Yields whether it could (glibc only); after the
    block glibc's defaults are set back (fixed ones: the dynamic threshold stays off in this process)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        yield False
        return
    mallopt(_M_MMAP_MAX, 0)
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield True
    finally:
        for param, value in _GLIBC_DEFAULTS.items():
            mallopt(param, value)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, device: torch.device, warmup: int = 3,
                        repeats: int = 15) -> dict[str, float]:
    """Median seconds per call of each function. Every repeat runs all functions once, in turn, so that
    drifting machine load hits all variants alike (ratios between them are what the benchmarks report)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}
