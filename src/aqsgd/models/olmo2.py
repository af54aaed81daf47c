"""The ``olmo2`` family: transformers ``Olmo2ForCausalLM``.

Recipe config: an ``Olmo2Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"olmo2"``.  Cut like :mod:`~aqsgd.models.llama` (the generic
:class:`~aqsgd.models.decoder.DecoderStage` with one causal mask; OLMo-2's post-norms and q/k norms live
inside the layers).
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "olmo2"


class Olmo2Stage(DecoderStage):
    """A slice of ``Olmo2ForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="olmo2",
        model_class="Olmo2ForCausalLM",
        modeling_module="transformers.models.olmo2.modeling_olmo2",
        rotary_class="Olmo2RotaryEmbedding",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "olmo2", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


FAMILY = decoder_family(Olmo2Stage, tiny_config=_tiny_config)
