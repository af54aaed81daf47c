"""The ``bert-cls`` family: BERT-family ``*ForSequenceClassification`` models (BERT, RoBERTa, XLM-RoBERTa,
CamemBERT, ELECTRA).

Recipe config: a transformers config dict whose ``model_type`` (default ``"bert"``) selects the config
class, with ``num_labels`` for the classifier head.  Any model laid out as ``<base>.embeddings``,
``<base>.encoder.layer`` and ``classifier`` cuts between its encoder layers: the first stage also holds
the embeddings (and ELECTRA's ``embeddings_project`` where the embedding size differs from the hidden
size), the last the pooler (where the model has one) and the classifier.  The embeddings'
non-persistent ``position_ids`` / ``token_type_ids`` are recomputed after loading weights.

:func:`~aqsgd.models.family_for` maps the model types of :data:`MODEL_TYPES` here; DeBERTa, whose encoder
adds relative position embeddings, has its own family (:mod:`~aqsgd.models.deberta_v2`), and so has
DistilBERT (:mod:`~aqsgd.models.distilbert`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.hf import build_transformers_model, no_cache, set_dropout
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "bert-cls"
MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
"""The transformers model types served by this family."""
_OTHER_FAMILIES = ("Deberta",)  # class-name prefixes of look-alike classifiers this stage would get wrong


def sequence_classification_loss(config: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of transformers' ``*ForSequenceClassification`` heads (regression / single / multi label).

    Mirrors the inline code of ``BertForSequenceClassification.forward`` without mutating
    ``config.problem_type``.
    """
    num_labels = config.num_labels
    problem_type = config.problem_type
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif num_labels > 1 and labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels)
    raise ValueError(f"unsupported problem_type {problem_type!r}")


class EncoderClassifierStage(PipelineStage):
    """A slice of a BERT-family ``*ForSequenceClassification`` model.

    First stage: ``embeddings`` (then ``embeddings_project`` where the model has one); every stage: encoder
    layers with the bidirectional padding mask rebuilt from ``batch["attention_mask"]``; last stage:
    ``pooler`` -> ``dropout`` -> ``classifier`` (BERT) or ``classifier`` on the sequence output
    (RoBERTa/ELECTRA-style heads) and the classification loss.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        base = getattr(model, model.base_model_prefix)
        self.config = model.config
        self.layers = nn.ModuleList(base.encoder.layer[start:end])
        if self.is_first:
            self.embeddings = base.embeddings
            self.embeddings_project: nn.Module | None = getattr(base, "embeddings_project", None)
        if self.is_last:
            pooler = getattr(base, "pooler", None)
            self.pooler: nn.Module | None = pooler
            self.dropout: nn.Module | None = getattr(model, "dropout", None) if pooler is not None else None
            self.classifier = model.classifier

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the encoder (see :class:`PipelineStage`)."""
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        if self.is_first:
            hidden = self.embeddings(
                input_ids=self.require(batch, "input_ids"),
                token_type_ids=batch.get("token_type_ids"),
                position_ids=batch.get("position_ids"),
            )
            if self.embeddings_project is not None:
                hidden = self.embeddings_project(hidden)
        hidden = self._check_hidden(hidden)
        attention_mask = batch.get("attention_mask")
        if self.config.is_decoder:
            mask = create_causal_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                **no_cache(create_causal_mask)
            )
        else:
            mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=attention_mask
            )
        for layer in self.layers:
            hidden = layer(hidden, mask)
        if not self.is_last:
            return hidden
        if self.pooler is not None:
            features = self.pooler(hidden)
            if self.dropout is not None:
                features = self.dropout(features)
            logits = self.classifier(features)
        else:
            logits = self.classifier(hidden)
        labels = self.require(batch, "labels")
        return sequence_classification_loss(self.config, self._kept(logits), labels)


def _is_encoder_classifier(model: nn.Module) -> bool:
    """BERT-family sequence classifier: ``<base>.embeddings``, ``<base>.encoder.layer`` and ``classifier``."""
    name = type(model).__name__
    if not name.endswith("ForSequenceClassification") or name.startswith(_OTHER_FAMILIES):
        return False
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    encoder = getattr(base, "encoder", None)
    return (
        isinstance(getattr(base, "embeddings", None), nn.Module)
        and isinstance(getattr(encoder, "layer", None), nn.ModuleList)
        and isinstance(getattr(model, "classifier", None), nn.Module)
    )


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    base = getattr(model, model.base_model_prefix)
    post = [m for m in (getattr(base, "pooler", None), model.classifier) if m is not None]
    pre = [m for m in (base.embeddings, getattr(base, "embeddings_project", None)) if m is not None]
    return ModelLayout(
        KIND,
        list(base.encoder.layer),
        pre,
        post,
        lambda i, s, a, b: EncoderClassifierStage(model, i, s, a, b),
    )


def embedding_index_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``position_ids`` (``arange`` expanded to ``[1, max_positions]``) and ``token_type_ids`` (zeros)
    of BERT-family embedding modules."""
    values: dict[str, torch.Tensor] = {}
    position_ids = module._buffers.get("position_ids")
    if position_ids is not None:
        values["position_ids"] = torch.arange(
            position_ids.shape[-1], dtype=position_ids.dtype, device=device
        ).expand(position_ids.shape)
    token_type_ids = module._buffers.get("token_type_ids")
    if token_type_ids is not None:
        values["token_type_ids"] = torch.zeros(
            token_type_ids.shape, dtype=token_type_ids.dtype, device=device
        )
    return values


def _dropout(config: Mapping[str, Any], p: float) -> dict[str, Any]:
    config = set_dropout(config, p)
    config["classifier_dropout"] = p  # absent from most configs (then the hidden dropout applies)
    return config


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "bert", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "vocab_size": vocab,
            "max_position_embeddings": max(64, seq_len), "type_vocab_size": 2, "num_labels": 2,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}


FAMILY = ModelFamily(
    kind=KIND,
    description=(
        "BERT-family *ForSequenceClassification (e.g. BertForSequenceClassification, "
        "RobertaForSequenceClassification, ElectraForSequenceClassification)"
    ),
    stage=EncoderClassifierStage,
    build=lambda config, attn: build_transformers_model(
        config, attn, "AutoModelForSequenceClassification", kind=KIND, default_model_type="bert"
    ),
    matches=_is_encoder_classifier,
    layout=_layout,
    tiny_config=_tiny_config,
    task_kind="sequence-classification",
    model_types=MODEL_TYPES,
    blocks_key="num_hidden_layers",
    dropout=_dropout,
    auto_class="AutoModelForSequenceClassification",
    lora_targets=("query", "key", "value"),
    buffer_initializers=tuple(
        (f"transformers.models.{package}.modeling_{package}", class_name, embedding_index_buffers)
        for package, class_name in (
            ("bert", "BertEmbeddings"),
            ("roberta", "RobertaEmbeddings"),
            ("xlm_roberta", "XLMRobertaEmbeddings"),
            ("camembert", "CamembertEmbeddings"),
            ("electra", "ElectraEmbeddings"),
        )
    ),
)
