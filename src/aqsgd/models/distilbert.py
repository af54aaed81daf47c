"""The ``distilbert-cls`` family: transformers ``DistilBertForSequenceClassification``.

Recipe config: a ``DistilBertConfig`` keyword dict (or ``config.to_dict()``) with ``num_labels``; its
``model_type``, if present, must be ``"distilbert"``.  The model cuts between
``distilbert.transformer.layer``: the first stage also holds the embeddings (word + position, no token
types), every stage rebuilds the bidirectional padding mask from ``batch["attention_mask"]``, and the last
holds the head: first token -> ``pre_classifier`` -> ReLU -> dropout -> ``classifier`` and the
classification loss.  The embeddings' non-persistent ``position_ids`` are recomputed after loading
weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aqsgd.models.bert import embedding_index_buffers, sequence_classification_loss
from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.hf import build_transformers_model, is_transformers_instance, set_dropout
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "distilbert-cls"
MODEL_TYPE = "distilbert"


class DistilBertClassifierStage(PipelineStage):
    """A slice of ``DistilBertForSequenceClassification``: [embeddings] -> transformer blocks ->
    [pre_classifier + ReLU + dropout + classifier + loss]."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        base = model.distilbert
        self.config = model.config
        self.layers = nn.ModuleList(base.transformer.layer[start:end])
        if self.is_first:
            self.embeddings = base.embeddings
        if self.is_last:
            self.pre_classifier = model.pre_classifier
            self.dropout = model.dropout
            self.classifier = model.classifier

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of DistilBERT (see :class:`PipelineStage`)."""
        from transformers.masking_utils import create_bidirectional_mask

        if self.is_first:
            hidden = self.embeddings(self.require(batch, "input_ids"), None, batch.get("position_ids"))
        hidden = self._check_hidden(hidden)
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=batch.get("attention_mask")
        )
        for layer in self.layers:
            hidden = layer(hidden, mask)
        if not self.is_last:
            return hidden
        pooled = torch.relu(self.pre_classifier(hidden[:, 0]))
        logits = self.classifier(self.dropout(pooled))
        labels = self.require(batch, "labels")
        return sequence_classification_loss(self.config, self._kept(logits), labels)


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    base = model.distilbert
    return ModelLayout(
        KIND,
        list(base.transformer.layer),
        [base.embeddings],
        [model.pre_classifier, model.classifier],
        lambda i, s, a, b: DistilBertClassifierStage(model, i, s, a, b),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": MODEL_TYPE, "n_layers": layers, "dim": hidden, "hidden_dim": 2 * hidden,
            "n_heads": 4, "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "num_labels": 2,
            "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0, "qa_dropout": 0.0,
            "pad_token_id": 0}


FAMILY = ModelFamily(
    kind=KIND,
    description="transformers DistilBertForSequenceClassification",
    stage=DistilBertClassifierStage,
    build=lambda config, attn: build_transformers_model(
        config, attn, "AutoModelForSequenceClassification", kind=KIND, model_type=MODEL_TYPE
    ),
    matches=lambda model: is_transformers_instance(model, "DistilBertForSequenceClassification"),
    layout=_layout,
    tiny_config=_tiny_config,
    task_kind="sequence-classification",
    model_types=(MODEL_TYPE,),
    blocks_key="n_layers",
    dropout=set_dropout,
    buffer_initializers=(
        ("transformers.models.distilbert.modeling_distilbert", "Embeddings", embedding_index_buffers),
    ),
    auto_class="AutoModelForSequenceClassification",
    lora_targets=("q_lin", "k_lin", "v_lin"),
)
