"""``aqsgd report RUN_DIR...``: compare training runs in one table and one figure.

A training run writes a run directory::

    RUN_DIR/config.json     the resolved config: {"task", "forward": "delta:q2", "backward": "direct:q4", ...}
    RUN_DIR/metrics.jsonl   one JSON object per line: {"kind": "train", ...} and {"kind": "eval", ...} rows
    RUN_DIR/summary.json    written at the end: final metrics, bytes, compression ratio, throughput

Only ``metrics.jsonl`` is required; ``config.json`` and ``summary.json`` (absent while a run is still going)
are optional, and every value taken from the summary falls back to one derived from the rows. Lines of
``metrics.jsonl`` that are not valid rows (a truncated last line, a bad value) are skipped and counted;
rows of another ``kind`` are ignored.

Use from Python::

    runs = [load_run("runs/fp32"), load_run("runs/aqsgd", label="AQ-SGD q2")]
    rows = comparison_table(runs)            # one dict per run, see comparison_table()
    plot_runs(runs, "report.png")            # 4 panels: loss, eval metric, cumulative bytes, total bytes

or wire the command into a parser with :func:`register_cli`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aqsgd.errors import AqsgdError, ReportError

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC_PRIORITY",
    "Run",
    "comparison_table",
    "is_uncompressed",
    "load_run",
    "main_metric",
    "plot_runs",
    "register_cli",
    "run_report",
    "select_baseline",
]

log = logging.getLogger(__name__)

#: Eval metrics in the order the "main" metric is picked from what the runs report (see :func:`main_metric`).
METRIC_PRIORITY: tuple[str, ...] = ("accuracy", "mcc", "perplexity", "loss")
HIGHER_IS_BETTER = {"accuracy": True, "mcc": True, "perplexity": False, "loss": False}
_SCHEMES = ("direct", "delta", "ef", "ef21")
_UNCOMPRESSED_CODECS = ("none", "fp32")

Mode = Literal["compressed", "uncompressed"]
MODES: tuple[Mode, Mode] = ("compressed", "uncompressed")
ByteKey = Literal["bytes_sent", "raw_bytes"]


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x: object) -> float | None:
    """``x`` as a float if it is a finite number, else None."""
    if _is_number(x) and math.isfinite(float(x)):  # type: ignore[arg-type]
        return float(x)  # type: ignore[arg-type]
    return None


def is_uncompressed(spec: str | None) -> bool:
    """Whether a boundary setting sends full precision: ``none``/``fp32``, optionally after a scheme name
    (``direct:fp32``, ``direct:none``). ``None`` (unknown) is not uncompressed."""
    if not spec:
        return False
    head, _, rest = spec.strip().partition(":")
    codec = rest if head in _SCHEMES and rest else head
    return codec in _UNCOMPRESSED_CODECS


def _close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1.0)


def _accumulate(points: Sequence[tuple[int, float]], total: float | None) -> list[float]:
    """Running totals of a per-row byte counter that may be cumulative or per step.

    The counter is taken as cumulative when it never decreases and either its last value matches the
    summary's ``total`` (when there is one and the row sum does not) or it strictly increases. Otherwise
    each value is the bytes of one step, and it counts for every step since the previous logged row (exact
    when every step is logged).
    """
    vals = [v for _, v in points]
    if all(b >= a for a, b in itertools.pairwise(vals)):
        if total is not None and total > 0 and _close(vals[-1], total) and not _close(sum(vals), total):
            return vals
        increasing = all(b > a for a, b in itertools.pairwise(vals))
        if increasing and (total is None or not _close(sum(vals), total)):
            return vals
    out: list[float] = []
    acc, prev = 0.0, None
    for step, v in points:
        acc += v * (1 if prev is None else max(1, step - prev))
        prev = step
        out.append(acc)
    return out


@dataclass
class Run:
    """One run directory, loaded.

    ``train_rows`` and ``eval_rows`` are the valid ``metrics.jsonl`` rows of each kind in file order;
    ``summary`` is ``{}`` when there is no ``summary.json`` (a run still going), ``config`` likewise.
    ``skipped_lines`` counts the lines of ``metrics.jsonl`` that were not valid rows.
    """

    name: str
    path: Path
    config: dict[str, Any]
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    skipped_lines: int = 0

    # --- settings --------------------------------------------------------------------------------------
    def _setting_parts(self) -> tuple[str | None, str | None]:
        fwd, bwd = self.config.get("forward"), self.config.get("backward")
        setting = self.summary.get("setting")
        known = isinstance(fwd, str) and isinstance(bwd, str)
        if isinstance(setting, str) and "/" in setting and not known:
            sf, _, sb = setting.partition("/")
            fwd = fwd if isinstance(fwd, str) else sf
            bwd = bwd if isinstance(bwd, str) else sb
        return (fwd if isinstance(fwd, str) else None, bwd if isinstance(bwd, str) else None)

    @property
    def forward(self) -> str | None:
        """The forward (activation) setting, e.g. ``delta:q2``; None if neither config nor summary says."""
        return self._setting_parts()[0]

    @property
    def backward(self) -> str | None:
        """The backward (activation-gradient) setting, e.g. ``direct:q4``; None if unknown."""
        return self._setting_parts()[1]

    @property
    def setting(self) -> str:
        """``forward/backward`` (``?`` for an unknown side)."""
        fwd, bwd = self._setting_parts()
        if fwd is None and bwd is None and isinstance(self.summary.get("setting"), str):
            return str(self.summary["setting"])
        return f"{fwd or '?'}/{bwd or '?'}"

    @property
    def uncompressed(self) -> bool:
        """Whether both directions send full precision (the natural baseline)."""
        return is_uncompressed(self.forward) and is_uncompressed(self.backward)

    @property
    def task(self) -> str | None:
        task = self.config.get("task", self.summary.get("task"))
        return task if isinstance(task, str) else None

    # --- final values ----------------------------------------------------------------------------------
    @property
    def steps(self) -> int | None:
        """Steps run: the summary's ``steps``, else the step of the last train row."""
        if _is_number(self.summary.get("steps")):
            return int(self.summary["steps"])
        return int(self.train_rows[-1]["step"]) if self.train_rows else None

    @property
    def final_train_loss(self) -> float | None:
        """The summary's ``final_train_loss``, else the loss of the last train row."""
        v = _finite(self.summary.get("final_train_loss"))
        if v is None and self.train_rows:
            v = _finite(self.train_rows[-1].get("loss"))
        return v

    def final_eval(self, mode: Mode) -> dict[str, float]:
        """Final eval metrics with compression on (``compressed``) or off: the summary's, else the last eval
        row that has them. Only finite numbers are kept."""
        summary_eval = self.summary.get("eval")
        sources = [summary_eval.get(mode) if isinstance(summary_eval, dict) else None]
        sources += [row.get(mode) for row in reversed(self.eval_rows)]
        for src in sources:
            if isinstance(src, dict):
                metrics = {k: float(v) for k, v in src.items() if _finite(v) is not None}
                if metrics:
                    return metrics
        return {}

    def metric_series(self, metric: str, mode: Mode) -> tuple[list[int], list[float]]:
        """Steps and values of one eval metric over the eval rows that report it."""
        steps, vals = [], []
        for row in self.eval_rows:
            v = _finite((row.get(mode) or {}).get(metric))
            if v is not None:
                steps.append(int(row["step"]))
                vals.append(v)
        return steps, vals

    def cumulative(self, key: ByteKey = "bytes_sent") -> tuple[list[int], list[float]]:
        """Steps and running total of a train-row byte counter (see :func:`_accumulate` for how per-step and
        cumulative counters are told apart)."""
        points = [(int(r["step"]), float(r[key])) for r in self.train_rows if _finite(r.get(key)) is not None]
        if not points:
            return [], []
        return [s for s, _ in points], _accumulate(points, _finite(self.summary.get(key)))

    def _total(self, key: str) -> float | None:
        """The summary's ``key``, else the rows' running total of it."""
        v = _finite(self.summary.get(key))
        if v is None:
            _, cum = self.cumulative(key)
            v = cum[-1] if cum else None
        return v

    @property
    def total_bytes(self) -> float | None:
        """Bytes sent over all boundaries: the summary's ``bytes_sent``, else the rows' running total."""
        return self._total("bytes_sent")

    @property
    def raw_bytes(self) -> float | None:
        """What the same tensors would have taken in fp32: the summary's ``raw_bytes``, else the rows'."""
        return self._total("raw_bytes")

    @property
    def compression_ratio(self) -> float | None:
        """The summary's ``compression_ratio``, else ``raw_bytes / bytes_sent``."""
        v = _finite(self.summary.get("compression_ratio"))
        if v is None:
            sent, raw = self.total_bytes, self.raw_bytes
            v = raw / sent if sent and raw is not None else None
        return v

    @property
    def samples_per_s(self) -> float | None:
        """The summary's ``samples_per_s``, else the mean over the train rows past warm-up (all rows if the
        run never left warm-up)."""
        v = _finite(self.summary.get("samples_per_s"))
        if v is not None:
            return v
        rows = [r for r in self.train_rows if r.get("phase") != "warmup"] or self.train_rows
        vals = [x for x in (_finite(r.get("samples_per_s")) for r in rows) if x is not None]
        return sum(vals) / len(vals) if vals else None

    def warmup_span(self) -> tuple[int, int] | None:
        """First and last step of the rows in the ``warmup`` phase, or None."""
        steps = [int(r["step"]) for r in self.train_rows if r.get("phase") == "warmup"]
        return (min(steps), max(steps)) if steps else None


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file, or ``{}`` (with a warning when it exists but is not one)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s: not readable as JSON (%s); ignoring it", path, e)
        return {}
    if not isinstance(data, dict):
        log.warning("%s: not a JSON object; ignoring it", path)
        return {}
    return data


