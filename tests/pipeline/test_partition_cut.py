"""A run's cut (:class:`~aqsgd.pipeline.partition.StageCut`): built from the pipeline section or from a saved
run's flat config, it cuts a model exactly as :func:`~aqsgd.pipeline.partition.partition_model` does."""

from __future__ import annotations

import dataclasses

import pytest

from aqsgd.models import tiny_recipe
from aqsgd.pipeline.partition import StageCut, partition_model
from aqsgd.train.config import PipelineSection, TrainConfig


def _ranges(stages):
    return [s.layer_range for s in stages]


@pytest.mark.parametrize("flat", [{"stages": 2}, {"stages": 3, "layers": [1, 2, 1]},
                                  {"stages": 2, "balance": "params"}])
def test_the_cut_of_a_pipeline_section_is_partition_models(flat):
    section = TrainConfig.of(**flat).pipeline
    cut = StageCut.of(section)
    model = tiny_recipe("gpt2").build("meta")
    expected = partition_model(model, section.stages, layers=section.layers, balance=section.balance)
    assert _ranges(cut.cut(model)) == _ranges(expected)
    assert StageCut.from_flat(TrainConfig.of(**flat).flat(), PipelineSection()) == cut


def test_a_saved_config_takes_the_sections_defaults_for_what_it_lacks():
    defaults = PipelineSection()
    assert StageCut.from_flat({}, defaults) == StageCut.of(defaults)
    assert StageCut.from_flat({"stages": 2, "layers": [3, 1]}, defaults) == StageCut(2, (3, 1), "layers")


def test_a_cut_is_a_value():
    cut = StageCut.of(TrainConfig.of(stages=2, layers=[1, 3]).pipeline)
    assert cut == StageCut(stages=2, layers=(1, 3)) and hash(cut) == hash(StageCut(2, (1, 3)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cut.stages = 3  # type: ignore[misc]


def test_a_bad_cut_fails_as_partition_model_does():
    with pytest.raises(ValueError, match="adds up to 3 but the model has 4 layers"):
        StageCut(2, (1, 2)).cut(tiny_recipe("llama").build("meta"))
