"""The Hugging Face model families: each one pipelines exactly like its unsplit model (loss and gradients,
both schedules, 2 and 4 stages, padded batches), materializes stage by stage from a weights file into the
same stages as a fully loaded model, and is found from its transformers ``model_type``."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from aqsgd.errors import SpecError
from aqsgd.models import (
    families,
    family_for,
    family_of_model,
    get_family,
    supported_model_types,
    truncate_config,
    with_dropout,
)
from aqsgd.pipeline.compression import CompressionConfig
from aqsgd.pipeline.materialize import (
    ModelRecipe,
    init_weights_file,
    load_weights,
    materialize_stage,
    stage_nbytes,
)
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.pipeline.local import LocalPipeline

transformers = pytest.importorskip("transformers")

BATCH = 4
SEQ = 16
VOCAB = 128
HIDDEN = 32
LAYERS = 4
MICRO_BATCHES = 2

Batch = dict[str, torch.Tensor]


# tiny models: one intra-op thread is faster than two, above all on a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    """A family's tiny model: recipe kind, config overrides, whether the batch carries token type ids."""

    kind: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    token_types: bool = False
    attn: str = "eager"

    @property
    def causal(self) -> bool:
        return get_family(self.kind).task_kind == "causal-lm"

    def recipe(self) -> ModelRecipe:
        config = get_family(self.kind).tiny_config(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, seq_len=SEQ)
        return ModelRecipe(self.kind, {**config, **self.overrides}, attn_implementation=self.attn)


CASES: dict[str, Case] = {
    "llama": Case("llama"),
    "mistral": Case("mistral"),
    "qwen2": Case("qwen2"),
    "qwen3": Case("qwen3"),
    # A cap small enough to bend the logits of a random model (about 0.1 in size).
    "gemma2": Case("gemma2", {"final_logit_softcapping": 0.5}),
    "gemma3": Case("gemma3", {"final_logit_softcapping": 0.5}),
    "phi3": Case("phi3"),
    "olmo2": Case("olmo2"),
    "gpt2": Case("gpt2"),
    "gpt-neox": Case("gpt-neox"),
    "bert": Case("bert-cls", token_types=True),
    "roberta": Case("bert-cls", {"model_type": "roberta"}),
    "xlm-roberta": Case("bert-cls", {"model_type": "xlm-roberta"}),
    "camembert": Case("bert-cls", {"model_type": "camembert"}),
    "electra": Case("bert-cls", {"model_type": "electra", "embedding_size": HIDDEN // 2}),
    "deberta-v2": Case("deberta-v2-cls", token_types=True),
    "distilbert": Case("distilbert-cls"),
    # Gemma-3 used as an encoder: bidirectional masks (within the window on the local layers).
    "gemma3-bidirectional": Case("gemma3", {"use_bidirectional_attention": True}),
    # Phi-3's long-context rotary scaling: the sequence is longer than the original context, so the first
    # forward switches the frequencies from the short to the long factors.
    "phi3-longrope": Case("phi3", {"original_max_position_embeddings": SEQ // 2, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 2.5],
        "long_factor": [2.0, 3.0, 4.0, 5.0]}}),
    # The SDPA kernel takes the same masks (padding, sliding window, per-layer types) in another form.
    "mistral-sdpa": Case("mistral", attn="sdpa"),
    "qwen2-sdpa": Case("qwen2", attn="sdpa"),
    "gemma3-sdpa": Case("gemma3", {"final_logit_softcapping": 0.5}, attn="sdpa"),
    "distilbert-sdpa": Case("distilbert-cls", attn="sdpa"),
}

def make_batch(case: Case) -> Batch:
    """Random tokens with padding: causal LMs left-pad every odd row by 3 tokens (so that each micro-batch
    has the same number of target tokens), classifiers right-pad every odd row by 4."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    batch: Batch = {"sample_ids": torch.arange(BATCH)}
    if case.causal:
        labels = input_ids.clone()
        attention_mask[1::2, :3] = 0
        input_ids[1::2, :3] = 0
        labels[1::2, :3] = -100
    else:
        attention_mask[1::2, -4:] = 0
        input_ids[1::2, -4:] = 0
        labels = torch.randint(0, 2, (BATCH,), generator=gen)
    batch.update(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if case.token_types:
        token_type_ids = torch.zeros_like(input_ids)
        token_type_ids[:, SEQ // 2 :] = 1
        batch["token_type_ids"] = token_type_ids
    return batch


def full_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The unsplit model's loss on ``batch``."""
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")
    return model(**{k: batch[k] for k in keys if k in batch}).loss


def split(batch: Batch, parts: int) -> list[Batch]:
    size = BATCH // parts
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(parts)]


