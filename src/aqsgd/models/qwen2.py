"""The ``qwen2`` family: transformers ``Qwen2ForCausalLM``.

Recipe config: a ``Qwen2Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"qwen2"``.  Cut like :mod:`~aqsgd.models.llama` (the generic
:class:`~aqsgd.models.decoder.DecoderStage`); each layer gets the mask of its entry in
``config.layer_types`` (``"sliding_attention"`` for the layers from ``max_window_layers`` on when
``use_sliding_window`` is set, ``"full_attention"`` otherwise).  Small Qwen2 models tie the LM head to
the embedding: the first and last stage then both hold that parameter.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "qwen2"


class Qwen2Stage(DecoderStage):
    """A slice of ``Qwen2ForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="qwen2",
        model_class="Qwen2ForCausalLM",
        modeling_module="transformers.models.qwen2.modeling_qwen2",
        rotary_class="Qwen2RotaryEmbedding",
        masks="layer-types",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    # Sliding-window attention on the second half of the layers, with a window shorter than the sequence.
    return {"model_type": "qwen2", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len), "use_sliding_window": True,
            "sliding_window": max(2, seq_len // 4), "max_window_layers": layers // 2, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}


FAMILY = decoder_family(Qwen2Stage, tiny_config=_tiny_config)
