"""The report figure: :func:`report_figure` draws five panels comparing loaded runs, :func:`plot_runs` writes
them as one PNG.

matplotlib is imported when a figure is drawn, not with this module, so reading and comparing runs works
without it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aqsgd.errors import AqsgdError, ReportError
from aqsgd.train.report.files import write_replacing
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
    """Write the figure of :func:`report_figure` as one PNG (or the format its suffix names) and return its
    path. It is written beside and renamed: a path that cannot be written (a read-only folder, a full disk)
    raises :class:`ReportError` in one line and leaves no partial file."""
    plt = _pyplot()
    out_png = Path(out_png)
    fmt = out_png.suffix[1:].lower() or "png"
    fig = report_figure(runs, baseline=baseline, metric=metric)
    try:
        write_replacing(out_png, lambda f: fig.savefig(f, dpi=dpi, format=fmt), "figure", ReportError)
    finally:
        plt.close(fig)
    return out_png


def report_figure(runs: Sequence[Run], *, baseline: str | None = None, metric: str | None = None) -> Any:
    """The report's matplotlib figure (not written, not closed) with five panels, named in :data:`PANELS`:

    1. ``loss``: training loss vs step (warm-up steps shaded in the run's colour; a moving average over long
       runs),
    2. ``loss_time``: training loss vs wall time since the run's start, the sum of the steps' durations
       (:meth:`Run.wall_times`; a run whose rows record no durations is left out, with one warning naming it),
    3. ``eval``: the main eval metric (``metric`` or :func:`main_metric`) vs step: uncompressed (the model's
       quality) as filled circles on solid lines, through the run's compressed boundaries as hollow diamonds
       on dotted lines, for runs that have one (:attr:`Run.evaluates_compressed`; AQ-SGD's without a cache,
       which the legend says); every evaluation is a visible point, so a short run's one evaluation shows,
       and points of several runs at one place stay visible (see :func:`_draw_eval`); a run with eval
       results only in its summary shows them as one point at its last step,
    4. ``bytes``: cumulative bytes sent vs step (log scale),
    5. ``total_bytes``: total bytes sent per run, each bar annotated with how many times fewer bytes than the
       baseline (the ``baseline`` run or an uncompressed one) or, without either, the run's own compression
       ratio.

    Each run keeps its colour across panels; the legend below the panels names each run and its settings
    (:attr:`Run.settings_label`: codecs, stages, emulated link; no codecs where nothing was compressed).
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, MaxNLocator

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
    for name in ("loss", "eval", "bytes"):  # steps are whole: no 3.5 between the 4 steps of a short run
        ax[name].xaxis.set_major_locator(MaxNLocator(integer=True))
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


#: How each evaluation is drawn on the eval panel: uncompressed (the model's quality) as filled circles on
#: solid lines, through compressed boundaries as hollow diamonds on dotted lines, drawn above them (hollow:
#: an uncompressed point under one stays visible). On/off differ by marker, not only by line style.
_EVAL_STYLES = {
    "uncompressed": {"linestyle": "-", "marker": "o", "zorder": 3},
    "compressed": {"linestyle": ":", "marker": "D", "markerfacecolor": "none", "markeredgewidth": 1.6,
                   "zorder": 4},
}


def _marker_sizes(n: int, largest: float = 11.0, smallest: float = 6.0) -> list[float]:
    """Marker sizes for ``n`` runs in order, largest first: runs drawn later draw smaller markers on top, so
    runs with the same value at the same step show as rings around each other instead of one point."""
    if n <= 1:
        return [8.0] * n
    return [largest - (largest - smallest) * i / (n - 1) for i in range(n)]


def _eval_series(run: Run, metric: str, mode: str) -> tuple[list[int], list[float]]:
    """A run's values of ``metric`` in one evaluation mode, or its summary's final value as one point at its
    last step where no eval row has it."""
    steps, vals = run.metric_series(metric, mode)  # type: ignore[arg-type]
    final = run.final_eval(mode).get(metric)  # type: ignore[arg-type]
    if not steps and final is not None and run.steps is not None:
        steps, vals = [run.steps], [final]
    return steps, vals


#: A compressed evaluation more than this many times the largest uncompressed value of a lower-is-better
#: metric is marked above the scale (AQ-SGD's perplexity without a cache: thousands beside tens).
_OFF_SCALE = 3.0


def _off_scale_top(metric: str, off: Sequence[float], on: Sequence[float]) -> float | None:
    """The largest value the eval panel's scale must hold where some compressed values are far above every
    uncompressed one (:data:`_OFF_SCALE`) of a lower-is-better metric, or None where every value fits: on
    one scale with them the uncompressed values (the model's quality) would be indistinguishable."""
    if HIGHER_IS_BETTER.get(metric, True) or not off or min(off) <= 0:
        return None
    limit = _OFF_SCALE * max(off)
    return limit if any(v > limit for v in on) else None


def _mark_off_scale(ax: Any, points: Sequence[tuple[int, float]], color: Any) -> None:
    """Values above the panel's scale: a hollow triangle at its top edge at each step, the last one's value
    written under it."""
    top = ax.get_xaxis_transform()  # x in steps, y in the axes' fraction
    steps = [s for s, _ in points]
    ax.plot(steps, [0.96] * len(steps), transform=top, linestyle="none", marker="^", markersize=9,
            markerfacecolor="none", markeredgewidth=1.6, color=color, clip_on=False, zorder=5)
    step, value = points[-1]
    ax.annotate(f"{value:.4g}", (step, 0.96), xycoords=top, xytext=(0, -9), textcoords="offset points",
                ha="center", va="top", fontsize=8, color=color)


