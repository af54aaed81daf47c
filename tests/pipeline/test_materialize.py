"""Stage materialization: each stage built from a meta skeleton + a weights file equals the same stage
cut from the fully loaded model, and reads only its own tensors."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from aqsgd.errors import SpecError, WeightsError
from aqsgd.pipeline import materialize as mat
from aqsgd.pipeline.materialize import (
    ModelRecipe,
    init_weights_file,
    load_weights,
    materialize_model_stage,
    materialize_stage,
    register_buffer_initializer,
    save_weights,
    stage_nbytes,
)
from aqsgd.pipeline.partition import partition_model, shared_parameters
from aqsgd.models.stage import PipelineStage

transformers = pytest.importorskip("transformers")

BATCH = 4
SEQ = 10
VOCAB = 100

Batch = dict[str, torch.Tensor]
FullLoss = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A recipe (without weights), a batch, and how the unsplit model computes its loss."""

    recipe: ModelRecipe
    batch: Batch
    loss: FullLoss


def _lm_batch() -> Batch:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    labels = input_ids.clone()
    labels[1, :3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _hf_loss(keys: tuple[str, ...]) -> FullLoss:
    return lambda model, batch: model(**{k: batch[k] for k in keys}).loss


LM_KEYS = ("input_ids", "attention_mask", "labels")

GPT2_CONFIG = {
    "n_layer": 4,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": VOCAB,
    "n_positions": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
LLAMA_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def gpt2_case() -> Case:
    return Case(ModelRecipe("gpt2", GPT2_CONFIG), _lm_batch(), _hf_loss(LM_KEYS))


def llama_case(rope: dict[str, object] | None = None) -> Case:
    config = dict(LLAMA_CONFIG)
    if rope is not None:
        config["rope_parameters"] = rope
    return Case(ModelRecipe("llama", config), _lm_batch(), _hf_loss(LM_KEYS))


def bert_case(model_type: str = "bert") -> Case:
    config = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 40,
        "type_vocab_size": 2,
        "num_labels": 3,
        "pad_token_id": 0,
    }
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::2, -3:] = 0
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": torch.randint(0, 3, (BATCH,), generator=gen),
    }
    return Case(ModelRecipe("bert-cls", config), batch, _hf_loss(("input_ids", "attention_mask", "labels")))


def resnet_case() -> Case:
    config = {"in_channels": 1, "num_classes": 10, "widths": [4, 8], "blocks_per_group": 2, "norm": "batch"}
    gen = torch.Generator().manual_seed(4)
    batch = {
        "pixel_values": torch.randn(BATCH, 1, 12, 12, generator=gen),
        "labels": torch.randint(0, 10, (BATCH,), generator=gen),
    }
    return Case(
        ModelRecipe("resnet", config), batch, lambda m, b: F.cross_entropy(m(b["pixel_values"]), b["labels"])
    )


def mlp_case() -> Case:
    config = {"sizes": [10, 32, 32, 16, 5], "activation": ["tanh", "gelu", "relu"]}
    gen = torch.Generator().manual_seed(3)
    batch = {
        "input": torch.randn(BATCH, 10, generator=gen),
        "labels": torch.randint(0, 5, (BATCH,), generator=gen),
    }
    return Case(
        ModelRecipe("sequential-mlp", config), batch, lambda m, b: F.cross_entropy(m(b["input"]), b["labels"])
    )


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2_case,
    "llama": llama_case,
    "llama-linear-rope": lambda: llama_case({"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}),
    "bert": bert_case,
    "roberta": lambda: bert_case("roberta"),
    "resnet": resnet_case,
    "mlp": mlp_case,
}


def write_weights(recipe: ModelRecipe, path: Path, seed: int = 0) -> ModelRecipe:
    """A seeded random-init weights file; BatchNorm running stats are randomised so they matter."""
    if recipe.kind != "resnet":
        return recipe.with_weights(init_weights_file(recipe, path, seed))
    torch.manual_seed(seed)
    model = recipe.build("cpu")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(7)
    return recipe.with_weights(save_weights(model, path))


@pytest.fixture(scope="module")
def weighted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Case, ModelRecipe]]:
    root = tmp_path_factory.mktemp("weights")
    out = {}
    for name, make in CASES.items():
        case = make()
        out[name] = (case, write_weights(case.recipe, root / f"{name}.safetensors"))
    return out


