"""Evaluation during training: the evaluation data through the pipeline, with compression on and off.

Every process of a run evaluates (collective when distributed); with data parallelism each replica
evaluates its shard of every global batch and the sums are reduced over the last stage's replicas. The
metrics are returned where the loss is held. (``aqsgd eval``, which evaluates a run's checkpoint afterwards,
is :mod:`aqsgd.train.evaluate`.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from aqsgd.schemes import Phase
from aqsgd.train.metrics import perplexity

if TYPE_CHECKING:
    from aqsgd.train.engine import PipelineEngine
    from aqsgd.train.feed import DataFeed

__all__ = ["evaluate"]

# evaluation sums, reduced over the replicas: loss x samples, samples, correct predictions, binary confusion
# counts
_KEYS = ("loss_sum", "count", "correct", "tp", "tn", "fp", "fn")


def _mcc(tp: float, tn: float, fp: float, fn: float) -> float:
    """Matthews correlation coefficient from binary confusion counts (0 where undefined)."""
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / den if den else 0.0


def _counts(logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Correct predictions and the binary confusion counts (tp, tn, fp, fn) of one batch."""
    p, y = torch.cat(logits).argmax(-1).cpu(), labels.cpu()
    return torch.tensor([float((p == y).sum()), float(((p == 1) & (y == 1)).sum()),
                         float(((p == 0) & (y == 0)).sum()), float(((p == 1) & (y == 0)).sum()),
                         float(((p == 0) & (y == 1)).sum())], dtype=torch.float64)


def evaluate(engine: PipelineEngine, feed: DataFeed, *, classify: bool, main_metric: str, holds_loss: bool,
             replica_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """``{"compressed": metrics, "uncompressed": metrics}`` where the loss is held (empty elsewhere): the
    loss, and accuracy (with MCC where that is the task's metric) for a classifier, perplexity for a language
    model. ``replica_sum`` sums a float64 tensor over the replicas of the last stage."""
    out: dict[str, Any] = {}
    for name, phase in (("compressed", Phase.EVAL), ("uncompressed", Phase.EVAL_RAW)):
        sums = torch.zeros(len(_KEYS), dtype=torch.float64)
        for batch in feed.eval_batches():
            shard = feed.shard(batch, training=False)
            n = shard["sample_ids"].numel()
            if n == 0:  # fewer samples than replicas in a last batch: every stage of this replica skips it
                continue
            micro = feed.micro(shard, training=False)
            loss, logits = engine.evaluate(micro, phase, keep_logits=classify)
            if loss is None:
                continue
            weight = feed.weight(micro)  # the pass's samples, or its loss tokens
            sums[0] += loss * weight
            sums[1] += weight
            if classify and logits is not None:  # in the micro-batches' order (a shard may be reordered)
                sums[2:] += _counts(logits, torch.cat([mb["labels"] for mb in micro]))
        if not holds_loss:
            continue
        tally = dict(zip(_KEYS, replica_sum(sums).tolist()))
        count = max(tally["count"], 1.0)
        metrics: dict[str, float] = {"loss": tally["loss_sum"] / count}
        if classify:
            metrics["accuracy"] = tally["correct"] / count
            if main_metric == "mcc":
                metrics["mcc"] = _mcc(tally["tp"], tally["tn"], tally["fp"], tally["fn"])
        else:
            metrics["perplexity"] = perplexity(metrics["loss"])
        out[name] = metrics
    return out