def _draw_eval(ax_eval: Any, runs: Sequence[Run], colors: dict[str, Any], metric: str | None) -> None:
    """Panel ``eval``: the eval metric vs step, uncompressed and, for runs with a compressed boundary,
    through it (see :data:`_EVAL_STYLES`), every evaluation a marker (:func:`_marker_sizes`). Compressed
    values far above the uncompressed ones are marked above the scale with their value
    (:func:`_off_scale_top`), so that the model's values stay readable."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if metric is None:
        ax_eval.text(0.5, 0.5, "no eval results", ha="center", va="center", transform=ax_eval.transAxes)
        ax_eval.set_title("eval")
        ax_eval.grid(alpha=0.3)
        return
    series = []
    for run, size in zip(runs, _marker_sizes(len(runs))):
        modes = ("uncompressed", "compressed") if run.evaluates_compressed else ("uncompressed",)
        for mode in modes:
            steps, vals = _eval_series(run, metric, mode)
            if steps:
                series.append((run, size, mode, steps, vals))
    by_mode: dict[str, list[float]] = {"uncompressed": [], "compressed": []}
    for _, _, mode, _, vals in series:
        by_mode[mode] += vals
    top = _off_scale_top(metric, by_mode["uncompressed"], by_mode["compressed"])
    for run, size, mode, steps, vals in series:
        # (over many evaluations a marker every few, about 15 a run)
        ax_eval.plot(steps, vals, color=colors[run.name], linewidth=1.4, markersize=size,
                     markevery=max(1, len(vals) // 15), label=f"{run.name} {mode}", **_EVAL_STYLES[mode])
    all_steps = [s for *_, steps, _ in series for s in steps]
    if all_steps and max(all_steps) - min(all_steps) < 2:  # one evaluation: a step either side, whole ticks
        ax_eval.set_xlim(min(all_steps) - 1, max(all_steps) + 1)
    direction = "higher" if HIGHER_IS_BETTER.get(metric, False) else "lower"
    ax_eval.set(title=f"eval {metric} ({direction} is better)", xlabel="step", ylabel=metric)
    values = [v for vals in by_mode.values() for v in vals if top is None or v <= top]
    if metric == "perplexity" and values and min(values) > 0 and max(values) / min(values) > 20:
        ax_eval.set_yscale("log")
        ax_eval.yaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
        if max(values) / min(values) > 1000:  # decades apart: label the decades only
            ax_eval.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax_eval.yaxis.set_minor_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    if top is not None:
        _limit_to(ax_eval, values)
        for run, _, mode, steps, vals in series:
            far = [(s, v) for s, v in zip(steps, vals) if v > top]
            if far:
                _mark_off_scale(ax_eval, far, colors[run.name])
    no_cache = any(run.evaluates_without_cache for run in runs)
    labels = {"uncompressed": "uncompressed (the model)",
              "compressed": "compressed boundaries" + ("\n(AQ-SGD: no cache)" if no_cache else "")}
    handles = [Line2D([], [], color="0.3", markersize=7, label=labels[mode],
                      **{k: v for k, v in _EVAL_STYLES[mode].items() if k != "zorder"})
               for mode in ("uncompressed", "compressed") if by_mode[mode]]
    if top is not None:
        handles.append(Line2D([], [], color="0.3", linestyle="none", marker="^", markersize=7,
                              markerfacecolor="none", markeredgewidth=1.6,
                              label="above the scale"))
    if handles:  # (narrow: beside the points of a short run, which stand in the middle)
        ax_eval.legend(handles=handles, loc="best", fontsize=8, handlelength=2.2)
    ax_eval.grid(alpha=0.3)


def _limit_to(ax: Any, values: Sequence[float]) -> None:
    """The y range of ``values``, with a margin below and a larger one above for the marks of the values
    above the scale (in log space on a log axis)."""
    log = ax.get_yscale() == "log"
    ys = [math.log10(v) for v in values] if log else list(values)
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.1 or (0.02 if log else abs(hi) * 0.05 or 1.0)
    lo, hi = lo - pad, hi + 3 * pad
    ax.set_ylim(*((10 ** lo, 10 ** hi) if log else (lo, hi)))


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
        return _times_fewer(ref_bytes / total)
    if run.compression_ratio:
        return f"{run.compression_ratio:.3g}x vs fp32"
    return ""


def _times_fewer(ratio: float) -> str:
    """``3.2x fewer`` bytes than the baseline for a ratio over 1, ``1.11x more`` under it (not ``0.902x
    fewer``), ``the same`` at 1 (to 3 digits)."""
    if f"{ratio:.3g}" == "1":
        return "the same"
    return f"{ratio:.3g}x fewer" if ratio > 1 else f"{1 / ratio:.3g}x more"


def _draw_total_bytes(ax_bar: Any, runs: Sequence[Run], colors: dict[str, Any], bytes_fmt: Any,
                      baseline: str | None) -> None:
    """Panel ``total_bytes``: total bytes sent per run, one bar each (horizontal bars for more than six
    runs)."""
    explicit = baseline is not None
    # without a named baseline, bytes compare with a run that sent its boundaries in full (a run of one stage,
    # the default baseline of the table, sent none)
    ref = select_baseline(runs, baseline) if explicit else next((r for r in runs if r.uncompressed), runs[0])
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
