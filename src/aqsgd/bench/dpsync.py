"""The figures of the ``diloco`` study: what the replicas' sync sends, and how long a run takes over a slow
data-parallel link.

A run of the study trains on the distributed runtime with its sync links unpaced (loopback), and logs per
step the slowest stage's step seconds and the bytes each rank of every stage sent to its replicas. The time
over a link of ``mbit`` Mbit/s is then the measured step plus the sync's transfer at that speed:

    t_step = max_s step_s + max_s sync_bytes_s * 8 / (mbit * 1e6)

one full-duplex link per rank, as the paced sync emulates it (:class:`aqsgd.parallel.sync.GradSync` with
``--link`` or ``--dp-link``): a step ends when its slowest stage has sent its share. This replaces pacing
every run: per-step fp32 sync of the 2-stage MiniLM sends 69 MB a rank a step from stage 0, 18 s at 30
Mbit/s, an hour for a study run of 200 steps; docs/training.md sets one run paced beside its model. What the
model leaves out: the loopback all-reduce's own seconds are counted twice (measured in ``step_s`` and again
as transfer), an overestimate of under a second per synced step, against the fp32 and q8 rows.

Time to target: the end of the first step whose evaluation loss (compression off) is at or below the target,
the final evaluation loss of the per-step fp32 run of the same seed. An evaluation, not the training loss:
between DiLoCo's outer steps each replica trains alone on its own shard, and its training loss falls far
below what the averaged model reaches (MiniLM-BBC, seed 0, ``diloco:50:q8``: 0.0005 at the last step against
fp32's 0.01, at 2.5 points less accuracy); the study's evaluations fall on the outer steps (every epoch of 50
steps), so they see the weights the replicas agreed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["LINK_MBIT", "sync_curve", "elapsed", "sync_delay", "eval_losses", "bytes_per_step",
           "time_to_target", "plot_sync"]

#: the study's data-parallel link (the issue's slow link)
LINK_MBIT = 30.0

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


def elapsed(curve: Sequence[Step], mbit: float = LINK_MBIT, delay: int = 0) -> list[float]:
    """Seconds from the start of training to the end of each step over ``mbit`` Mbit/s links (module
    docstring). ``delay`` (streaming's overlap, ``diloco:...:delay<T>``): the bytes a step logs (but the last
    step's) left ``delay`` steps earlier and crossed the link while those steps computed, one transfer at a
    time; the step waits only for what is left of its transfer."""
    if not mbit > 0:
        raise ValueError(f"the link's speed must be positive, got {mbit} Mbit/s")
    t, free, out = 0.0, 0.0, []
    for k, (_, _, step_s, sync_bytes) in enumerate(curve):
        transfer = 8.0 * sync_bytes / (mbit * 1e6)
        if delay and sync_bytes and delay <= k < len(curve) - 1:
            free = max(out[k - delay], free) + transfer  # sent from the end of the step that began it
            t = max(t + step_s, free)
        else:
            t += step_s + transfer
        out.append(t)
    return out


def sync_delay(record: dict[str, Any]) -> int:
    """The steps a study record's outer steps overlap their sync with (0: none, or no outer steps)."""
    from aqsgd.parallel.sync import parse_grad_sync

    spec = (record.get("summary") or {}).get("grad_sync")
    return parse_grad_sync(spec).delay if spec else 0


def _times(curve: Sequence[Step], mbit: float, delay: int = 0) -> dict[int, float]:
    """:func:`elapsed` by step."""
    return dict(zip((s[0] for s in curve), elapsed(curve, mbit, delay)))


def eval_losses(record: dict[str, Any]) -> list[tuple[int, float | None]]:
    """A study record's evaluations as ``(step, loss)`` pairs, compression off."""
    return [(e["step"], (e.get("uncompressed") or {}).get("loss")) for e in record.get("eval", [])]


def bytes_per_step(record: dict[str, Any]) -> float:
    """A study record's sync bytes per step, every rank's summed."""
    return record["summary"]["grad_sync_bytes"] / max(record["summary"]["steps"], 1)


def time_to_target(curve: Sequence[Step], evals: Sequence[tuple[int, float]], target: float,
                   mbit: float = LINK_MBIT, delay: int = 0) -> tuple[int, float] | None:
    """The step of the first evaluation (``(step, loss)`` pairs, in order) whose loss is at most ``target``,
    and the seconds to that step's end over ``mbit`` Mbit/s links (``delay``: :func:`elapsed`'s); None if no
    evaluation gets there."""
    times = _times(curve, mbit, delay)
    for step, loss in evals:
        if loss is not None and loss <= target and step in times:
            return step, times[step]
    return None


def plot_sync(runs: dict[str, dict[str, Any]], png: Any, mbit: float = LINK_MBIT, title: str = "") -> Any:
    """Two panels from a study's seed-0 records (``{setting: record}``, each with a ``sync_curve``): the
    evaluation loss (compression off) against the time over ``mbit`` Mbit/s links, and the sync's bytes per
    step (every rank's, summed) of each setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = [n for n, r in runs.items() if r.get("sync_curve")]
    tab20 = plt.get_cmap("tab20").colors  # more settings than the default cycle's 10 colours
    colors = [tab20[(2 * i) % 20 + (2 * i) // 20 % 2] for i in range(len(names))]
    for name, color in zip(names, colors):
        times = _times(runs[name]["sync_curve"], mbit, sync_delay(runs[name]))
        points = [(times[step] / 60, loss) for step, loss in eval_losses(runs[name])
                  if step in times and loss is not None]
        if points:
            left.plot(*zip(*points), marker="o", label=name, color=color)
    left.set_xscale("log")
    left.set_xlabel(f"minutes over a {mbit:g} Mbit/s data-parallel link (measured steps + sync transfer)")
    left.set_ylabel("evaluation loss (the replicas' agreed weights)")
    left.set_title("evaluation loss against time")
    if left.lines:
        left.legend(fontsize=7)
    right.barh(names, [bytes_per_step(runs[n]) / 1e6 for n in names], color=colors)
    right.set_xscale("log")
    right.invert_yaxis()
    right.set_xlabel("MB per step, every rank's sync summed")
    right.set_title("what the replicas' sync sends")
    right.tick_params(axis="y", labelsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
