"""The stage base class, under the name the pipeline has always exported it by: it lives in
:mod:`aqsgd.models.stage` (model knowledge, below the pipeline)."""

from aqsgd.models.stage import Batch, LossFn, PipelineStage

__all__ = ["Batch", "LossFn", "PipelineStage"]
