"""The generic decoder-only causal LM stage shared by the Llama-like families.

Most transformers causal LMs are laid out the same way: ``<base>.<embedding>`` -> ``<base>.layers`` ->
``<base>.<final norm>`` -> ``lm_head``, with a parameter-free rotary embedding ``<base>.rotary_emb`` that
turns position ids into the cos/sin every layer needs.  They differ in a few details, which a
:class:`DecoderSpec` names, so that one :class:`DecoderStage` serves them all:

* the attention masks: one causal mask (Llama, OLMo-2, GPT-NeoX); one mask that is sliding-window when
  ``config.sliding_window`` is set (Mistral, Phi-3); or one mask per layer type, chosen per layer from
  ``config.layer_types`` (Qwen2/3, Gemma-2/3: ``"full_attention"`` or ``"sliding_attention"``);
* the rotary embedding: one for all layers, or one per layer type (Gemma-3, whose local and global layers
  use different bases);
* the keyword arguments of a decoder layer call (Gemma's layers take no ``use_cache``; no call passes a KV
  cache, whose parameter every layer defaults to none, whatever the transformers version names it);
* final logit soft-capping (Gemma-2/3: ``cap * tanh(logits / cap)``) and an embedding dropout (GPT-NeoX);
* embedding scaling (Gemma multiplies by ``sqrt(hidden)``) lives in the embedding module itself, whose
  non-persistent ``embed_scale`` buffer the family recomputes after loading weights.

Each family module (:mod:`~aqsgd.models.llama`, :mod:`~aqsgd.models.mistral`, ...) subclasses
:class:`DecoderStage` with its spec and builds its ``FAMILY`` with :func:`decoder_family`.  Every stage
computes exactly what the model's own ``forward`` computes for its slice of layers, from the masks and
position embeddings it rebuilds from ``batch``: the pipelined loss and gradients equal the unsplit model's.

Recipe kinds are named after the transformers ``model_type`` they serve (``gemma3`` serves
``gemma3_text``, the text-only ``Gemma3ForCausalLM``; ``gpt-neox`` serves ``gpt_neox``), one family per
model type so that a recipe pins the architecture and an unsupported model type is named in errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from aqsgd.errors import WeightsError
from aqsgd.models.family import BufferInitializer, ModelFamily, ModelLayout
from aqsgd.models.hf import (
    build_transformers_model,
    is_transformers_instance,
    no_cache,
    position_ids,
    set_dropout,
)
from aqsgd.models.stage import Batch, LossFn, PipelineStage

MASK_MODES = ("causal", "sliding-window", "layer-types")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections of most decoders: what LoRA adapts by default."""


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes one decoder-only family from another.

    Attributes:
        kind: the recipe kind.
        model_type: the transformers ``model_type`` of the family's config.
        model_class: the ``*ForCausalLM`` class name (exported by transformers).
        modeling_module: the transformers module defining the rotary (and embedding) classes.
        rotary_class: the rotary embedding class name in ``modeling_module``.
        base: the attribute of the ``*ForCausalLM`` model holding the decoder stack.
        embed: the token embedding attribute of the base model.
        norm: the final norm attribute of the base model.
        embed_dropout: the dropout applied to the embeddings (attribute of the base model), or None.
        masks: ``"causal"`` (one causal mask), ``"sliding-window"`` (one mask, sliding-window when
            ``config.sliding_window`` is set) or ``"layer-types"`` (one mask per entry of
            ``config.layer_types``).
        rotary_per_layer_type: the rotary embedding takes the layer type (one cos/sin per layer type).
        bidirectional_option: ``config.use_bidirectional_attention`` turns the masks bidirectional
            (Gemma-3 used as an encoder).
        softcap_logits: ``config.final_logit_softcapping``, when set, caps the logits.
        layer_kwargs: the fixed ``(name, value)`` keyword arguments of every decoder layer call (never a KV
            cache: the layers default to none).
    """

    kind: str
    model_type: str
    model_class: str
    modeling_module: str
    rotary_class: str
    base: str = "model"
    embed: str = "embed_tokens"
    norm: str = "norm"
    embed_dropout: str | None = None
    masks: str = "causal"
    rotary_per_layer_type: bool = False
    bidirectional_option: bool = False
    softcap_logits: bool = False
    layer_kwargs: tuple[tuple[str, Any], ...] = (("use_cache", False),)

    def __post_init__(self) -> None:
        if self.masks not in MASK_MODES:
            raise ValueError(f"masks must be one of {MASK_MODES}, got {self.masks!r}")


def _always(*args: Any) -> torch.Tensor:
    """Mask overlay allowing every (query, key) pair."""
    return torch.tensor(True, dtype=torch.bool)


def _within_window(sliding_window: int) -> Callable[[Any, Any, Any, Any], Any]:
    """Mask overlay allowing the pairs closer than ``sliding_window`` in either direction."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return abs(q_idx - kv_idx) < sliding_window

    return inner


