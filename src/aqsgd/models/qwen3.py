"""The ``qwen3`` family: transformers ``Qwen3ForCausalLM``.

Recipe config: a ``Qwen3Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"qwen3"``.  Cut like :mod:`~aqsgd.models.qwen2` (per-layer masks from ``config.layer_types``;
the q/k norms live inside the layers).  Small Qwen3 models tie the LM head to the embedding.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "qwen3"


class Qwen3Stage(DecoderStage):
    """A slice of ``Qwen3ForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="qwen3",
        model_class="Qwen3ForCausalLM",
        modeling_module="transformers.models.qwen3.modeling_qwen3",
        rotary_class="Qwen3RotaryEmbedding",
        masks="layer-types",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "qwen3", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "vocab_size": vocab, "max_position_embeddings": max(64, seq_len),
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}


FAMILY = decoder_family(Qwen3Stage, tiny_config=_tiny_config)
