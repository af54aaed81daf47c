"""Loading run directories and comparing them: :func:`load_run`, :class:`Run`, :func:`comparison_table`.

Every value a report shows comes from here: the run's ``summary.json`` when it has one, else a value
derived from the ``metrics.jsonl`` rows (see :mod:`aqsgd.train.report` for the run directory layout). Wall
times are the train rows' step durations (``time.step``, seconds) summed from the run's start: a resumed run
continues from its checkpoint's step (the interrupted run's later rows are cut away when it resumes), so the
restart itself, evaluation and checkpoint writes do not count.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aqsgd.errors import ReportError
from aqsgd.train.config import flatten_config

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC_PRIORITY",
    "MODES",
    "ByteKey",
    "Mode",
    "NO_CACHE_NOTE",
    "RANK_BY",
    "Run",
    "comparison_table",
    "compressed_eval_label",
    "evaluates_compressed",
    "evaluates_without_cache",
    "format_bytes",
    "format_rate",
    "is_uncompressed",
    "load_run",
    "main_metric",
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
#: What a report ranks runs on (``--rank-by``): the uncompressed evaluation, the model's quality, by default.
RANK_BY: tuple[Mode, Mode] = ("uncompressed", "compressed")
#: One short note for runs whose compressed evaluation ran without a cache (see
#: :func:`evaluates_without_cache`), shown wherever that figure is.
NO_CACHE_NOTE = ("(no cache): AQ-SGD evaluates through its codec without the per-sample cache it trains with "
                 "(evaluation samples have none); that figure is not the model's quality")


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


def evaluates_compressed(forward: str | None, stages: int | None) -> bool:
    """Whether a run's compressed evaluation (phase ``EVAL``) sent anything compressed, so that it differs
    from the uncompressed one: the run has a stage boundary and its forward setting compresses (evaluation
    sends activations only). Unknown settings (None) count as compressed: both figures are shown."""
    return stages != 1 and not is_uncompressed(forward)


def evaluates_without_cache(forward: str | None, stages: int | None) -> bool:
    """Whether a run's compressed evaluation is AQ-SGD without its cache: a ``delta`` (or ``auto``: AQ-SGD
    at bits chosen per link) forward over a stage boundary. Evaluation samples have no cache entry, so the
    codec's output crosses the boundary alone: far worse than the model, not its quality."""
    if not forward or not evaluates_compressed(forward, stages):
        return False
    head = forward.strip().partition(":")[0]
    return head in ("delta", "auto")


def compressed_eval_label(forward: str | None, stages: int | None) -> str:
    """What the compressed evaluation is, for a label: ``through compressed boundaries``, with ``(no cache)``
    for AQ-SGD (:func:`evaluates_without_cache`)."""
    no_cache = evaluates_without_cache(forward, stages)
    return "through compressed boundaries" + (" (no cache)" if no_cache else "")


def _close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1.0)


def _running_sum(points: Sequence[tuple[int, float]]) -> list[float]:
    """Running totals of per-step values given at some steps: each value counts for every step since the
    previous point (exact when every step has one; a step that does not advance, as in rows written twice
    for one step, counts once)."""
    out: list[float] = []
    acc, prev = 0.0, None
    for step, v in points:
        acc += v * (1 if prev is None else max(1, step - prev))
        prev = step
        out.append(acc)
    return out


def _step_seconds(row: dict[str, Any]) -> float | None:
    """The duration of a train row's step in seconds (``time.step``), or None where the row has none."""
    t = row.get("time")
    v = _finite(t.get("step")) if isinstance(t, dict) else None
    return v if v is not None and v >= 0 else None


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
    return _running_sum(points)


