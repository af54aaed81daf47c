"""The ``mistral`` family: transformers ``MistralForCausalLM``.

Recipe config: a ``MistralConfig`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"mistral"``.  Cut like :mod:`~aqsgd.models.llama` (the generic
:class:`~aqsgd.models.decoder.DecoderStage`); every layer uses one mask, sliding-window when
``config.sliding_window`` is set (as ``MistralModel.forward`` builds it), causal otherwise.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "mistral"


class MistralStage(DecoderStage):
    """A slice of ``MistralForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="mistral",
        model_class="MistralForCausalLM",
        modeling_module="transformers.models.mistral.modeling_mistral",
        rotary_class="MistralRotaryEmbedding",
        masks="sliding-window",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    # A window shorter than the sequence, so that the sliding-window mask matters.
    return {"model_type": "mistral", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len),
            "sliding_window": max(2, seq_len // 4), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False}


FAMILY = decoder_family(MistralStage, tiny_config=_tiny_config)