def reference(recipe: ModelRecipe) -> nn.Module:
    """The full model on CPU, loaded from the recipe's weights file."""
    assert recipe.weights is not None
    model = load_weights(recipe.build("cpu"), recipe.weights)
    return model.eval()


def non_persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = module.state_dict().keys()
    return {n: b for n, b in module.named_buffers() if n not in persistent}


def chain(stages: list[PipelineStage], batch: Batch) -> torch.Tensor:
    hidden: torch.Tensor | None = None
    for stage in stages:
        hidden = stage(hidden, batch)
    assert hidden is not None
    return hidden


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_materialized_stages_equal_partitioned_full_model(
    weighted: dict[str, tuple[Case, ModelRecipe]], name: str, num_stages: int
) -> None:
    case, recipe = weighted[name]
    full = reference(recipe)
    ref_stages = partition_model(full, num_stages)
    stages = [materialize_stage(recipe, num_stages, i).eval() for i in range(num_stages)]
    full_bytes = stage_nbytes(full)
    for stage, ref in zip(stages, ref_stages, strict=True):
        assert type(stage) is type(ref) and stage.layer_range == ref.layer_range
        assert not any(t.is_meta for t in (*stage.parameters(), *stage.buffers()))
        got, want = stage.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        got_np, want_np = non_persistent_buffers(stage), non_persistent_buffers(ref)
        assert got_np.keys() == want_np.keys()
        for key, value in want_np.items():
            assert got_np[key].dtype == value.dtype and torch.equal(got_np[key], value), key
        assert stage_nbytes(stage) == stage_nbytes(ref) < full_bytes

    loss = chain(stages, case.batch)
    ref_loss = case.loss(full, case.batch)
    torch.testing.assert_close(loss, ref_loss)

    # Training equivalence: gradients of untied parameters match the full model's.
    loss.backward()
    ref_loss.backward()
    tied = {(i, n) for names in shared_parameters(ref_stages) for i, n in names.items()}
    for index, (stage, ref) in enumerate(zip(stages, ref_stages, strict=True)):
        ref_grads = dict(ref.named_parameters())
        for param_name, param in stage.named_parameters():
            if (index, param_name) in tied:
                continue
            expected = ref_grads[param_name].grad
            assert (param.grad is None) == (expected is None), param_name
            if expected is not None:
                torch.testing.assert_close(param.grad, expected, msg=lambda m, n=param_name: f"{n}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_meta_build_allocates_nothing(name: str) -> None:
    model = CASES[name]().recipe.build("meta")
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    assert stage_nbytes(model) > 0  # nominal size is still known


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "resnet"])
def test_each_stage_reads_only_its_own_tensors(
    weighted: dict[str, tuple[Case, ModelRecipe]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, recipe = weighted[name]
    assert recipe.weights is not None
    with safe_open(recipe.weights, framework="pt") as handle:
        all_keys = set(handle.keys())
    reads: list[list[str]] = []
    original_get = mat._WeightSource.get

    def recording_get(self: mat._WeightSource, key: str) -> torch.Tensor:
        reads[-1].append(key)
        return original_get(self, key)

    monkeypatch.setattr(mat._WeightSource, "get", recording_get)
    num_stages = 3
    for index in range(num_stages):
        reads.append([])
        materialize_stage(recipe, num_stages, index)
    per_stage = [set(r) for r in reads]
    assert all(len(r) == len(set(r)) for r in reads)  # every tensor read once
    assert set().union(*per_stage) == all_keys
    overlap = set()
    for i in range(num_stages):
        for j in range(i + 1, num_stages):
            overlap |= per_stage[i] & per_stage[j]
    assert overlap == ({"lm_head.weight"} if name == "gpt2" else set())  # the tied embedding/head


def test_tied_weights_stay_tied_within_a_stage(weighted: dict[str, tuple[Case, ModelRecipe]]) -> None:
    case, recipe = weighted["gpt2"]
    (stage,) = [materialize_stage(recipe, 1, 0)]
    assert stage.wte.weight is stage.lm_head.weight
    full = reference(recipe)
    torch.testing.assert_close(stage.eval()(None, case.batch), case.loss(full, case.batch))


def test_sharded_directory_and_prefixless_checkpoint(
    weighted: dict[str, tuple[Case, ModelRecipe]], tmp_path: Path
) -> None:
    _, recipe = weighted["gpt2"]
    assert recipe.weights is not None
    full = reference(recipe)
    sharded = tmp_path / "sharded"
    full.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / mat.SAFETENSORS_INDEX).is_file()
    assert len(json.loads((sharded / mat.SAFETENSORS_INDEX).read_text())["weight_map"]) > 1
    # An old-style checkpoint without the "transformer." base-model prefix.
    stripped = {k.removeprefix("transformer."): v for k, v in load_file(recipe.weights).items()}
    save_file(stripped, str(tmp_path / "noprefix.safetensors"))
    for source in (sharded, tmp_path / "noprefix.safetensors"):
        for index in range(2):
            want = materialize_stage(recipe, 2, index).state_dict()
            got = materialize_stage(recipe.with_weights(source), 2, index).state_dict()
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], v) for k, v in want.items())


