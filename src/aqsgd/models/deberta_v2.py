"""The ``deberta-v2-cls`` family: transformers ``DebertaV2ForSequenceClassification`` (DeBERTa-v2 and -v3,
``model_type`` ``"deberta-v2"``).

Recipe config: a ``DebertaV2Config`` keyword dict (or ``config.to_dict()``) with ``num_labels``; its
``model_type``, if present, must be ``"deberta-v2"``.  The model cuts between ``deberta.encoder.layer``:

* the first stage also holds the embeddings (which zero the padded positions) and the encoder's
  convolution (``conv_kernel_size > 0``), which follows the first layer;
* the relative position embeddings live in the encoder and every layer reads them: every stage holds
  ``encoder.rel_embeddings`` and its ``encoder.LayerNorm`` (they are shared parameters of all stages, whose
  gradients add up) and rebuilds the relative positions and the pairwise padding mask from ``batch``;
* the last stage holds the ``ContextPooler`` (dense on the first token), the dropout, the classifier and
  DeBERTa's own classification loss (:func:`deberta_classification_loss`).

The embeddings' non-persistent ``position_ids`` are recomputed after loading weights.  DeBERTa has only
eager attention: a recipe asking for another kernel is a :class:`~aqsgd.errors.SpecError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from aqsgd.errors import SpecError
from aqsgd.models.bert import embedding_index_buffers, sequence_classification_loss
from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.hf import build_transformers_model, is_transformers_instance, set_dropout
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "deberta-v2-cls"
MODEL_TYPE = "deberta-v2"
_MODULE = "transformers.models.deberta_v2.modeling_deberta_v2"


def deberta_classification_loss(config: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of ``DebertaV2ForSequenceClassification.forward``.

    Without ``config.problem_type``: mean squared error for one label; cross-entropy over the rows whose
    label is not negative for class labels (zero when there is none); soft-label cross-entropy for label
    distributions.  With it: as the BERT heads (regression / single / multi label).
    """
    num_labels = config.num_labels
    problem_type = config.problem_type
    if problem_type is None:
        if num_labels == 1:
            return F.mse_loss(logits.view(-1).to(labels.dtype), labels.view(-1))
        if labels.dim() == 1 or labels.size(-1) == 1:
            label_index = (labels >= 0).nonzero()
            labels = labels.long()
            if label_index.size(0) == 0:
                return torch.tensor(0).to(logits)
            labeled_logits = torch.gather(logits, 0, label_index.expand(label_index.size(0), logits.size(1)))
            labels = torch.gather(labels, 0, label_index.view(-1))
            return F.cross_entropy(labeled_logits.view(-1, num_labels).float(), labels.view(-1))
        return -((F.log_softmax(logits, -1) * labels).sum(-1)).mean()
    return sequence_classification_loss(config, logits, labels)  # an explicit problem_type: as BERT's head


