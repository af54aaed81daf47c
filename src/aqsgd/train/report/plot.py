"""The report figure: :func:`report_figure` draws five panels comparing loaded runs, :func:`plot_runs` writes
them as one PNG.

matplotlib is imported when a figure is drawn, not with this module, so reading and comparing runs works
without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aqsgd.errors import AqsgdError, ReportError
from aqsgd.train.report.reader import (
    HIGHER_IS_BETTER,
    Run,
    format_bytes,
    main_metric,
    select_baseline,
)

__all__ = ["PANELS", "plot_runs", "report_figure"]

log = logging.getLogger(__name__)

#: The panels of the figure, each axes labelled with its name (``ax.get_label()``), in this order in
#: ``fig.axes``: loss against steps and against wall time side by side, then the eval metric, cumulative
#: bytes and total bytes.
PANELS: tuple[str, ...] = ("loss", "loss_time", "eval", "bytes", "total_bytes")
_LAYOUT = [["loss", "loss", "loss_time", "loss_time", "eval", "eval"],
           ["bytes", "bytes", "bytes", "total_bytes", "total_bytes", "total_bytes"]]
_FIGSIZE = (16.0, 9.5)


def _smooth(vals: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(vals):
        acc += v
        if i >= window:
            acc -= vals[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_runs(runs: Sequence[Run], out_png: str | Path, *, baseline: str | None = None,
              metric: str | None = None, dpi: int = 110) -> Path:
    """Write the figure of :func:`report_figure` as one PNG and return its path."""
    plt = _pyplot()
    fig = report_figure(runs, baseline=baseline, metric=metric)
    try:
        out_png = Path(out_png)
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, dpi=dpi)
    finally:
        plt.close(fig)
    return out_png


def report_figure(runs: Sequence[Run], *, baseline: str | None = None, metric: str | None = None) -> Any:
    """The report's matplotlib figure (not written, not closed) with five panels, named in :data:`PANELS`:

    1. ``loss``: training loss vs step (warm-up steps shaded in the run's colour; a moving average over long
       runs),
    2. ``loss_time``: training loss vs wall time since the run's start, the sum of the steps' durations
       (:meth:`Run.wall_times`; a run whose rows record no durations is left out, with one warning naming it),
    3. ``eval``: the main eval metric (``metric`` or :func:`main_metric`) vs step, compression on solid, off
       dashed (a run with eval results only in its summary shows them as one point at its last step),
    4. ``bytes``: cumulative bytes sent vs step (log scale),
    5. ``total_bytes``: total bytes sent per run, each bar annotated with how many times fewer bytes than the
       baseline (the ``baseline`` run or an uncompressed one) or, without either, the run's own compression
       ratio.

    Each run keeps its colour across panels; the legend below the panels names each run and its settings
    (:attr:`Run.settings_label`: codecs, stages, emulated link).
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    if not runs:
        raise ReportError("no runs to plot")
    metric = metric or main_metric(runs)
    colors = _run_colors(runs)
    bytes_fmt = FuncFormatter(lambda x, _pos: format_bytes(x))

    fig, ax = plt.subplot_mosaic(_LAYOUT, figsize=_FIGSIZE, layout="constrained")
    for name in PANELS:
        ax[name].set_label(name)
    tasks = sorted({run.task for run in runs if run.task})
    fig.suptitle(f"aqsgd report{': ' + ', '.join(tasks) if tasks else ''}", fontsize=14, fontweight="bold")

    _draw_loss(ax["loss"], ax["bytes"], runs, colors)
    _draw_loss_vs_time(ax["loss_time"], ax["loss"], runs, colors)
    _draw_eval(ax["eval"], runs, colors, metric)
    _draw_cumulative_bytes(ax["bytes"], runs, colors, bytes_fmt)
    _draw_total_bytes(ax["total_bytes"], runs, colors, bytes_fmt, baseline)
    _draw_legend(fig, runs, colors)
    return fig


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; :class:`AqsgdError` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a test dependency
        raise AqsgdError("aqsgd report needs matplotlib: pip install matplotlib") from e
    return plt


def _run_colors(runs: Sequence[Run]) -> dict[str, Any]:
    """One colour per run name: the default cycle for up to 10 runs, else tab20 (repeating after 20)."""
    import matplotlib

    if len(runs) <= 10:
        return {run.name: f"C{i}" for i, run in enumerate(runs)}
    # the default cycle repeats after 10: take distinct colours from tab20 (then repeat after 20)
    cmap = matplotlib.colormaps["tab20"]
    return {run.name: cmap(i % 20) for i, run in enumerate(runs)}


