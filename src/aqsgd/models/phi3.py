"""The ``phi3`` family: transformers ``Phi3ForCausalLM``.

Recipe config: a ``Phi3Config`` keyword dict (or ``config.to_dict()``); its ``model_type``, if present,
must be ``"phi3"``.  Cut like :mod:`~aqsgd.models.llama` (the generic
:class:`~aqsgd.models.decoder.DecoderStage`; the fused ``qkv_proj`` / ``gate_up_proj`` live inside the
layers); every layer uses one mask, sliding-window when ``config.sliding_window`` is set.  The rotary
embedding's ``inv_freq`` (``longrope`` included) is recomputed after loading weights.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "phi3"


class Phi3Stage(DecoderStage):
    """A slice of ``Phi3ForCausalLM``: [embed_tokens] -> decoder layers -> [norm + lm_head + loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="phi3",
        model_class="Phi3ForCausalLM",
        modeling_module="transformers.models.phi3.modeling_phi3",
        rotary_class="Phi3RotaryEmbedding",
        masks="sliding-window",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "phi3", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "max_position_embeddings": max(64, seq_len),
            "original_max_position_embeddings": max(64, seq_len), "sliding_window": max(2, seq_len // 4),
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


# the fused query/key/value projection and the attention output
FAMILY = decoder_family(Phi3Stage, tiny_config=_tiny_config, lora_targets=("o_proj", "qkv_proj"))
