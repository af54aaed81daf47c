"""The ``gemma2`` family: transformers ``Gemma2ForCausalLM``.

Recipe config: a ``Gemma2Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"gemma2"``.  Cut like :mod:`~aqsgd.models.llama` (the generic
:class:`~aqsgd.models.decoder.DecoderStage`), with Gemma's particulars:

* the token embedding multiplies by ``sqrt(hidden_size)`` (its non-persistent ``embed_scale`` buffer is
  recomputed after loading weights);
* local (sliding-window) and global layers alternate: each layer gets the mask of its entry in
  ``config.layer_types``;
* the last stage soft-caps the logits, ``cap * tanh(logits / cap)`` with
  ``config.final_logit_softcapping`` (the attention soft-capping lives inside the layers);
* the LM head is tied to the embedding: the first and last stage both hold that parameter.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family, embed_scale_buffers

KIND = "gemma2"
_MODULE = "transformers.models.gemma2.modeling_gemma2"


class Gemma2Stage(DecoderStage):
    """A slice of ``Gemma2ForCausalLM``: [scaled embed_tokens] -> decoder layers -> [norm + lm_head +
    soft-cap + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="gemma2",
        model_class="Gemma2ForCausalLM",
        modeling_module=_MODULE,
        rotary_class="Gemma2RotaryEmbedding",
        masks="layer-types",
        softcap_logits=True,
        layer_kwargs=(),
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    head_dim = hidden // 4
    return {"model_type": "gemma2", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "query_pre_attn_scalar": head_dim, "vocab_size": vocab,
            "max_position_embeddings": max(64, seq_len), "sliding_window": max(2, seq_len // 4),
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}


FAMILY = decoder_family(
    Gemma2Stage,
    tiny_config=_tiny_config,
    extra_buffer_initializers=((_MODULE, "Gemma2TextScaledWordEmbedding", embed_scale_buffers),),
)
