"""The figures of the ``diloco`` study: what the replicas' sync sends, and how long a run takes over a slow
data-parallel link.

A run of the study trains on the distributed runtime with its sync links unpaced (loopback), and logs per
step the slowest stage's step seconds and the bytes each rank of every stage sent to its replicas. The time
over a link of ``mbit`` Mbit/s is then the measured step plus the sync's transfer at that speed:

    t_step = max_s step_s + max_s sync_bytes_s * 8 / (mbit * 1e6)

one full-duplex link per rank, as the paced sync emulates it (:class:`aqsgd.parallel.sync.GradSync` with
``--link``): a step ends when its slowest stage has sent its share. This replaces pacing every run: per-step
fp32 sync of a 2-stage MiniLM sends ~90 MB a rank a step, 24 s at 30 Mbit/s, hours for a study run; the
paced runtime gives the same step times (docs/training.md shows one run paced and modelled side by side).
What the model leaves out: the loopback all-reduce's own seconds are counted twice (measured in ``step_s``
and again as transfer), an overestimate of under a second per synced step, against the fp32 and q8 rows.

Time to target: the first step at which the mean training loss of the last ``window`` steps is at or below
the target, the same window's mean at the end of the per-step fp32 run of the same seed.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["LINK_MBIT", "WINDOW", "sync_curve", "elapsed", "target_loss", "time_to_target"]

#: the study's data-parallel link (the issue's slow link)
LINK_MBIT = 30.0
#: training steps whose mean loss is compared with the target
WINDOW = 20

#: a step of :func:`sync_curve`: (step, training loss or None, slowest stage's seconds, largest bytes a rank
#: of one stage sent to its replicas)
Step = tuple[int, "float | None", float, float]


def sync_curve(train_rows: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """The steps of a run's ``metrics.jsonl`` training rows (:class:`aqsgd.train.report.Run`.train_rows) as
    ``[step, loss, step_s, sync_bytes]`` lists (JSON-ready): the slowest stage's step seconds and the largest
    per-rank sync bytes over the stages (each stage's row is the mean over its replicas)."""
    out = []
    for r in train_rows:
        stages = r.get("stages") or []
        if not stages:
            continue
        out.append([int(r["step"]), r.get("loss"), max(float(s.get("step_s", 0.0)) for s in stages),
                     max(float(s.get("sync_bytes", 0.0)) for s in stages)])
    return out


def elapsed(curve: Sequence[Step], mbit: float = LINK_MBIT) -> list[float]:
    """Seconds from the start of training to the end of each step over ``mbit`` Mbit/s links (module
    docstring)."""
    if not mbit > 0:
        raise ValueError(f"the link's speed must be positive, got {mbit} Mbit/s")
    t, out = 0.0, []
    for _, _, step_s, sync_bytes in curve:
        t += step_s + 8.0 * sync_bytes / (mbit * 1e6)
        out.append(t)
    return out


def _window_means(curve: Sequence[Step], window: int) -> list[float | None]:
    """Per step, the mean loss of the last ``window`` steps with a loss (None before there are that many)."""
    if window < 1:
        raise ValueError(f"the window must be at least 1 step, got {window}")
    losses: list[float] = []
    out: list[float | None] = []
    for _, loss, _, _ in curve:
        if loss is not None:
            losses.append(float(loss))
        out.append(statistics.fmean(losses[-window:]) if len(losses) >= window else None)
    return out


def target_loss(curve: Sequence[Step], window: int = WINDOW) -> float | None:
    """The mean training loss of the last ``window`` steps (None for a run shorter than that)."""
    means = _window_means(curve, window)
    return means[-1] if means else None


def time_to_target(curve: Sequence[Step], target: float, mbit: float = LINK_MBIT,
                   window: int = WINDOW) -> tuple[int, float] | None:
    """The first step whose ``window``-step mean loss is at most ``target`` and the seconds to its end over
    ``mbit`` Mbit/s links; None if the run never gets there."""
    times = elapsed(curve, mbit)
    for (step, *_), mean, t in zip(curve, _window_means(curve, window), times):
        if mean is not None and mean <= target:
            return step, t
    return None
