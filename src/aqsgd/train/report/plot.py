"""The report figure: :func:`plot_runs` draws four panels comparing loaded runs and writes one PNG.

matplotlib is imported when a figure is drawn, not with this module, so reading and comparing runs works
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aqsgd.errors import AqsgdError, ReportError
from aqsgd.train.report.reader import (
    HIGHER_IS_BETTER,
    Run,
    _finite,
    format_bytes,
    main_metric,
    select_baseline,
)

__all__ = ["plot_runs"]


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
    """Write one PNG with four panels and return its path.

    1. training loss vs step (warm-up steps shaded in the run's colour; a moving average over long runs),
    2. the main eval metric (``metric`` or :func:`main_metric`) vs step, compression on solid, off dashed
       (a run with eval results only in its summary shows them as one point at its last step),
    3. cumulative bytes sent vs step (log scale),
    4. total bytes sent per run, each bar annotated with how many times fewer bytes than the baseline (the
       ``baseline`` run or an uncompressed one) or, without either, the run's own compression ratio.

    Each run keeps its colour across panels; the legend below the panels names the runs.
    """
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    if not runs:
        raise ReportError("no runs to plot")
    out_png = Path(out_png)
    metric = metric or main_metric(runs)
    colors = _run_colors(runs)
    bytes_fmt = FuncFormatter(lambda x, _pos: format_bytes(x))

    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5), layout="constrained")
    ax_loss, ax_eval, ax_cum, ax_bar = axes.flat
    tasks = sorted({run.task for run in runs if run.task})
    fig.suptitle(f"aqsgd report{': ' + ', '.join(tasks) if tasks else ''}", fontsize=14, fontweight="bold")

    _draw_loss(ax_loss, ax_cum, runs, colors)
    _draw_eval(ax_eval, runs, colors, metric)
    _draw_cumulative_bytes(ax_cum, runs, colors, bytes_fmt)
    _draw_total_bytes(ax_bar, runs, colors, bytes_fmt, baseline)
    _draw_legend(fig, runs, colors)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    plt.close(fig)
    return out_png


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


def _draw_loss(ax_loss: Any, ax_cum: Any, runs: Sequence[Run], colors: dict[str, Any]) -> None:
    """Panel 1: training loss vs step; warm-up spans are shaded here and on the cumulative-bytes panel."""
    from matplotlib.patches import Patch

    spans: dict[tuple[int, int], list[Any]] = {}
    for run in runs:
        c = colors[run.name]
        pts = [(int(r["step"]), float(r["loss"])) for r in run.train_rows
               if _finite(r.get("loss")) is not None]
        if pts:
            steps, loss = [s for s, _ in pts], [v for _, v in pts]
            window = max(1, len(loss) // 50)
            if window > 1:
                ax_loss.plot(steps, loss, color=c, alpha=0.25, linewidth=0.8)
                ax_loss.plot(steps, _smooth(loss, window), color=c, linewidth=1.6)
            else:
                ax_loss.plot(steps, loss, color=c, linewidth=1.6, marker="." if len(loss) < 30 else None)
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


def _draw_eval(ax_eval: Any, runs: Sequence[Run], colors: dict[str, Any], metric: str | None) -> None:
    """Panel 2: the eval metric vs step, compression on (solid) and off (dashed)."""
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
    """Panel 3: cumulative bytes sent vs step, on a log scale when any run sent bytes."""
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
    """Panel 4: total bytes sent per run, one bar each (horizontal bars for more than six runs)."""
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
    """One legend below the panels naming each run and its setting."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[run.name], linewidth=3, label=f"{run.name} ({run.setting})")
               for run in runs]
    # as many columns as the longest label leaves room for across the figure (~170 characters at this size)
    widest = max(len(h.get_label()) for h in handles) + 6
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(len(runs), 4, 170 // widest)),
               frameon=False, fontsize=10 if len(runs) <= 10 else 9)
