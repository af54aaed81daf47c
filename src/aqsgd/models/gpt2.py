"""The ``gpt2`` family: transformers ``GPT2LMHeadModel``.

Recipe config: a ``GPT2Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"gpt2"``.  The model cuts between its transformer blocks ``transformer.h``: the first stage also
holds the token and position embeddings, the last the final norm and the LM head (tied to the token
embedding, so both stages hold that parameter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.hf import (build_transformers_model, is_transformers_instance, no_cache, position_ids,
                             set_dropout)
from aqsgd.models.stage import Batch, LossFn, PipelineStage

KIND = "gpt2"


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

        input_ids = self.require(batch, "input_ids")
        batch_size, seq_len = input_ids.shape
        positions = position_ids(batch, seq_len, input_ids.device)
        if self.is_first:
            inputs_embeds = self.wte(input_ids)
            hidden = inputs_embeds + self.wpe(positions).to(inputs_embeds.device)
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
            **no_cache(create_causal_mask),
            position_ids=positions,
        )
        for block in self.blocks:
            hidden = block(hidden, None, causal_mask, None, use_cache=False, position_ids=positions)
        if not self.is_last:
            return hidden
        logits = self._kept(self.lm_head(self.ln_f(hidden)))
        labels = self.require(batch, "labels")
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size)


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    t = model.transformer
    return ModelLayout(
        KIND,
        list(t.h),
        [t.wte, t.wpe],
        [t.ln_f, model.lm_head],
        lambda i, s, a, b: GPT2Stage(model, i, s, a, b),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": 4, "vocab_size": vocab,
            "n_positions": max(64, seq_len), "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": 0, "eos_token_id": 0}


FAMILY = ModelFamily(
    kind=KIND,
    description="transformers GPT2LMHeadModel",
    stage=GPT2Stage,
    build=lambda config, attn: build_transformers_model(
        config, attn, "AutoModelForCausalLM", kind=KIND, model_type="gpt2"
    ),
    matches=lambda model: is_transformers_instance(model, "GPT2LMHeadModel"),
    layout=_layout,
    tiny_config=_tiny_config,
    task_kind="causal-lm",
    model_types=("gpt2",),
    blocks_key="n_layer",
    dropout=set_dropout,
    auto_class="AutoModelForCausalLM",
    lora_targets=("c_attn", "c_proj"),  # attn.c_attn (query, key, value fused) and attn.c_proj, its output
)
