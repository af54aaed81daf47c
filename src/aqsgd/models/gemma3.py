"""The ``gemma3`` family: transformers ``Gemma3ForCausalLM``, the text-only Gemma-3 (``model_type``
``"gemma3_text"``; the multimodal ``"gemma3"`` checkpoints are not served).

Recipe config: a ``Gemma3TextConfig`` keyword dict (or ``config.to_dict()``); its ``model_type``, if
present, must be ``"gemma3_text"``.  Cut like :mod:`~aqsgd.models.gemma2` (scaled embedding, per-layer
sliding-window / full masks from ``config.layer_types``, final logit soft-capping when
``config.final_logit_softcapping`` is set, tied LM head), and:

* the rotary embedding keeps one frequency set per layer type (local and global layers use different
  bases): every stage computes cos/sin for the layer types of its layers, and the non-persistent
  ``<type>_inv_freq`` buffers are recomputed after loading weights;
* ``config.use_bidirectional_attention`` makes the masks bidirectional, as ``Gemma3TextModel`` does.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family, embed_scale_buffers

KIND = "gemma3"
_MODULE = "transformers.models.gemma3.modeling_gemma3"


class Gemma3Stage(DecoderStage):
    """A slice of ``Gemma3ForCausalLM``: [scaled embed_tokens] -> decoder layers -> [norm + lm_head +
    soft-cap + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="gemma3_text",
        model_class="Gemma3ForCausalLM",
        modeling_module=_MODULE,
        rotary_class="Gemma3RotaryEmbedding",
        masks="layer-types",
        rotary_per_layer_type=True,
        bidirectional_option=True,
        softcap_logits=True,
        layer_kwargs=(),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    # Local and global layers alternate (the real models have five local layers per global one).
    head_dim = hidden // 4
    return {"model_type": "gemma3_text", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "vocab_size": vocab,
            "max_position_embeddings": max(64, seq_len), "sliding_window": max(2, seq_len // 4),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "final_logit_softcapping": 30.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": True}


FAMILY = decoder_family(
    Gemma3Stage,
    tiny_config=_tiny_config,
    extra_buffer_initializers=((_MODULE, "Gemma3TextScaledWordEmbedding", embed_scale_buffers),),
)