def test_missing_and_mismatched_keys_are_named(
    weighted: dict[str, tuple[Case, ModelRecipe]], tmp_path: Path
) -> None:
    _, recipe = weighted["gpt2"]
    assert recipe.weights is not None
    tensors = load_file(recipe.weights)
    dropped = "transformer.h.3.mlp.c_fc.weight"
    del tensors[dropped]
    partial = recipe.with_weights(tmp_path / "partial.safetensors")
    save_file(tensors, str(partial.weights))
    materialize_stage(partial, 2, 0)  # stage 0 does not need the dropped tensor
    with pytest.raises(WeightsError, match=r"missing keys \(1\) \['transformer\.h\.3\.mlp\.c_fc\.weight'\]"):
        materialize_stage(partial, 2, 1)

    wider = ModelRecipe("gpt2", {**GPT2_CONFIG, "n_embd": 64}, weights=recipe.weights)
    mismatch = r"shape mismatches .*'transformer\.h\.0\.attn\.c_attn\.bias: file \[96\] vs model \[192\]'"
    with pytest.raises(WeightsError, match=mismatch):
        materialize_stage(wider, 2, 0)

    with pytest.raises(WeightsError, match="does not exist"):
        materialize_stage(recipe.with_weights(tmp_path / "nowhere"), 2, 0)
    with pytest.raises(WeightsError, match="init_weights_file"):
        materialize_stage(recipe.with_weights(None), 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        materialize_stage(recipe, 2, 2)


class ScaledLinear(nn.Linear):
    """A Linear whose output is multiplied by a non-persistent buffer."""

    def __init__(self, features: int) -> None:
        super().__init__(features, features)
        self.register_buffer("scale", torch.full((features,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def test_unknown_non_persistent_buffer_is_an_error(tmp_path: Path) -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), ScaledLinear(4), nn.Linear(4, 2))

    torch.manual_seed(0)
    path = save_weights(build(), tmp_path / "scaled.safetensors")
    with torch.device("meta"):
        skeleton = build()
    with pytest.raises(WeightsError, match=r"non-persistent buffers \['scale'\] of .*ScaledLinear"):
        materialize_model_stage(skeleton, path, 2, 0)

    register_buffer_initializer(ScaledLinear, lambda m, device: {"scale": torch.full((4,), 0.5)})
    try:
        with torch.device("meta"):
            skeleton = build()
        stage = materialize_model_stage(skeleton, path, 2, 0)
    finally:
        mat._BUFFER_INITIALIZERS.pop(ScaledLinear)
    assert torch.equal(stage.layers[1].scale, torch.full((4,), 0.5))


def test_unregistered_rotary_embedding_is_an_error(
    weighted: dict[str, tuple[Case, ModelRecipe]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    _, recipe = weighted["llama"]
    mat._ensure_builtin_initializers()
    monkeypatch.delitem(mat._BUFFER_INITIALIZERS, LlamaRotaryEmbedding)
    with pytest.raises(WeightsError, match=r"\['inv_freq', 'original_inv_freq'\] of .*LlamaRotaryEmbedding"):
        materialize_stage(recipe, 2, 1)


def test_dtype_casts_weights_but_not_rotary_frequencies(
    weighted: dict[str, tuple[Case, ModelRecipe]],
) -> None:
    _, recipe = weighted["llama"]
    stage = materialize_stage(recipe, 2, 1, dtype=torch.bfloat16)
    ref = partition_model(reference(recipe), 2)[1]
    for key, value in ref.state_dict().items():
        assert torch.equal(stage.state_dict()[key], value.to(torch.bfloat16)), key
    assert stage.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(stage.rotary_emb.inv_freq, ref.rotary_emb.inv_freq)
    assert stage_nbytes(stage) < stage_nbytes(ref)


def test_layers_and_balance_follow_partition_model(weighted: dict[str, tuple[Case, ModelRecipe]]) -> None:
    _, recipe = weighted["llama"]
    full = reference(recipe)
    for kwargs in ({"layers": [1, 3]}, {"balance": "params"}):
        refs = partition_model(full, 2, **kwargs)
        for index, ref in enumerate(refs):
            stage = materialize_stage(recipe, 2, index, **kwargs)
            assert stage.layer_range == ref.layer_range


def test_recipe_serialization_and_fingerprint() -> None:
    recipe = ModelRecipe("resnet", {"widths": (4, 8), "norm": "group"}, weights=Path("/tmp/w.safetensors"))
    assert recipe.config == {"norm": "group", "widths": [4, 8]}
    assert recipe.weights == "/tmp/w.safetensors"
    assert ModelRecipe.from_json(recipe.to_json()) == recipe
    assert hash(ModelRecipe.from_json(recipe.to_json())) == hash(recipe)
    assert ModelRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    fingerprint = recipe.fingerprint()
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert ModelRecipe("resnet", {"norm": "group", "widths": [4, 8]}).fingerprint() == fingerprint
    assert recipe.with_weights(None).fingerprint() == fingerprint
    assert ModelRecipe("resnet", {"widths": [4, 16], "norm": "group"}).fingerprint() != fingerprint
    assert ModelRecipe("gpt2", GPT2_CONFIG, attn_implementation="sdpa").fingerprint() != (
        ModelRecipe("gpt2", GPT2_CONFIG).fingerprint()
    )
    # A transformers config.to_dict() is a valid recipe config.
    config = transformers.GPT2Config(**GPT2_CONFIG).to_dict()
    assert ModelRecipe("gpt2", config).build("meta").config.n_layer == 4


def test_recipe_errors() -> None:
    with pytest.raises(SpecError, match="unknown model kind"):
        ModelRecipe("t5")
    with pytest.raises(SpecError, match="JSON"):
        ModelRecipe("resnet", {"widths": torch.tensor([4])})
    with pytest.raises(SpecError, match="unknown recipe keys"):
        ModelRecipe.from_dict({"kind": "resnet", "extra": 1})
    with pytest.raises(SpecError, match="model_type"):
        ModelRecipe("gpt2", {"model_type": "llama"}).build()
    with pytest.raises(SpecError, match="activations"):
        ModelRecipe("sequential-mlp", {"sizes": [2, 3, 4], "activation": ["relu", "relu"]}).build()
    with pytest.raises(SpecError, match="unknown activation"):
        ModelRecipe("sequential-mlp", {"sizes": [2, 3, 4], "activation": "swish"}).build()
    with pytest.raises(ValueError, match="meta device"):
        materialize_model_stage(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "unused", 2, 0)
