"""The layers LoRA adapts by default: every family declares its attention projections with the family
(``ModelFamily.lora_targets``), a model of no known family is searched by name, and a run's adapters and
settings are typed (:class:`~aqsgd.train.lora.LoraSettings`) and seeded by stage alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from aqsgd.errors import SpecError
from aqsgd.models import MODEL_KINDS, tiny_recipe
from aqsgd.models.registry import get_family
from aqsgd.pipeline.partition import StageCut
from aqsgd.train.config import ModelSection, TrainConfig
from aqsgd.train.lora import LoraSettings, add_adapters, adapter_targets, lora_config

# what each family's tiny model gets without --lora-targets (the order is the one the runs record)
DEFAULT_TARGETS = {
    "gpt2": ["c_attn", "c_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "bert-cls": ["query", "key", "value"],
    "resnet": None,
    "sequential-mlp": None,
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "phi3": ["o_proj", "qkv_proj"],
    "olmo2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gpt-neox": ["query_key_value", "dense"],
    "deberta-v2-cls": ["query_proj", "key_proj", "value_proj"],
    "distilbert-cls": ["q_lin", "k_lin", "v_lin"],
}


def test_every_family_is_pinned():
    assert set(DEFAULT_TARGETS) == set(MODEL_KINDS)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_each_family_adapts_its_attention_projections_by_default(kind):
    model = tiny_recipe(kind).build("meta")
    expected = DEFAULT_TARGETS[kind]
    if expected is None:  # no attention: the user names the layers, in one line
        with pytest.raises(SpecError, match="--lora: no attention projections found in .*--lora-targets"):
            adapter_targets(model, None)
    else:
        assert adapter_targets(model, None) == expected
        assert list(get_family(kind).lora_targets) == expected


def test_the_family_not_the_names_decides(monkeypatch):
    """A family that declares fewer layers gets only those, though the model holds the others too."""
    import aqsgd.models.qwen2 as qwen2

    monkeypatch.setattr(qwen2, "FAMILY", dataclasses.replace(qwen2.FAMILY, lora_targets=("v_proj", "q_proj")))
    assert adapter_targets(tiny_recipe("qwen2").build("meta"), None) == ["v_proj", "q_proj"]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(8, 24), nn.Linear(8, 8)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = _Attention(), nn.Sequential()
        self.mlp.add_module("c_proj", nn.Linear(8, 8))
        self.q_proj, self.out = nn.Linear(8, 8), nn.Linear(8, 8)


def test_a_model_of_no_known_family_is_searched_by_name():
    assert adapter_targets(_Block(), None) == ["q_proj", "c_attn", "c_proj"]
    only_mlp = nn.Module()
    only_mlp.mlp = nn.Sequential()
    only_mlp.mlp.add_module("c_proj", nn.Linear(8, 8))  # an MLP's c_proj is no attention output
    with pytest.raises(SpecError, match="no attention projections found"):
        adapter_targets(only_mlp, None)


def test_named_targets_are_checked_against_the_model():
    model = tiny_recipe("qwen2").build("meta")
    assert adapter_targets(model, ("v_proj", "gate_proj")) == ["v_proj", "gate_proj"]
    with pytest.raises(SpecError, match="--lora-targets: no linear layer called nope"):
        adapter_targets(model, ("q_proj", "nope"))


def test_settings_come_from_the_model_section():
    section = TrainConfig.of(lora=True, lora_rank=4, lora_alpha=2.0, lora_dropout=0.1,
                             lora_targets=" q_proj, v_proj ,").model
    lora = LoraSettings.of(section)
    assert lora == LoraSettings(rank=4, alpha=2.0, dropout=0.1, targets=("q_proj", "v_proj"))
    config = lora_config(lora, ["q_proj"])
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 2.0, 0.1)
    assert config.target_modules == {"q_proj"}


def test_a_saved_config_takes_the_sections_defaults_for_what_it_lacks():
    assert LoraSettings.from_flat({}) == LoraSettings.of(ModelSection())
    saved = TrainConfig.of(lora=True, lora_rank=16, lora_targets="c_attn").flat()
    expected = LoraSettings(rank=16, alpha=16.0, dropout=0.0, targets=("c_attn",))
    assert LoraSettings.from_flat(saved) == expected


def _adapters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if ".lora_" in k}


def test_a_stage_alone_gets_the_adapters_it_gets_among_all_stages():
    """The distributed runtime injects one stage (its index given), the local one all of them: the same
    adapters, drawn from the seed and the stage index alone; only adapters (and no base weight) train."""
    lora, cut = LoraSettings(rank=4, alpha=8.0, dropout=0.0), StageCut(stages=3, layers=(1, 2, 1))
    whole = tiny_recipe("qwen2").build("cpu")
    stages = cut.cut(whole)
    assert add_adapters(stages, lora, model=whole, seed=7) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    for index, stage in enumerate(stages):
        alone = cut.cut(tiny_recipe("qwen2").build("cpu"))[index]
        add_adapters(alone, lora, model=tiny_recipe("qwen2").build("meta"), seed=7, first_stage=index)
        mine, theirs = _adapters(alone), _adapters(stage)
        assert mine and mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert all((".lora_" in n) == p.requires_grad for n, p in alone.named_parameters())
    other = cut.cut(tiny_recipe("qwen2").build("cpu"))[1]
    add_adapters(other, lora, model=tiny_recipe("qwen2").build("meta"), seed=8, first_stage=1)
    reseeded = zip(_adapters(other).values(), _adapters(stages[1]).values())
    assert not all(torch.equal(a, b) for a, b in reseeded)


def test_a_stage_holding_no_target_is_refused():
    lora = LoraSettings(rank=2, alpha=4.0, dropout=0.0, targets=("lm_head",))
    model = tiny_recipe("llama").build("meta")
    with pytest.raises(SpecError, match="--lora-targets: stage 0 holds none of lm_head"):
        add_adapters(StageCut(stages=2).cut(model), lora, model=model, seed=0)
