"""Run directory outputs: ``metrics.jsonl`` (one JSON object per logged step or evaluation), TensorBoard
events, and ``summary.json``. Only the process that holds the loss (the last stage) writes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "perplexity"]

log = logging.getLogger(__name__)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool = True, tensorboard: bool = True,
                 purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; TensorBoard hides the events from there on that the
        interrupted run had written (metrics.jsonl is cut back by
        :func:`aqsgd.train.rundir.truncate_metrics`)."""
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)
            except ImportError:
                log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled or self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = row.get("step", 0)
            for key, value in _flatten(row).items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{row.get('kind', 'train')}/{key}", value, step)

    def summary(self, data: dict[str, Any]) -> None:
        if self.enabled:
            (self.run_dir / "summary.json").write_text(json.dumps(data, indent=1))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out
