"""Pipeline stages: slices of a model with a uniform ``forward(hidden, batch)`` signature.

Every stage sees the full micro-batch dict ``batch`` (each pipeline worker runs the same
deterministic data loader), while only one boundary tensor ``hidden`` travels between stages.

* the first stage ignores ``hidden`` (it is ``None``) and reads its input from ``batch``;
* the last stage returns the scalar loss of the micro-batch, exactly as the unsplit model computes it;
* every other stage returns the boundary tensor for the next stage.

Whatever a stage needs besides ``hidden`` (attention masks, position ids, rotary embeddings, token
type ids, labels) is rebuilt locally from ``batch`` with the same helpers the unsplit model uses.
Stages reference the original model's sub-modules, so parameters are shared, not copied.

This module holds the base class only; the stage class of each model family lives in that family's
module under :mod:`aqsgd.models`. What a stage is, is model knowledge: it lives here, below the pipeline
(which cuts models into stages and runs them), so :mod:`aqsgd.models` imports nothing of
:mod:`aqsgd.pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineStage(nn.Module):
    """Base class of all stages.

    Attributes:
        stage_index: position of this stage in the pipeline (0-based).
        num_stages: total number of stages.
        layer_range: ``(start, end)`` indices of the model's blocks held by this stage.
    """

    def __init__(self, stage_index: int, num_stages: int, layer_range: tuple[int, int]) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_range = layer_range
        # Evaluation hook: when ``keep_logits`` is set, the last stage keeps its latest logits (detached) in
        # ``last_logits`` so that metrics beyond the loss (accuracy, MCC) can be computed where they live.
        self.keep_logits = False
        self.last_logits: torch.Tensor | None = None

    def _kept(self, logits: torch.Tensor) -> torch.Tensor:
        if self.keep_logits:
            self.last_logits = logits.detach()
        return logits

    @property
    def is_first(self) -> bool:
        """True for the stage that reads the model input from the batch."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the stage that computes the loss."""
        return self.stage_index == self.num_stages - 1

    def require(self, batch: Batch, key: str) -> torch.Tensor:
        """Return ``batch[key]`` or raise a KeyError that names the stage and the available keys."""
        try:
            return batch[key]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__} {self.stage_index} needs batch[{key!r}]; batch has {sorted(batch)}"
            ) from None

    def _check_hidden(self, hidden: torch.Tensor | None) -> torch.Tensor:
        if hidden is None:
            raise ValueError(f"stage {self.stage_index} is not the first stage and needs a boundary tensor")
        return hidden

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:  # pragma: no cover
        """Boundary tensor for the next stage, or the scalar loss on the last stage."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        start, end = self.layer_range
        return f"stage={self.stage_index}/{self.num_stages}, layers=[{start}, {end})"