def _valid_row(row: object) -> str | None:
    """``"train"``/``"eval"`` for a valid row, ``"other"`` for a row of another kind, None if malformed."""
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        return None
    kind = row.get("kind")
    if kind == "train":
        return "train" if _is_number(row.get("loss")) else None
    if kind == "eval":
        return "eval" if any(isinstance(row.get(m), dict) for m in MODES) else None
    return "other" if isinstance(kind, str) else None


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Load a run directory. The run is named ``label``, or the directory's name.

    Raises :class:`ReportError` when ``path`` is not a directory or holds no ``metrics.jsonl``. Malformed
    lines are skipped, counted in ``Run.skipped_lines`` and reported in one warning (logged).
    """
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"run directory {str(path)!r} does not exist or is not a directory")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"run directory {str(path)!r} has no metrics.jsonl "
                          "(is it a training run directory?)")
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    skipped: list[int] = []
    with metrics.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            kind = _valid_row(row)
            if kind is None:
                skipped.append(lineno)
            elif kind == "train":
                train.append(row)  # type: ignore[arg-type]
            elif kind == "eval":
                evals.append(row)  # type: ignore[arg-type]
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        log.warning("%s: skipped %d malformed line(s) (line %s)", metrics, len(skipped), shown)
    return Run(name=label or path.resolve().name, path=path, config=_read_json_object(path / "config.json"),
               train_rows=train, eval_rows=evals, summary=_read_json_object(path / "summary.json"),
               skipped_lines=len(skipped))


# --- comparison ----------------------------------------------------------------------------------------

def main_metric(runs: Iterable[Run]) -> str | None:
    """The eval metric to compare runs on: the first of :data:`METRIC_PRIORITY` that any run reports
    (``mcc`` first when a task is CoLA), or None when no run has eval results."""
    runs = list(runs)
    present: set[str] = set()
    for run in runs:
        for mode in MODES:
            present.update(run.final_eval(mode))
            for row in run.eval_rows:
                if isinstance(row.get(mode), dict):
                    present.update(k for k, v in row[mode].items() if _finite(v) is not None)
    order = list(METRIC_PRIORITY)
    if any("cola" in (run.task or "").lower() for run in runs):
        order.remove("mcc")
        order.insert(0, "mcc")
    return next((m for m in order if m in present), None)


def select_baseline(runs: Sequence[Run], name: str | None = None) -> Run:
    """The run named ``name``; without a name the first uncompressed run (``none``/``fp32`` both ways), else
    the first run. Raises :class:`ReportError` for an unknown name or no runs."""
    if not runs:
        raise ReportError("no runs to report on")
    if name is not None:
        for run in runs:
            if run.name == name:
                return run
        raise ReportError(f"baseline {name!r} is not one of the runs: {', '.join(r.name for r in runs)}")
    return next((r for r in runs if r.uncompressed), runs[0])


def comparison_table(runs: Sequence[Run], baseline: str | None = None,
                     metric: str | None = None) -> list[dict[str, Any]]:
    """One dict per run (in order) with the values the report compares. Missing values are None.

    Keys: ``run``, ``path``, ``task``, ``setting``, ``forward``, ``backward``, ``steps``,
    ``final_train_loss``, ``metric`` (its name, the same in every row: ``metric`` or :func:`main_metric`),
    ``higher_is_better``, ``metric_on`` / ``metric_off`` (final value with compression on / off),
    ``baseline`` (the baseline's name, see :func:`select_baseline`), ``rel_diff`` (``(metric_on -
    baseline's metric_on) / |baseline's metric_on|``, 0 for the baseline itself), ``bytes_sent``,
    ``raw_bytes``, ``compression_ratio``, ``samples_per_s``, ``skipped_lines``.
    """
    base = select_baseline(runs, baseline)
    metric = metric or main_metric(runs)
    base_on = base.final_eval("compressed").get(metric) if metric else None
    rows: list[dict[str, Any]] = []
    for run in runs:
        on = run.final_eval("compressed").get(metric) if metric else None
        off = run.final_eval("uncompressed").get(metric) if metric else None
        rel = (on - base_on) / abs(base_on) if on is not None and base_on else None
        sent = run.total_bytes
        raw = run.raw_bytes
        rows.append({
            "run": run.name,
            "path": str(run.path),
            "task": run.task,
            "setting": run.setting,
            "forward": run.forward,
            "backward": run.backward,
            "steps": run.steps,
            "final_train_loss": run.final_train_loss,
            "metric": metric,
            "higher_is_better": HIGHER_IS_BETTER.get(metric) if metric else None,
            "metric_on": on,
            "metric_off": off,
            "baseline": base.name,
            "rel_diff": 0.0 if run is base and on is not None else rel,
            "bytes_sent": int(sent) if sent is not None else None,
            "raw_bytes": int(raw) if raw is not None else None,
            "compression_ratio": run.compression_ratio,
            "samples_per_s": run.samples_per_s,
            "skipped_lines": run.skipped_lines,
        })
    return rows


# --- figure --------------------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    except ImportError as e:  # pragma: no cover - matplotlib is a test dependency
        raise AqsgdError("aqsgd report needs matplotlib: pip install matplotlib") from e
    if not runs:
        raise ReportError("no runs to plot")
    out_png = Path(out_png)
    metric = metric or main_metric(runs)
    if len(runs) <= 10:
        colors = {run.name: f"C{i}" for i, run in enumerate(runs)}
    else:  # the default cycle repeats after 10: take distinct colours from tab20 (then repeat after 20)
        cmap = matplotlib.colormaps["tab20"]
        colors = {run.name: cmap(i % 20) for i, run in enumerate(runs)}
    bytes_fmt = FuncFormatter(lambda x, _pos: _fmt_bytes(x))

    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5), layout="constrained")
    ax_loss, ax_eval, ax_cum, ax_bar = axes.flat
    tasks = sorted({run.task for run in runs if run.task})
    fig.suptitle(f"aqsgd report{': ' + ', '.join(tasks) if tasks else ''}", fontsize=14, fontweight="bold")

    # 1. training loss
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

    # 2. eval metric, compression on / off
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

    # 3. cumulative bytes
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

    # 4. total bytes per run
    explicit = baseline is not None
    ref = select_baseline(runs, baseline)
    ref_bytes = ref.total_bytes if (explicit or ref.uncompressed) else None
    names = [run.name for run in runs]
    totals = [run.total_bytes or 0.0 for run in runs]
    horizontal = len(runs) > 6  # many runs: one row per run, so the names and notes stay readable
    draw_bars = ax_bar.barh if horizontal else ax_bar.bar
    bars = draw_bars(range(len(runs)), totals, color=[colors[n] for n in names])
    for run, bar, total in zip(runs, bars, totals):
        if run is ref and ref_bytes:
            note = "baseline"
        elif ref_bytes and total:
            note = f"{ref_bytes / total:.3g}x fewer"
        elif run.compression_ratio:
            note = f"{run.compression_ratio:.3g}x vs fp32"
        else:
            note = ""
        if horizontal:
            ax_bar.annotate(f"{_fmt_bytes(total)}  {note}".strip(), (total, bar.get_y() + bar.get_height() / 2),
                            xytext=(3, 0), textcoords="offset points", ha="left", va="center", fontsize=8)
        else:
            ax_bar.annotate(f"{_fmt_bytes(total)}\n{note}".strip(), (bar.get_x() + bar.get_width() / 2, total),
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

    handles = [Line2D([], [], color=colors[run.name], linewidth=3, label=f"{run.name} ({run.setting})")
               for run in runs]
    # as many columns as the longest label leaves room for across the figure (~170 characters at this size)
    widest = max(len(h.get_label()) for h in handles) + 6
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(len(runs), 4, 170 // widest)),
               frameon=False, fontsize=10 if len(runs) <= 10 else 9)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    plt.close(fig)
    return out_png


# --- command line --------------------------------------------------------------------------------------

def register_cli(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report RUN_DIR... [--out PATH.png] [--json PATH] [--baseline NAME] [--labels a,b,...]
    [--metric NAME]`` to an argparse subparsers object. The parser sets ``func`` (``args.func(args)``
    returns the exit code). Returns the ``report`` parser."""
    p = sub.add_parser("report", help="compare training runs: a table and a 4-panel figure",
                       description="Compare run directories (config.json, metrics.jsonl, summary.json): "
                                   "print a table of final metrics, bytes and throughput, and write one PNG "
                                   "with loss, eval metric, cumulative bytes and total bytes.")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories")
    p.add_argument("--out", type=Path, default=Path("report.png"), metavar="PATH.png",
                   help="where to write the figure (default: report.png)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the table as JSON to PATH")
    p.add_argument("--baseline", default=None, metavar="NAME",
                   help="run to compare against (default: the uncompressed none/fp32 run, else the first)")
    p.add_argument("--labels", default=None, metavar="a,b,...",
                   help="comma-separated run names, one per RUN_DIR (default: the directory names)")
    p.add_argument("--metric", default=None, choices=METRIC_PRIORITY,
                   help="eval metric to compare (default: the first present of accuracy, mcc, "
                        "perplexity, loss; mcc first for CoLA)")
    p.set_defaults(func=run_report)
    return p