@dataclass
class Run:
    """One run directory, loaded.

    ``train_rows`` and ``eval_rows`` are the valid ``metrics.jsonl`` rows of each kind in file order;
    ``summary`` is ``{}`` when there is no ``summary.json`` (a run still going), ``config`` likewise (as
    written: nested by section, or flat in older runs; see :attr:`flat_config`). ``skipped_lines`` counts the
    lines of ``metrics.jsonl`` that were not valid rows.
    """

    name: str
    path: Path
    config: dict[str, Any]
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    skipped_lines: int = 0

    # --- settings --------------------------------------------------------------------------------------
    @property
    def flat_config(self) -> dict[str, Any]:
        """The config as ``{flat name: value}`` (``forward``, ``stages``, ``link``, ...), whether
        ``config.json`` is nested by section or flat."""
        return flatten_config(self.config)

    def _setting_parts(self) -> tuple[str | None, str | None]:
        cfg = self.flat_config
        fwd, bwd = cfg.get("forward"), cfg.get("backward")
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
        """Whether both directions send full precision."""
        return is_uncompressed(self.forward) and is_uncompressed(self.backward)

    @property
    def compresses_nothing(self) -> bool:
        """Whether nothing of the run was compressed (the natural baseline): one stage (no boundary to send
        over, whatever its codecs say) or full precision both ways."""
        return self.stages == 1 or self.uncompressed

    @property
    def evaluates_compressed(self) -> bool:
        """Whether the run's compressed evaluation differs from the uncompressed one
        (:func:`evaluates_compressed`); without it the run has one evaluation figure."""
        return evaluates_compressed(self.forward, self.stages)

    @property
    def evaluates_without_cache(self) -> bool:
        """Whether the run's compressed evaluation is AQ-SGD's without a cache
        (:func:`evaluates_without_cache`): not the model's quality."""
        return evaluates_without_cache(self.forward, self.stages)

    @property
    def task(self) -> str | None:
        """The task's name: the config's ``task``, else the summary's; None if neither names one."""
        for task in (self.flat_config.get("task"), self.summary.get("task")):
            if isinstance(task, str):
                return task
        return None

    @property
    def stages(self) -> int | None:
        """Pipeline stages: the config's ``stages``, else the summary's; None if unknown."""
        for n in (self.flat_config.get("stages"), self.summary.get("stages")):
            if isinstance(n, int) and not isinstance(n, bool):
                return n
        return None

    @property
    def link(self) -> str | None:
        """The emulated link between stages (``--link``, e.g. ``100mbit,5ms``), or None: no emulated link."""
        link = self.flat_config.get("link")
        return link if isinstance(link, str) and link else None

    @property
    def setting_label(self) -> str:
        """The codecs as a table shows them: :attr:`setting`, ``uncompressed`` for full precision both ways,
        and ``1 stage`` for a run of one stage (it has no boundary: its codecs were never used)."""
        if self.stages == 1:
            return "1 stage"
        return "uncompressed" if self.uncompressed else self.setting

    @property
    def settings_label(self) -> str:
        """The settings in a few words, for a legend: ``delta:q2/direct:q4, 4 stages, link 100mbit,5ms``
        (the stages and the link where the run records them); no codecs where nothing was compressed
        (``uncompressed, 4 stages``; ``1 stage``)."""
        if self.stages == 1:
            return "1 stage"
        parts = [self.setting_label]
        if self.stages is not None:
            parts.append(f"{self.stages} stages")
        if self.link is not None:
            parts.append(f"link {self.link}")
        return ", ".join(parts)

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

    def loss_series(self) -> tuple[list[int], list[float]]:
        """Steps and training losses of the train rows with a finite loss."""
        pts = [(int(r["step"]), v) for r in self.train_rows if (v := _finite(r.get("loss"))) is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    def _timed_rows(self) -> list[tuple[dict[str, Any], float]]:
        """The train rows that record their step's duration, each with the seconds of training from the
        run's start to the end of its step (:func:`_running_sum` of the durations)."""
        rows = [(r, d) for r in self.train_rows if (d := _step_seconds(r)) is not None]
        elapsed = _running_sum([(int(r["step"]), d) for r, d in rows])
        return [(r, t) for (r, _), t in zip(rows, elapsed)]

    def wall_times(self) -> tuple[list[int], list[float]]:
        """Steps and wall time in seconds since the run's start at the end of each, summed from the rows'
        step durations (``time.step``); both empty for a run whose rows record none (an old run)."""
        timed = self._timed_rows()
        return [int(r["step"]) for r, _ in timed], [t for _, t in timed]

    def loss_vs_time(self) -> tuple[list[float], list[float]]:
        """Wall times (see :meth:`wall_times`) and training losses of the timed rows with a finite loss."""
        pts = [(t, v) for r, t in self._timed_rows() if (v := _finite(r.get("loss"))) is not None]
        return [t for t, _ in pts], [v for _, v in pts]

    @property
    def has_wall_times(self) -> bool:
        """Whether any train row records its step's duration."""
        return any(_step_seconds(r) is not None for r in self.train_rows)

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
    """The run named ``name``; without a name the first run that compressed nothing (``none``/``fp32`` both
    ways, or one stage: :attr:`Run.compresses_nothing`), else the first run. Raises :class:`ReportError` for
    an unknown name or no runs."""
    if not runs:
        raise ReportError("no runs to report on")
    if name is not None:
        for run in runs:
            if run.name == name:
                return run
        raise ReportError(f"baseline {name!r} is not one of the runs: {', '.join(r.name for r in runs)}")
    return next((r for r in runs if r.compresses_nothing), runs[0])


def comparison_table(runs: Sequence[Run], baseline: str | None = None, metric: str | None = None,
                     rank_by: Mode = "uncompressed") -> list[dict[str, Any]]:
    """One dict per run (in order) with the values the report compares. Missing values are None.

    Keys: ``run``, ``path``, ``task``, ``setting``, ``forward``, ``backward``, ``steps``,
    ``final_train_loss``, ``metric`` (its name, the same in every row: ``metric`` or :func:`main_metric`),
    ``higher_is_better``, ``metric_off`` (final value of the uncompressed evaluation: the model's quality),
    ``metric_on`` (final value through the run's compressed boundaries; None for a run without one, see
    :attr:`Run.evaluates_compressed`), ``evaluates_compressed``, ``no_cache`` (the compressed figure is
    AQ-SGD's without a cache: :attr:`Run.evaluates_without_cache`), ``rank_by`` (which evaluation ``rel_diff``
    compares), ``baseline`` (the baseline's name, see :func:`select_baseline`), ``rel_diff`` (``(value -
    baseline's value) / |baseline's value|`` of the ``rank_by`` evaluation, 0 for the baseline itself),
    ``bytes_sent``, ``raw_bytes``, ``compression_ratio``, ``samples_per_s``, ``skipped_lines``.

    Runs are compared on the uncompressed evaluation unless ``rank_by`` is ``"compressed"``: the compressed
    one of an AQ-SGD run has no cache and reads far worse than the model. Compared on it, a run without a
    compressed boundary counts with its uncompressed value (the same computation).
    """
    if rank_by not in RANK_BY:
        raise ReportError(f"rank_by {rank_by!r} is not one of {', '.join(RANK_BY)}")
    base = select_baseline(runs, baseline)
    metric = metric or main_metric(runs)

    def final(run: Run, mode: Mode) -> float | None:
        if metric is None or (mode == "compressed" and not run.evaluates_compressed):
            return None
        return run.final_eval(mode).get(metric)

    def compared(run: Run) -> float | None:
        value = final(run, rank_by)
        return final(run, "uncompressed") if value is None and not run.evaluates_compressed else value

    base_value = compared(base)
    rows: list[dict[str, Any]] = []
    for run in runs:
        value = compared(run)
        rel = (value - base_value) / abs(base_value) if value is not None and base_value else None
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
            "metric_off": final(run, "uncompressed"),
            "metric_on": final(run, "compressed"),
            "evaluates_compressed": run.evaluates_compressed,
            "no_cache": run.evaluates_without_cache,
            "rank_by": rank_by,
            "baseline": base.name,
            "rel_diff": 0.0 if run is base and value is not None else rel,
            "bytes_sent": int(sent) if sent is not None else None,
            "raw_bytes": int(raw) if raw is not None else None,
            "compression_ratio": run.compression_ratio,
            "samples_per_s": run.samples_per_s,
            "skipped_lines": run.skipped_lines,
        })
    return rows


# --- formatting ---------------------------------------------------------------------------------------

def format_bytes(n: float) -> str:
    """A byte count for a label or a table cell: ``512 B``, ``1.5 kB``, ``3.07 MB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_rate(x: float, digits: int = 3) -> str:
    """A rate such as samples/s to ``digits`` significant digits (whole numbers from ``10**(digits - 1)``
    on), never in scientific notation: ``0.0123``, ``6.55``, ``1,234`` (a fixed number of decimals reads
    ``0.0`` for a slow run)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    x = float(f"{x:.{digits}g}")  # rounded first: 9.996 is 10.0, not 10.00
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"
