"""The ``llama`` family: transformers ``LlamaForCausalLM``.

Recipe config: a ``LlamaConfig`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"llama"``.  The model cuts between its decoder layers: the first stage also holds the token
embedding, the last the final norm and the LM head (tied to the embedding when
``tie_word_embeddings`` is set: then both stages hold that parameter).  Every stage holds the
(parameter-free) rotary embedding, whose non-persistent ``inv_freq`` is recomputed after loading weights.
The stage is the generic :class:`~aqsgd.models.decoder.DecoderStage` with one causal mask.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family, rotary_embedding_buffers

KIND = "llama"

__all__ = ["FAMILY", "KIND", "LlamaStage", "rotary_embedding_buffers"]


class LlamaStage(DecoderStage):
    """A slice of ``LlamaForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss].

    Every stage holds the (parameter-free) rotary embedding and recomputes cos/sin and the causal +
    padding mask from ``batch``.
    """

    spec = DecoderSpec(
        kind=KIND,
        model_type="llama",
        model_class="LlamaForCausalLM",
        modeling_module="transformers.models.llama.modeling_llama",
        rotary_class="LlamaRotaryEmbedding",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


FAMILY = decoder_family(LlamaStage, tiny_config=_tiny_config)