def _unique_names(runs: list[Run]) -> None:
    """Rename runs whose names clash (same directory name under different parents) to ``parent/name``."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        if seen[run.name] > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.name}"
    names = [run.name for run in runs]
    for i, run in enumerate(runs):
        if names.count(run.name) > 1:
            run.name = f"{run.name} #{names[:i + 1].count(names[i])}"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_report(args: argparse.Namespace) -> int:
    """``aqsgd report``: load the runs, print the table, write the PNG (and the JSON). A
    :class:`ReportError` propagates (the main CLI prints it as one line)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    dirs: list[Path] = list(args.run_dirs)
    labels: list[str | None] = [None] * len(dirs)
    if args.labels is not None:
        given = [s.strip() for s in args.labels.split(",")]
        if len(given) != len(dirs) or not all(given):
            raise ReportError(f"--labels has {len(given)} name(s) for {len(dirs)} run director"
                              f"{'y' if len(dirs) == 1 else 'ies'}; give one non-empty name per RUN_DIR")
        if len(set(given)) != len(given):
            raise ReportError(f"--labels has duplicate names: {args.labels}")
        labels = list(given)
    runs = [load_run(d, label=lab) for d, lab in zip(dirs, labels)]
    if args.labels is None:
        _unique_names(runs)
    rows = comparison_table(runs, baseline=args.baseline, metric=args.metric)
    metric = rows[0]["metric"]
    base = rows[0]["baseline"]

    table = Table(title=f"runs compared on {metric or 'no eval metric'}; baseline: {escape(base)}")
    left = {"run", "setting"}
    cols = ["run", "setting", "steps", "train loss", f"{metric or 'metric'} on", f"{metric or 'metric'} off",
            f"vs {escape(base)}", "bytes sent", "ratio", "samples/s"]
    for col in cols:
        table.add_column(col, justify="left" if col in left else "right", overflow="fold")
    metric_fmt = ".4f" if metric in ("accuracy", "mcc") else ".4g"
    for r in rows:
        diff = "-" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.2f}%"
        if r["rel_diff"] and r["higher_is_better"] is not None:
            better = (r["rel_diff"] > 0) == r["higher_is_better"]
            diff = f"[{'green' if better else 'red'}]{diff}[/]"
        table.add_row(escape(r["run"]), escape(r["setting"]), _fmt(r["steps"], "d"),
                      _fmt(r["final_train_loss"], ".4f"),
                      _fmt(r["metric_on"], metric_fmt), _fmt(r["metric_off"], metric_fmt), diff,
                      "-" if r["bytes_sent"] is None else _fmt_bytes(r["bytes_sent"]),
                      _fmt(r["compression_ratio"], ".1f") + ("x" if r["compression_ratio"] else ""),
                      _fmt(r["samples_per_s"], ",.1f"))
    console = Console(width=max(Console().width, 150))
    console.print(table)
    for run in runs:
        if run.skipped_lines:
            console.print(escape(f"{run.name}: skipped {run.skipped_lines} malformed line(s) in "
                                 f"{run.path / 'metrics.jsonl'}"), soft_wrap=True)
    out = plot_runs(runs, args.out, baseline=args.baseline, metric=args.metric)
    console.print(escape(f"wrote {out}"), soft_wrap=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metric": metric, "baseline": base, "rows": rows}, indent=2) + "\n",
                             encoding="utf-8")
        console.print(escape(f"wrote {args.json}"), soft_wrap=True)
    return 0