def _draw_curve(ax: Any, xs: Sequence[float], ys: Sequence[float], color: Any) -> None:
    """One run's loss curve: over many points the raw values faint under a moving average, over few the
    values themselves (with markers under 30 points)."""
    window = max(1, len(ys) // 50)
    if window > 1:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(xs, _smooth(ys, window), color=color, linewidth=1.6)
    else:
        ax.plot(xs, ys, color=color, linewidth=1.6, marker="." if len(ys) < 30 else None)


def _draw_loss(ax_loss: Any, ax_cum: Any, runs: Sequence[Run], colors: dict[str, Any]) -> None:
    """Panel ``loss``: training loss vs step; warm-up spans are shaded here and on the cumulative-bytes
    panel."""
    from matplotlib.patches import Patch

    spans: dict[tuple[int, int], list[Any]] = {}
    for run in runs:
        c = colors[run.name]
        steps, loss = run.loss_series()
        if steps:
            _draw_curve(ax_loss, steps, loss, c)
        span = run.warmup_span()
        if span is not None:
            spans.setdefault(tuple(span), []).append(c)
    # each distinct warm-up span once: in its run's colour, or grey when several runs share it (stacked
    # translucent spans of many runs would darken into an opaque block)
    for (lo, hi), span_colors in spans.items():
        shared = len(span_colors) > 1
        for ax in (ax_loss, ax_cum):
            ax.axvspan(lo, hi, color="0.5" if shared else span_colors[0], alpha=0.2 if shared else 0.10,
                       linewidth=0)
    any_warmup = bool(spans)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    if any_warmup:
        ax_loss.legend(handles=[Patch(color="0.5", alpha=0.25, label="warm-up steps")], loc="upper right")
    ax_loss.grid(alpha=0.3)


def _time_unit(seconds: float) -> tuple[float, str]:
    """The seconds in one unit, and its name, to show times up to ``seconds`` in: s up to 2 minutes, min up
    to 2 hours, else h."""
    if seconds > 7200:
        return 3600.0, "h"
    if seconds > 120:
        return 60.0, "min"
    return 1.0, "s"


def _draw_loss_vs_time(ax: Any, ax_loss: Any, runs: Sequence[Run], colors: dict[str, Any]) -> None:
    """Panel ``loss_time``: training loss vs wall time since the run's start, on the loss panel's y-axis.
    Runs without step durations are left out and named in one warning."""
    untimed = [run.name for run in runs if not run.has_wall_times]
    if untimed:
        log.warning("no wall times (step durations, time.step in metrics.jsonl) in run%s %s: left out of the "
                    "loss against wall time panel", "s" if len(untimed) > 1 else "", ", ".join(untimed))
    series = {run.name: run.loss_vs_time() for run in runs}
    scale, unit = _time_unit(max((t[-1] for t, _ in series.values() if t), default=0.0))
    for run in runs:
        seconds, loss = series[run.name]
        if seconds:
            _draw_curve(ax, [t / scale for t in seconds], loss, colors[run.name])
    if ax.lines:
        ax.sharey(ax_loss)
    else:
        ax.text(0.5, 0.5, "no step times recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="training loss against wall time", xlabel=f"wall time ({unit}, sum of step times)",
           ylabel="loss")
    ax.grid(alpha=0.3)


def _draw_eval(ax_eval: Any, runs: Sequence[Run], colors: dict[str, Any], metric: str | None) -> None:
    """Panel ``eval``: the eval metric vs step, compression on (solid) and off (dashed)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if metric is None:
        ax_eval.text(0.5, 0.5, "no eval results", ha="center", va="center", transform=ax_eval.transAxes)
        ax_eval.set_title("eval")
    else:
        values: list[float] = []
        for run in runs:
            for mode, style in (("compressed", "-"), ("uncompressed", "--")):
                steps, vals = run.metric_series(metric, mode)  # type: ignore[arg-type]
                final = run.final_eval(mode).get(metric)  # type: ignore[arg-type]
                if not steps and final is not None and run.steps is not None:  # only a summary: one point
                    steps, vals = [run.steps], [final]
                values += vals
                if steps:
                    ax_eval.plot(steps, vals, linestyle=style, color=colors[run.name], linewidth=1.6,
                                 marker="o" if len(vals) < 30 else None, markersize=3.5)
        direction = "higher" if HIGHER_IS_BETTER.get(metric, False) else "lower"
        ax_eval.set(title=f"eval {metric} ({direction} is better)", xlabel="step", ylabel=metric)
        if metric == "perplexity" and values and min(values) > 0 and max(values) / min(values) > 20:
            ax_eval.set_yscale("log")
            ax_eval.yaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
            if max(values) / min(values) > 1000:  # decades apart: label the decades only
                ax_eval.yaxis.set_minor_formatter(NullFormatter())
            else:
                ax_eval.yaxis.set_minor_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax_eval.legend(handles=[Line2D([], [], color="0.3", linestyle="-", label="compression on"),
                                Line2D([], [], color="0.3", linestyle="--", label="compression off")],
                       loc="best")
    ax_eval.grid(alpha=0.3)


def _draw_cumulative_bytes(ax_cum: Any, runs: Sequence[Run], colors: dict[str, Any], bytes_fmt: Any) -> None:
    """Panel ``bytes``: cumulative bytes sent vs step, on a log scale when any run sent bytes."""
    from matplotlib.ticker import LogLocator, NullFormatter

    for run in runs:
        steps, cum = run.cumulative("bytes_sent")
        if steps and max(cum) > 0:
            ax_cum.plot(steps, cum, color=colors[run.name], linewidth=1.6)
    ax_cum.set(title="cumulative bytes sent (all boundaries)", xlabel="step", ylabel="bytes sent")
    if ax_cum.lines:
        ax_cum.set_yscale("log")
        # labelled ticks at 1, 2, 5 x 10^k, in bytes (the default labels only the decades, and its minor
        # labels are in scientific notation next to major labels in MB)
        ax_cum.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax_cum.yaxis.set_minor_formatter(NullFormatter())
    ax_cum.yaxis.set_major_formatter(bytes_fmt)
    ax_cum.grid(alpha=0.3, which="major")


def _bar_note(run: Run, ref: Run, ref_bytes: float | None, total: float) -> str:
    """The note under a run's total: ``baseline``, the times fewer bytes than it, or the run's own ratio."""
    if run is ref and ref_bytes:
        return "baseline"
    if ref_bytes and total:
        return f"{ref_bytes / total:.3g}x fewer"
    if run.compression_ratio:
        return f"{run.compression_ratio:.3g}x vs fp32"
    return ""


def _draw_total_bytes(ax_bar: Any, runs: Sequence[Run], colors: dict[str, Any], bytes_fmt: Any,
                      baseline: str | None) -> None:
    """Panel ``total_bytes``: total bytes sent per run, one bar each (horizontal bars for more than six
    runs)."""
    explicit = baseline is not None
    ref = select_baseline(runs, baseline)
    ref_bytes = ref.total_bytes if (explicit or ref.uncompressed) else None
    names = [run.name for run in runs]
    totals = [run.total_bytes or 0.0 for run in runs]
    horizontal = len(runs) > 6  # many runs: one row per run, so the names and notes stay readable
    draw_bars = ax_bar.barh if horizontal else ax_bar.bar
    bars = draw_bars(range(len(runs)), totals, color=[colors[n] for n in names])
    for run, bar, total in zip(runs, bars, totals):
        note = _bar_note(run, ref, ref_bytes, total)
        if horizontal:
            ax_bar.annotate(f"{format_bytes(total)}  {note}".strip(),
                            (total, bar.get_y() + bar.get_height() / 2),
                            xytext=(3, 0), textcoords="offset points", ha="left", va="center", fontsize=8)
        else:
            ax_bar.annotate(f"{format_bytes(total)}\n{note}".strip(),
                            (bar.get_x() + bar.get_width() / 2, total),
                            xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=9)
    if horizontal:
        ax_bar.set_yticks(range(len(runs)), names, fontsize=8)
        ax_bar.invert_yaxis()  # first run on top, in legend order
        ax_bar.set_xlim(0, max(totals + [1.0]) * 1.45)
        ax_bar.xaxis.set_major_formatter(bytes_fmt)
    else:
        ax_bar.set_xticks(range(len(runs)), names, rotation=15 if len(runs) > 3 else 0)
        ax_bar.set_ylim(0, max(totals + [1.0]) * 1.2)
        ax_bar.yaxis.set_major_formatter(bytes_fmt)
    subtitle = f"ratio vs {ref.name}" if ref_bytes else "ratio vs fp32 (raw bytes)"
    ax_bar.set(title=f"total bytes sent ({subtitle})")
    if horizontal:
        ax_bar.set_xlabel("bytes sent")
    else:
        ax_bar.set_ylabel("bytes sent")
    ax_bar.grid(alpha=0.3, axis="x" if horizontal else "y")


def _draw_legend(fig: Any, runs: Sequence[Run], colors: dict[str, Any]) -> None:
    """One legend below the panels naming each run and its settings (:attr:`Run.settings_label`)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[run.name], linewidth=3, label=f"{run.name} ({run.settings_label})")
               for run in runs]
    # as many columns as the longest label leaves room for across the figure (~12 characters an inch)
    widest = max(len(h.get_label()) for h in handles) + 6
    room = round(12 * fig.get_figwidth())
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(len(runs), 4, room // widest)),
               frameon=False, fontsize=10 if len(runs) <= 10 else 9)
