"""The ``gpt-neox`` family: transformers ``GPTNeoXForCausalLM`` (``model_type`` ``"gpt_neox"``: Pythia,
GPT-NeoX).

Recipe config: a ``GPTNeoXConfig`` keyword dict (or ``config.to_dict()``); its ``model_type``, if
present, must be ``"gpt_neox"``.  The model cuts between ``gpt_neox.layers``: the first stage also holds
the embedding ``embed_in`` and its dropout, the last the ``final_layer_norm`` and the LM head
(``lm_head`` in the module, ``embed_out`` in the checkpoints ``save_pretrained`` writes: the family's
``checkpoint_renames`` let a stage find it there).  Every stage holds the rotary embedding (partial
rotary, ``rotary_pct`` of each head), whose ``inv_freq`` is recomputed after loading weights.  The stage
is the generic :class:`~aqsgd.models.decoder.DecoderStage` with one causal mask.
"""

from __future__ import annotations

from typing import Any

from aqsgd.models.decoder import DecoderSpec, DecoderStage, decoder_family

KIND = "gpt-neox"


class GPTNeoXStage(DecoderStage):
    """A slice of ``GPTNeoXForCausalLM``: [embed_in + dropout] -> layers -> [final_layer_norm + lm_head +
    loss]."""

    spec = DecoderSpec(
        kind=KIND,
        model_type="gpt_neox",
        model_class="GPTNeoXForCausalLM",
        modeling_module="transformers.models.gpt_neox.modeling_gpt_neox",
        rotary_class="GPTNeoXRotaryEmbedding",
        base="gpt_neox",
        embed="embed_in",
        norm="final_layer_norm",
        embed_dropout="emb_dropout",
    )


def _tiny_config(*, layers: int, hidden: int, vocab: int, seq_len: int) -> dict[str, Any]:
    return {"model_type": "gpt_neox", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "vocab_size": vocab,
            "max_position_embeddings": max(64, seq_len), "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


FAMILY = decoder_family(
    GPTNeoXStage,
    tiny_config=_tiny_config,
    checkpoint_renames=(("lm_head.", "embed_out."),),
    lora_targets=("query_key_value", "dense"),  # the fused projection and attention.dense, its output
)