class DecoderStage(PipelineStage):
    """A slice of a decoder-only ``*ForCausalLM``: [embedding] -> decoder layers -> [norm + lm_head + loss].

    Every stage holds the (parameter-free) rotary embedding and recomputes cos/sin and the attention
    masks (causal, sliding-window, padding) from ``batch``; subclasses set :attr:`spec`.
    """

    spec: ClassVar[DecoderSpec]

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, start: int, end: int) -> None:
        super().__init__(stage_index, num_stages, (start, end))
        spec = self.spec
        inner = getattr(model, spec.base)
        self.config = model.config
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary_emb = inner.rotary_emb
        if self.is_first:
            self.embed_tokens = getattr(inner, spec.embed)
            if spec.embed_dropout is not None:
                self.embed_dropout = getattr(inner, spec.embed_dropout)
        if self.is_last:
            self.norm = getattr(inner, spec.norm)
            self.lm_head = model.lm_head
            self.loss_function: Callable[..., torch.Tensor] = model.loss_function
        layer_types = getattr(self.config, "layer_types", None) if spec.masks == "layer-types" else None
        # The attention type of each held layer (global index start + i), as the model's forward picks it.
        self.layer_types: list[str] = (
            list(layer_types[start:end]) if layer_types is not None else [FULL_ATTENTION] * (end - start)
        )

    def _masks(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor
    ) -> dict[str, Any]:
        """The attention mask of each layer type the stage's layers use."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = self.config
        kwargs: dict[str, Any] = {
            "config": config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            **no_cache(create_causal_mask),
            "position_ids": positions,
        }
        if self.spec.masks == "causal":
            return {FULL_ATTENTION: create_causal_mask(**kwargs)}
        if self.spec.masks == "sliding-window":
            make = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
            return {FULL_ATTENTION: make(**kwargs)}
        full_kwargs, sliding_kwargs = kwargs, dict(kwargs)
        if self.spec.bidirectional_option and getattr(config, "use_bidirectional_attention", False):
            full_kwargs = {**kwargs, "or_mask_function": _always}
            sliding_kwargs["or_mask_function"] = _within_window(config.sliding_window)
        masks: dict[str, Any] = {}
        for layer_type in dict.fromkeys(self.layer_types):
            if layer_type == SLIDING_ATTENTION:
                masks[layer_type] = create_sliding_window_causal_mask(**sliding_kwargs)
            else:
                masks[layer_type] = create_causal_mask(**full_kwargs)
        return masks

    def _position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        """cos/sin for each layer type the stage's layers use."""
        if not self.spec.rotary_per_layer_type:
            return {FULL_ATTENTION: self.rotary_emb(hidden, position_ids=positions)}
        return {t: self.rotary_emb(hidden, positions, t) for t in dict.fromkeys(self.layer_types)}

    def forward(self, hidden: torch.Tensor | None, batch: Batch) -> torch.Tensor:
        """Run this slice of the decoder (see :class:`PipelineStage`)."""
        input_ids = self.require(batch, "input_ids")
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
        hidden = self._check_hidden(hidden)
        positions = position_ids(batch, hidden.shape[1], hidden.device)
        masks = self._masks(hidden, batch.get("attention_mask"), positions)
        if self.is_first and self.spec.embed_dropout is not None:
            hidden = self.embed_dropout(hidden)
        position_embeddings = self._position_embeddings(hidden, positions)
        layer_kwargs = dict(self.spec.layer_kwargs)
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            hidden = layer(
                hidden,
                attention_mask=masks[layer_type if layer_type in masks else FULL_ATTENTION],
                position_embeddings=position_embeddings[
                    layer_type if layer_type in position_embeddings else FULL_ATTENTION
                ],
                position_ids=positions,
                **layer_kwargs,
            )
        if not self.is_last:
            return hidden
        logits = self.lm_head(self.norm(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None) if self.spec.softcap_logits else None
        if cap is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        logits = self._kept(logits)
        labels = self.require(batch, "labels")
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


def decoder_layout(stage: type[DecoderStage]) -> Callable[[nn.Module, LossFn], ModelLayout]:
    """``layout(model, loss_fn)`` of the family whose stage class is ``stage``."""
    spec = stage.spec

    def layout(model: nn.Module, loss_fn: LossFn) -> ModelLayout:
        inner = getattr(model, spec.base)
        return ModelLayout(
            spec.kind,
            list(inner.layers[: model.config.num_hidden_layers]),
            [getattr(inner, spec.embed)],
            [getattr(inner, spec.norm), model.lm_head],
            lambda i, s, a, b: stage(model, i, s, a, b),
        )

    return layout


def _rope_init_fn(module: nn.Module, rope_type: str) -> Callable[..., tuple[torch.Tensor, float]]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init_fns: dict[str, Callable[..., tuple[torch.Tensor, float]] | None] = {
        "default": getattr(module, "compute_default_rope_parameters", None),
        **ROPE_INIT_FUNCTIONS,
    }
    init_fn = init_fns.get(rope_type)
    if init_fn is None:
        raise WeightsError(f"{type(module).__name__}: no rope initializer for rope_type {rope_type!r}")
    return init_fn


def rotary_embedding_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``inv_freq`` / ``original_inv_freq`` of a transformers rotary embedding.

    Uses the module's own ``compute_default_rope_parameters`` for ``rope_type == "default"`` and
    ``ROPE_INIT_FUNCTIONS[rope_type]`` otherwise, exactly as the rotary ``__init__`` (and
    ``PreTrainedModel._init_weights``) of transformers 5 do.  Computed on CPU as in a CPU build.
    """
    init_fn = _rope_init_fn(module, module.rope_type)
    with torch.device("cpu"):
        inv_freq, _ = init_fn(module.config)
    values = {"inv_freq": inv_freq}
    if "original_inv_freq" in module._buffers:
        values["original_inv_freq"] = inv_freq.clone()
    return values


def layer_type_rotary_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``<type>_inv_freq`` / ``<type>_original_inv_freq`` of a rotary embedding with one frequency set per
    layer type (Gemma-3), computed as its ``__init__`` does for every type with rope parameters."""
    values: dict[str, torch.Tensor] = {}
    for layer_type, rope_type in module.rope_type.items():
        init_fn = _rope_init_fn(module, rope_type)
        with torch.device("cpu"):
            inv_freq, _ = init_fn(module.config, layer_type=layer_type)
        values[f"{layer_type}_inv_freq"] = inv_freq
        if f"{layer_type}_original_inv_freq" in module._buffers:
            values[f"{layer_type}_original_inv_freq"] = inv_freq.clone()
    return values


def embed_scale_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """``embed_scale`` of a scaled word embedding (Gemma: ``sqrt(hidden_size)``), from the float the module
    keeps as ``scalar_embed_scale``."""
    return {"embed_scale": torch.tensor(module.scalar_embed_scale)}


def decoder_family(
    stage: type[DecoderStage],
    *,
    tiny_config: Callable[..., dict[str, Any]],
    extra_buffer_initializers: tuple[tuple[str, str, BufferInitializer], ...] = (),
    checkpoint_renames: tuple[tuple[str, str], ...] = (),
    lora_targets: tuple[str, ...] = ATTENTION_PROJECTIONS,
) -> ModelFamily:
    """The :class:`ModelFamily` of a decoder-only family from its stage class (which carries the spec);
    ``extra_buffer_initializers``, ``checkpoint_renames`` and ``lora_targets`` (default: the separate
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` most decoders have) as in :class:`ModelFamily`."""
    spec = stage.spec
    rotary_init = layer_type_rotary_buffers if spec.rotary_per_layer_type else rotary_embedding_buffers
    return ModelFamily(
        kind=spec.kind,
        description=f"transformers {spec.model_class}",
        stage=stage,
        build=lambda config, attn: build_transformers_model(
            config, attn, "AutoModelForCausalLM", kind=spec.kind, model_type=spec.model_type
        ),
        matches=lambda model: is_transformers_instance(model, spec.model_class),
        layout=decoder_layout(stage),
        tiny_config=tiny_config,
        task_kind="causal-lm",
        model_types=(spec.model_type,),
        blocks_key="num_hidden_layers",
        dropout=set_dropout,
        buffer_initializers=((spec.modeling_module, spec.rotary_class, rotary_init),
                             *extra_buffer_initializers),
        auto_class="AutoModelForCausalLM",
        checkpoint_renames=checkpoint_renames,
        lora_targets=lora_targets,
    )