class DebertaV2ClassifierStage(PipelineStage):
    """A slice of ``DebertaV2ForSequenceClassification``: [embeddings] -> encoder layers (+ conv after the
    first) -> [ContextPooler + dropout + classifier + loss], with the relative embeddings on every stage."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        base = model.deberta
        encoder = base.encoder
        self.config = model.config
        self.layers = nn.ModuleList(encoder.layer[start:end])
        self.relative_attention: bool = encoder.relative_attention
        self.position_buckets: int = getattr(encoder, "position_buckets", -1)
        self.max_relative_positions: int = getattr(encoder, "max_relative_positions", -1)
        self.rel_embeddings: nn.Module | None = getattr(encoder, "rel_embeddings", None)
        self.rel_norm: nn.Module | None = getattr(encoder, "LayerNorm", None)
        if self.is_first:
            self.embeddings = base.embeddings
            self.conv: nn.Module | None = encoder.conv
        if self.is_last:
            self.pooler = model.pooler
            self.dropout = model.dropout
            self.classifier = model.classifier

    def _relative_embeddings(self) -> torch.Tensor | None:
        """``encoder.get_rel_embedding()``: the (normalised) relative position embedding table."""
        if not self.relative_attention or self.rel_embeddings is None:
            return None
        table = self.rel_embeddings.weight
        if self.rel_norm is not None:
            table = self.rel_norm(table)
        return table

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of DeBERTa-v2 (see :class:`PipelineStage`)."""
        from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

        input_ids = self.require(batch, "input_ids")
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, device=input_ids.device)
        if self.is_first:
            token_type_ids = batch.get("token_type_ids")
            if token_type_ids is None:
                token_type_ids = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)
            hidden = self.embeddings(
                input_ids=input_ids,
                token_type_ids=token_type_ids,
                position_ids=batch.get("position_ids"),
                mask=attention_mask,
            )
        hidden = self._check_hidden(hidden)
        # As DebertaV2Encoder.forward: the token mask for the convolution, the pairwise mask for attention.
        input_mask = attention_mask if attention_mask.dim() <= 2 else attention_mask.sum(-2) > 0
        if attention_mask.dim() <= 2:
            extended = attention_mask.unsqueeze(1).unsqueeze(2)
            pair_mask = extended * extended.squeeze(-2).unsqueeze(-1)
        elif attention_mask.dim() == 3:
            pair_mask = attention_mask.unsqueeze(1)
        else:
            pair_mask = attention_mask
        relative_pos = None
        if self.relative_attention:
            relative_pos = build_relative_position(
                hidden, hidden, bucket_size=self.position_buckets, max_position=self.max_relative_positions
            )
        rel_embeddings = self._relative_embeddings()
        encoder_input = hidden
        for i, layer in enumerate(self.layers):
            hidden, _ = layer(
                hidden,
                pair_mask,
                query_states=None,
                relative_pos=relative_pos,
                rel_embeddings=rel_embeddings,
                output_attentions=False,
            )
            if i == 0 and self.is_first and self.conv is not None:
                hidden = self.conv(encoder_input, hidden, input_mask)
        if not self.is_last:
            return hidden
        logits = self.classifier(self.dropout(self.pooler(hidden)))
        labels = self.require(batch, "labels")
        return deberta_classification_loss(self.config, self._kept(logits), labels)


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    base = model.deberta
    pre = [m for m in (base.embeddings, base.encoder.conv) if m is not None]
    return ModelLayout(
        KIND,
        list(base.encoder.layer),
        pre,
        [model.pooler, model.classifier],
        lambda i, s, a, b: DebertaV2ClassifierStage(model, i, s, a, b),
    )


def _build(config: Mapping[str, Any], attn_implementation: str) -> nn.Module:
    if attn_implementation != "eager":
        raise SpecError(f"{KIND} models have only eager attention, not {attn_implementation!r}")
    return build_transformers_model(
        config, attn_implementation, "AutoModelForSequenceClassification", kind=KIND, model_type=MODEL_TYPE
    )


def _dropout(config: Mapping[str, Any], p: float) -> dict[str, Any]:
    config = set_dropout(config, p)
    config["cls_dropout"] = p  # absent from most configs (then the hidden dropout applies)
    return config


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    # DeBERTa-v3 style (log-bucketed relative positions shared by c2p / p2c attention, normalised relative
    # embeddings, no absolute positions), plus the v2 convolution after the first layer.
    return {"model_type": MODEL_TYPE, "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "vocab_size": vocab,
            "max_position_embeddings": max(64, seq_len), "type_vocab_size": 2, "num_labels": 2,
            "relative_attention": True, "position_buckets": 8, "max_relative_positions": -1,
            "pos_att_type": ["p2c", "c2p"], "norm_rel_ebd": "layer_norm", "share_att_key": True,
            "position_biased_input": False, "conv_kernel_size": 3, "pooler_hidden_size": hidden,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pooler_dropout": 0.0,
            "pad_token_id": 0}


FAMILY = ModelFamily(
    kind=KIND,
    description="transformers DebertaV2ForSequenceClassification",
    stage=DebertaV2ClassifierStage,
    build=_build,
    matches=lambda model: is_transformers_instance(model, "DebertaV2ForSequenceClassification"),
    layout=_layout,
    tiny_config=_tiny_config,
    task_kind="sequence-classification",
    model_types=(MODEL_TYPE,),
    blocks_key="num_hidden_layers",
    dropout=_dropout,
    buffer_initializers=((_MODULE, "DebertaV2Embeddings", embedding_index_buffers),),
    auto_class="AutoModelForSequenceClassification",
    lora_targets=("query_proj", "key_proj", "value_proj"),
)
