"""Pipeline stages: slices of a model with a uniform ``forward(hidden, batch)`` signature.

Every stage sees the full micro-batch dict ``batch`` (each pipeline worker runs the same
deterministic data loader), while only one boundary tensor ``hidden`` travels between stages.

* the first stage ignores ``hidden`` (it is ``None``) and reads its input from ``batch``;
* the last stage returns the scalar loss of the micro-batch, exactly as the unsplit model computes it;
* every other stage returns the boundary tensor for the next stage.

Whatever a stage needs besides ``hidden`` (attention masks, position ids, rotary embeddings, token
type ids, labels) is rebuilt locally from ``batch`` with the same transformers helpers the unsplit
model uses.  Stages reference the original model's sub-modules, so parameters are shared, not copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _require(batch: Batch, key: str, stage: PipelineStage) -> torch.Tensor:
    """Return ``batch[key]`` or raise a KeyError that names the stage and the available keys."""
    try:
        return batch[key]
    except KeyError:
        raise KeyError(
            f"{type(stage).__name__} {stage.stage_index} needs batch[{key!r}]; batch has {sorted(batch)}"
        ) from None


def _position_ids(batch: Batch, seq_len: int, device: torch.device) -> torch.Tensor:
    """``batch["position_ids"]`` if given, else ``arange(T)[None]`` as the transformers models default to."""
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        return position_ids
    return torch.arange(seq_len, device=device).unsqueeze(0)


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


class GPT2Stage(PipelineStage):
    """A slice of ``GPT2LMHeadModel``: [wte + wpe + drop] -> blocks -> [ln_f + lm_head + loss]."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        transformer = model.transformer
        self.config = model.config
        self.blocks = nn.ModuleList(transformer.h[start:end])
        if self.is_first:
            self.wte = transformer.wte
            self.wpe = transformer.wpe
            self.drop = transformer.drop
        if self.is_last:
            self.ln_f = transformer.ln_f
            self.lm_head = model.lm_head
            self.loss_function: Callable[..., torch.Tensor] = model.loss_function

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of GPT-2 (see :class:`PipelineStage`)."""
        from transformers.masking_utils import create_causal_mask

        input_ids = _require(batch, "input_ids", self)
        batch_size, seq_len = input_ids.shape
        position_ids = _position_ids(batch, seq_len, input_ids.device)
        if self.is_first:
            inputs_embeds = self.wte(input_ids)
            hidden = inputs_embeds + self.wpe(position_ids).to(inputs_embeds.device)
            token_type_ids = batch.get("token_type_ids")
            if token_type_ids is not None:
                hidden = hidden + self.wte(token_type_ids.view(-1, seq_len))
            hidden = self.drop(hidden)
        hidden = self._check_hidden(hidden)
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        for block in self.blocks:
            hidden = block(hidden, None, causal_mask, None, use_cache=False, position_ids=position_ids)
        if not self.is_last:
            return hidden
        logits = self._kept(self.lm_head(self.ln_f(hidden)))
        labels = _require(batch, "labels", self)
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size)


class LlamaStage(PipelineStage):
    """A slice of ``LlamaForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss].

    Every stage holds the (parameter-free) rotary embedding and recomputes cos/sin and the causal +
    padding mask from ``batch``.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        inner = model.model
        self.config = model.config
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary_emb = inner.rotary_emb
        if self.is_first:
            self.embed_tokens = inner.embed_tokens
        if self.is_last:
            self.norm = inner.norm
            self.lm_head = model.lm_head
            self.loss_function: Callable[..., torch.Tensor] = model.loss_function

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of Llama (see :class:`PipelineStage`)."""
        from transformers.masking_utils import create_causal_mask

        input_ids = _require(batch, "input_ids", self)
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
        hidden = self._check_hidden(hidden)
        position_ids = _position_ids(batch, hidden.shape[1], hidden.device)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=batch.get("attention_mask"),
            past_key_values=None,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=None,
                use_cache=False,
            )
        if not self.is_last:
            return hidden
        logits = self._kept(self.lm_head(self.norm(hidden)))
        labels = _require(batch, "labels", self)
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


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

    First stage: ``embeddings``; every stage: encoder layers with the bidirectional padding mask rebuilt
    from ``batch["attention_mask"]``; last stage: ``pooler`` -> ``dropout`` -> ``classifier`` (BERT) or
    ``classifier`` on the sequence output (RoBERTa/ELECTRA-style heads) and the classification loss.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        base = getattr(model, model.base_model_prefix)
        self.config = model.config
        self.layers = nn.ModuleList(base.encoder.layer[start:end])
        if self.is_first:
            self.embeddings = base.embeddings
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
                input_ids=_require(batch, "input_ids", self),
                token_type_ids=batch.get("token_type_ids"),
                position_ids=batch.get("position_ids"),
            )
        hidden = self._check_hidden(hidden)
        attention_mask = batch.get("attention_mask")
        if self.config.is_decoder:
            mask = create_causal_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, past_key_values=None
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
        labels = _require(batch, "labels", self)
        return sequence_classification_loss(self.config, self._kept(logits), labels)


class SequentialStage(PipelineStage):
    """A slice of an ``nn.Sequential``.

    The first stage reads ``batch["input"]``; the last applies ``loss_fn`` to ``batch["labels"]``.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_index: int,
        num_stages: int,
        start: int,
        end: int,
        loss_fn: LossFn,
    ) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        self.layers = nn.Sequential(*modules)
        self.loss_fn = loss_fn

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the Sequential (see :class:`PipelineStage`)."""
        if self.is_first:
            hidden = _require(batch, "input", self)
        out = self.layers(self._check_hidden(hidden))
        if not self.is_last:
            return out
        return self.loss_fn(self._kept(out), _require(batch, "labels", self))


class ResNetStage(PipelineStage):
    """A slice of :class:`aqsgd.models.resnet.ResNet`: [stem] -> residual blocks -> [head + loss].

    The first stage reads ``batch["pixel_values"]``; the last applies ``loss_fn`` to ``batch["labels"]``.
    """

    def __init__(
        self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int, loss_fn: LossFn
    ) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        self.blocks = nn.ModuleList(model.blocks[start:end])
        if self.is_first:
            self.stem = model.stem
        if self.is_last:
            self.head = model.head
        self.loss_fn = loss_fn

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the ResNet (see :class:`PipelineStage`)."""
        if self.is_first:
            hidden = self.stem(_require(batch, "pixel_values", self))
        hidden = self._check_hidden(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        if not self.is_last:
            return hidden
        return self.loss_fn(self._kept(self.head(hidden)), _require(batch, "labels", self))
