"""Timing helpers: warm-up excluded, repeats interleaved across variants, medians reported."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["interleaved_medians", "sync"]


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
