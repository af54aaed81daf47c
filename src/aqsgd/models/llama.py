"""The ``llama`` family: transformers ``LlamaForCausalLM``.

Recipe config: a ``LlamaConfig`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"llama"``.  The model cuts between its decoder layers: the first stage also holds the token
embedding, the last the final norm and the LM head.  Every stage holds the (parameter-free) rotary
embedding, whose non-persistent ``inv_freq`` is recomputed after loading weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aqsgd.errors import WeightsError
from aqsgd.models.family import ModelFamily, ModelLayout
from aqsgd.models.hf import build_transformers_model, is_transformers_instance, position_ids, set_dropout
from aqsgd.pipeline.stage import Batch, LossFn, PipelineStage

KIND = "llama"


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

        input_ids = self.require(batch, "input_ids")
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
        hidden = self._check_hidden(hidden)
        positions = position_ids(batch, hidden.shape[1], hidden.device)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=batch.get("attention_mask"),
            past_key_values=None,
            position_ids=positions,
        )
        position_embeddings = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=positions,
                past_key_values=None,
                use_cache=False,
            )
        if not self.is_last:
            return hidden
        logits = self._kept(self.lm_head(self.norm(hidden)))
        labels = self.require(batch, "labels")
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


def _layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
    inner = model.model
    return ModelLayout(
        KIND,
        list(inner.layers[: model.config.num_hidden_layers]),
        [inner.embed_tokens],
        [inner.norm, model.lm_head],
        lambda i, s, a, b: LlamaStage(model, i, s, a, b),
    )


def rotary_embedding_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``inv_freq`` / ``original_inv_freq`` of a transformers rotary embedding.

    Uses the module's own ``compute_default_rope_parameters`` for ``rope_type == "default"`` and
    ``ROPE_INIT_FUNCTIONS[rope_type]`` otherwise, exactly as the rotary ``__init__`` (and
    ``PreTrainedModel._init_weights``) of transformers 5 do.  Computed on CPU as in a CPU build.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = module.rope_type
    init_fns: dict[str, Callable[..., tuple[torch.Tensor, float]] | None] = {
        "default": getattr(module, "compute_default_rope_parameters", None),
        **ROPE_INIT_FUNCTIONS,
    }
    init_fn = init_fns.get(rope_type)
    if init_fn is None:
        raise WeightsError(f"{type(module).__name__}: no rope initializer for rope_type {rope_type!r}")
    with torch.device("cpu"):
        inv_freq, _ = init_fn(module.config)
    values = {"inv_freq": inv_freq}
    if "original_inv_freq" in module._buffers:
        values["original_inv_freq"] = inv_freq.clone()
    return values


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


FAMILY = ModelFamily(
    kind=KIND,
    description="transformers LlamaForCausalLM",
    stage=LlamaStage,
    build=lambda config, attn: build_transformers_model(
        config, attn, "AutoModelForCausalLM", kind=KIND, model_type="llama"
    ),
    matches=lambda model: is_transformers_instance(model, "LlamaForCausalLM"),
    layout=_layout,
    tiny_config=_tiny_config,
    task_kind="causal-lm",
    model_types=("llama",),
    blocks_key="num_hidden_layers",
    dropout=set_dropout,
    buffer_initializers=(
        ("transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding", rotary_embedding_buffers),
    ),
)