@functools.cache
def reference(name: str) -> tuple[nn.Module, Batch, torch.Tensor, dict[str, torch.Tensor]]:
    """The seeded tiny model of a case, its batch, and the unsplit model's loss and gradients (computed once;
    the tests leave the model's gradients cleared)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.recipe().build("cpu")
    batch = make_batch(case)
    loss = full_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return model, batch, loss.detach(), grads


# ------------------------------------------------------------------------------------------------------
# Pipelined training step == unsplit step
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_unsplit_model(name: str, schedule: str, num_stages: int) -> None:
    model, batch, ref_loss, ref_grads = reference(name)
    stages = partition_model(model, num_stages)
    assert all(type(s) is get_family(CASES[name].kind).stage for s in stages)
    try:
        pipe = LocalPipeline(stages, CompressionConfig(), schedule=schedule)
        loss = pipe.step(split(batch, MICRO_BATCHES))
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref_grads.keys()
        for param, grad in ref_grads.items():
            torch.testing.assert_close(got[param], grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, p=param: f"{p}: {m}")
    finally:
        model.zero_grad(set_to_none=True)


def test_tied_embeddings_are_held_by_first_and_last_stage() -> None:
    for name, tied in (("gemma2", True), ("gemma3", True), ("qwen2", True), ("qwen3", True), ("llama", False),
                       ("mistral", False), ("gpt-neox", False)):
        model = reference(name)[0]
        stages = partition_model(model, 4)
        shared = shared_parameters(stages)
        embed = [s for s in shared if {0, 3} <= s.keys() and s[0] == "embed_tokens.weight"]
        assert bool(embed) == tied, name
        if tied:
            assert stages[0].embed_tokens.weight is stages[3].lm_head.weight


def test_deberta_relative_embeddings_live_on_every_stage() -> None:
    model = reference("deberta-v2")[0]
    stages = partition_model(model, 4)
    encoder = model.deberta.encoder
    for stage in stages:
        assert stage.rel_embeddings is encoder.rel_embeddings and stage.rel_norm is encoder.LayerNorm
    assert stages[0].conv is encoder.conv and not hasattr(stages[1], "conv")
    shared = shared_parameters(stages)
    assert {"rel_embeddings.weight", "rel_norm.weight", "rel_norm.bias"} == {
        names[0] for names in shared if names.keys() == {0, 1, 2, 3}
    }


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "gemma3", "phi3"])
def test_tiny_configs_exercise_the_sliding_window(name: str) -> None:
    """The equivalence above would not notice a stage that ignores the window if the window did not
    change the loss: it does."""
    model, batch, ref_loss, _ = reference(name)
    window = model.config.sliding_window
    try:
        model.config.sliding_window = 10 * SEQ
        with torch.no_grad():
            assert not torch.allclose(full_loss(model, batch), ref_loss)
    finally:
        model.config.sliding_window = window


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_tiny_gemma_configs_exercise_the_logit_soft_cap(name: str) -> None:
    model, batch, _, _ = reference(name)
    stages = partition_model(model, 2)
    cap = model.config.final_logit_softcapping
    assert cap is not None
    with torch.no_grad():
        capped = stages[1](stages[0](None, batch), batch)
        model.config.final_logit_softcapping = None
        try:
            uncapped = stages[1](stages[0](None, batch), batch)
        finally:
            model.config.final_logit_softcapping = cap
    assert not torch.allclose(capped, uncapped)


# ------------------------------------------------------------------------------------------------------
# Materialization (the distributed path) == slicing the fully loaded model
# ------------------------------------------------------------------------------------------------------


def _weights(recipe: ModelRecipe, root: Path, source: str) -> ModelRecipe:
    if source == "save_model":
        return recipe.with_weights(init_weights_file(recipe, root / "model.safetensors", seed=3))
    torch.manual_seed(3)
    recipe.build("cpu").save_pretrained(root / "pretrained")
    return recipe.with_weights(root / "pretrained")


def _non_persistent(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = module.state_dict().keys()
    return {n: b for n, b in module.named_buffers() if n not in persistent}


@pytest.mark.parametrize("source", ["save_model", "save_pretrained"])
@pytest.mark.parametrize("name", list(CASES))
def test_materialized_stages_equal_sliced_full_model(name: str, source: str, tmp_path: Path) -> None:
    case = CASES[name]
    recipe = _weights(case.recipe(), tmp_path, source)
    assert recipe.weights is not None
    full = load_weights(recipe.build("cpu"), recipe.weights).eval()
    num_stages = 3
    refs = partition_model(full, num_stages)
    stages = [materialize_stage(recipe, num_stages, index).eval() for index in range(num_stages)]
    batch = make_batch(case)
    # First the tensors (a forward may update rotary frequencies in place: long-context scaling) ...
    for stage, ref in zip(stages, refs, strict=True):
        assert type(stage) is type(ref) and stage.layer_range == ref.layer_range
        assert not any(t.is_meta for t in (*stage.parameters(), *stage.buffers()))
        got, want = stage.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        got_np, want_np = _non_persistent(stage), _non_persistent(ref)
        assert got_np.keys() == want_np.keys()
        for key, value in want_np.items():
            assert got_np[key].dtype == value.dtype and torch.equal(got_np[key], value), key
        assert stage_nbytes(stage) < stage_nbytes(full)
    # ... then the forward of each stage on the reference's boundary tensor.
    hidden: torch.Tensor | None = None
    with torch.no_grad():
        for index, (stage, ref) in enumerate(zip(stages, refs, strict=True)):
            out = stage(hidden, batch)
            expected = ref(hidden, batch)
            assert torch.equal(out, expected), index
            hidden = expected
        assert hidden is not None
        torch.testing.assert_close(hidden, full_loss(full, batch))


# ------------------------------------------------------------------------------------------------------
# The registry side: model types, auto classes, configs
# ------------------------------------------------------------------------------------------------------

CAUSAL_TYPES = ["gemma2", "gemma3_text", "gpt2", "gpt_neox", "llama", "mistral", "olmo2", "phi3", "qwen2",
                "qwen3"]
CLASSIFIER_TYPES = ["bert", "camembert", "deberta-v2", "distilbert", "electra", "roberta", "xlm-roberta"]


def test_supported_model_types_and_family_for() -> None:
    assert supported_model_types("causal-lm") == CAUSAL_TYPES
    assert supported_model_types("sequence-classification") == CLASSIFIER_TYPES
    assert supported_model_types("image-classification") == []
    expected = {"gemma3_text": "gemma3", "gpt_neox": "gpt-neox", "deberta-v2": "deberta-v2-cls",
                "distilbert": "distilbert-cls", "roberta": "bert-cls", "xlm-roberta": "bert-cls",
                "camembert": "bert-cls", "electra": "bert-cls", "bert": "bert-cls"}
    for model_type in CAUSAL_TYPES:
        kind = family_for(model_type, "causal-lm")
        assert kind == expected.get(model_type, model_type)
        assert get_family(kind).auto_class == "AutoModelForCausalLM"
    for model_type in CLASSIFIER_TYPES:
        kind = family_for(model_type, "sequence-classification")
        assert kind == expected[model_type]
        assert get_family(kind).auto_class == "AutoModelForSequenceClassification"
    # The transformers auto classes know every supported model type.
    from transformers.models.auto import modeling_auto

    for model_type in CAUSAL_TYPES:
        assert model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    for model_type in CLASSIFIER_TYPES:
        assert model_type in modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


@pytest.mark.parametrize(
    ("model_type", "task_kind", "supported"),
    [("t5", "causal-lm", CAUSAL_TYPES), ("llama", "sequence-classification", CLASSIFIER_TYPES),
     (None, "causal-lm", CAUSAL_TYPES)],
)
def test_unsupported_model_type_is_one_line_listing_the_supported_ones(
    model_type: str | None, task_kind: str, supported: list[str]
) -> None:
    with pytest.raises(SpecError) as exc:
        family_for(model_type, task_kind)
    message = str(exc.value)
    assert "\n" not in message
    assert message == f"{task_kind} pipelines support model_type {', '.join(supported)}, not {model_type!r}"


def test_every_family_has_an_auto_class() -> None:
    for family in families():
        transformer = family.task_kind in ("causal-lm", "sequence-classification")
        assert (family.auto_class is not None) == transformer, family.kind
        if family.auto_class is not None:
            assert hasattr(transformers, family.auto_class)


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_model_belongs_to_exactly_its_family(name: str) -> None:
    model = CASES[name].recipe().build("meta")
    assert [f.kind for f in families() if f.matches(model)] == [CASES[name].kind]
    assert family_of_model(model).kind == CASES[name].kind
    stages = partition_model(model, 2)
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "gemma3"])
def test_truncation_cuts_the_layer_types(kind: str) -> None:
    recipe = CASES[kind].recipe()
    full = recipe.build("meta").config.to_dict()
    assert len(full["layer_types"]) == LAYERS
    cut = truncate_config(kind, full, 2)
    assert cut["num_hidden_layers"] == 2 and cut["layer_types"] == full["layer_types"][:2]
    model = ModelRecipe(kind, cut).build("meta")
    assert len(model.model.layers) == 2


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_reaches_every_dropout_setting(name: str) -> None:
    """On a full config (as a pretrained folder's config.json has it) every dropout probability is set."""
    case = CASES[name]
    config = {**case.recipe().build("meta").config.to_dict(),
              "model_type": case.recipe().config["model_type"]}
    recipe = with_dropout(ModelRecipe(case.kind, config), 0.25)
    keys = [k for k in recipe.config if ("dropout" in k or "pdrop" in k) and k != "classifier_dropout"]
    assert keys
    assert all(recipe.config[k] == 0.25 for k in keys), {k: recipe.config[k] for k in keys}
    model = recipe.build("meta")
    assert all(m.p == 0.25 for m in model.modules() if isinstance(m, nn.Dropout))


def test_deberta_has_only_eager_attention() -> None:
    recipe = CASES["deberta-v2"].recipe()
    with pytest.raises(SpecError, match="only eager attention, not 'sdpa'"):
        ModelRecipe(recipe.kind, recipe.config, attn_implementation="sdpa").build("meta")


def test_model_type_of_a_recipe_must_match_its_kind() -> None:
    config = CASES["mistral"].recipe().config
    with pytest.raises(SpecError, match="recipe kind 'qwen2' needs model_type 'qwen2', got 'mistral'"):
        ModelRecipe("qwen2", config).build("meta")
