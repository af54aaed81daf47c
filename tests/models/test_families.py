"""The model family registry: every kind has every piece, and the family questions have one-line answers."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import aqsgd
from aqsgd.errors import SpecError
from aqsgd.models import (
    MODEL_KINDS,
    families,
    family_for,
    family_of_model,
    get_family,
    supported_models,
    tiny_recipe,
    truncate_config,
    with_dropout,
)
from aqsgd.models.family import ModelLayout
from aqsgd.pipeline.materialize import ModelRecipe
from aqsgd.pipeline.partition import model_layout, partition_model
from aqsgd.models.stage import PipelineStage

pytest.importorskip("transformers")


def test_kinds_and_order() -> None:
    assert MODEL_KINDS == ("gpt2", "llama", "bert-cls", "resnet", "sequential-mlp", "mistral", "qwen2",
                           "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt-neox", "deberta-v2-cls",
                           "distilbert-cls")
    assert [f.kind for f in families()] == list(MODEL_KINDS)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_every_family_has_every_piece(kind: str) -> None:
    family = get_family(kind)
    assert family.kind == kind
    assert family.description and family.description in supported_models()
    assert issubclass(family.stage, PipelineStage)
    for piece in (family.build, family.matches, family.layout, family.tiny_config):
        assert callable(piece)
    for module_name, class_name, initializer in family.buffer_initializers:
        assert issubclass(getattr(importlib.import_module(module_name), class_name), nn.Module)
        assert callable(initializer)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_tiny_model_is_recognised_and_cut_by_its_family(kind: str) -> None:
    recipe = tiny_recipe(kind, layers=3, hidden=32, vocab=64, seq_len=16)
    assert recipe.kind == kind and recipe.weights is None
    model = recipe.build("meta")
    assert family_of_model(model) is get_family(kind)
    layout = model_layout(model)
    assert isinstance(layout, ModelLayout) and layout.family == kind
    stages = partition_model(model, 2)
    assert all(type(s) is get_family(kind).stage for s in stages)
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    if get_family(kind).blocks_key is not None:
        assert len(layout.blocks) == 3


def test_tiny_lm_configs_are_pinned() -> None:
    # Weights files, fingerprints and the golden losses depend on these exact dicts.
    assert tiny_recipe("gpt2", layers=4, hidden=32, vocab=64, seq_len=16).config == {
        "model_type": "gpt2", "n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
    assert tiny_recipe() == ModelRecipe("llama", {
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False})
    assert tiny_recipe("llama", seq_len=100).config["max_position_embeddings"] == 100


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_unknown_kind_is_one_line_listing_the_kinds() -> None:
    with pytest.raises(SpecError) as exc:
        get_family("t5")
    message = _one_line(exc)
    assert "'t5'" in message and all(kind in message for kind in MODEL_KINDS)
    with pytest.raises(SpecError, match="unknown model kind"):
        tiny_recipe("t5")
    with pytest.raises(SpecError, match="unknown model kind"):
        ModelRecipe(["not", "a", "kind"])  # type: ignore[arg-type]


def test_unsupported_model_is_one_line_listing_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported model type Linear") as exc:
        family_of_model(nn.Linear(2, 2))
    assert all(f.description in _one_line(exc) for f in families())
    from aqsgd.pipeline import SUPPORTED_MODELS
    from aqsgd.pipeline.partition import SUPPORTED_MODELS as from_partition

    assert SUPPORTED_MODELS == from_partition == supported_models()


def test_family_for_model_types() -> None:
    assert family_for("gpt2", "causal-lm") == "gpt2"
    assert family_for("llama", "causal-lm") == "llama"
    assert family_for("bert", "sequence-classification") == "bert-cls"
    assert family_for("roberta", "sequence-classification") == "bert-cls"
    assert family_for("mistral", "causal-lm") == "mistral"
    expected = (
        "causal-lm pipelines support model_type gemma2, gemma3_text, gpt2, gpt_neox, llama, mistral, olmo2, "
        "phi3, qwen2, qwen3, not 't5'"
    )
    with pytest.raises(SpecError, match=expected) as e:
        family_for("t5", "causal-lm")
    _one_line(e)
    with pytest.raises(SpecError, match="task kinds: causal-lm, sequence-classification") as e:
        family_for("bert", "image-classification")
    _one_line(e)


def test_truncate_config() -> None:
    gpt2 = tiny_recipe("gpt2").config
    assert truncate_config("gpt2", gpt2, None) is gpt2
    assert truncate_config("gpt2", gpt2, 2) == {**gpt2, "n_layer": 2}
    llama = tiny_recipe("llama").config
    assert truncate_config("llama", llama, 1)["num_hidden_layers"] == 1
    assert get_family("bert-cls").truncate_config({"num_hidden_layers": 6}, 3) == {"num_hidden_layers": 3}
    with pytest.raises(SpecError, match="the model has only 4 blocks, asked for 5"):
        truncate_config("llama", llama, 5)
    with pytest.raises(SpecError, match="no 'n_layer'"):
        truncate_config("gpt2", {}, 2)
    with pytest.raises(SpecError, match="resnet models have no block count to truncate") as e:
        truncate_config("resnet", tiny_recipe("resnet").config, 2)
    _one_line(e)


def test_with_dropout() -> None:
    gpt2 = tiny_recipe("gpt2")
    assert with_dropout(gpt2, None) is gpt2
    off = with_dropout(gpt2, 0.25)
    assert off.config["resid_pdrop"] == off.config["embd_pdrop"] == off.config["attn_pdrop"] == 0.25
    assert off.config["n_embd"] == gpt2.config["n_embd"] and off.weights == gpt2.weights
    bert = with_dropout(tiny_recipe("bert-cls"), 0.0)
    assert bert.config["classifier_dropout"] == 0.0 and bert.config["hidden_dropout_prob"] == 0.0
    llama = with_dropout(ModelRecipe("llama", {**tiny_recipe().config, "attention_dropout": 0.1}), 0.5)
    assert llama.config["attention_dropout"] == 0.5 and "classifier_dropout" not in llama.config
    assert get_family("llama").with_dropout({"hidden_act": "silu"}, 0.5) == {"hidden_act": "silu"}
    for kind in ("resnet", "sequential-mlp"):
        with pytest.raises(SpecError, match=f"{kind} models have no dropout setting") as e:
            with_dropout(tiny_recipe(kind), 0.0)
        _one_line(e)


def test_tiny_models_run_on_cpu() -> None:
    torch.manual_seed(0)
    resnet = tiny_recipe("resnet").build("cpu")
    assert resnet(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    mlp = tiny_recipe("sequential-mlp", layers=3, hidden=16).build("cpu")
    assert mlp(torch.randn(2, 16)).shape == (2, 10)
    bert = tiny_recipe("bert-cls", layers=2, hidden=32, vocab=50).build("cpu")
    assert bert(input_ids=torch.randint(0, 50, (2, 8))).logits.shape == (2, 2)


def test_registry_import_is_light() -> None:
    src = str(Path(aqsgd.__file__).resolve().parents[1])
    code = (
        "import sys, aqsgd.models; "
        "assert 'transformers' not in sys.modules and 'aqsgd.pipeline' not in sys.modules; "
        "import aqsgd.models.gpt2; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": src})


def test_no_cache_uses_the_installed_mask_builders_name():
    from transformers.masking_utils import create_causal_mask

    from aqsgd.models.hf import no_cache

    def new_style(config, inputs_embeds, attention_mask, cache, position_ids=None): ...

    def old_style(config, inputs_embeds, attention_mask, past_key_values, position_ids=None): ...

    assert no_cache(new_style) == {"cache": None}
    assert no_cache(old_style) == {"past_key_values": None}
    (name,) = no_cache(create_causal_mask)
    assert name in ("cache", "past_key_values")
