"""Activation checkpointing per stage (``--activation-checkpointing``): the same numbers, fewer activations
kept for the backward pass."""

from __future__ import annotations

import json

import pytest
import torch

from aqsgd.errors import SpecError
from aqsgd.pipeline.checkpointing import checkpoint_blocks
from aqsgd.pipeline.materialize import ModelRecipe
from aqsgd.pipeline.partition import partition_model
from aqsgd.train.config import TrainConfig
from aqsgd.train.trainer import Trainer


def _losses(run) -> list[float]:
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("model, extra", [("tiny-llama", {}), ("tiny-gpt2", {"dropout": 0.1})])
def test_the_same_losses_with_and_without(tmp_path, model, extra):
    """Bit for bit, dropout included (the recomputation draws the same masks)."""
    base = dict(task="synthetic-lm", model=model, max_train_samples=32, max_eval_samples=8, max_length=12,
                stages=2, micro_batches=2, micro_batch_size=4, epochs=2, warmup_epochs=1, lr=3e-3,
                output_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"), progress=False,
                tensorboard=False, **extra)
    Trainer(TrainConfig.of(**base, run_name="plain")).run()
    Trainer(TrainConfig.of(**base, run_name="ckpt", activation_checkpointing=True)).run()
    plain, ckpt = _losses(tmp_path / "plain"), _losses(tmp_path / "ckpt")
    assert len(plain) == 8 and plain == ckpt


def _saved_bytes(stage, batch) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of one forward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(None, batch)
    out.sum().backward()
    return sum(seen.values())


def test_a_stage_keeps_far_fewer_activations():
    from aqsgd.models import tiny_recipe

    recipe: ModelRecipe = tiny_recipe("llama", layers=4, hidden=64, vocab=128, seq_len=64)
    torch.manual_seed(0)
    model = recipe.build("cpu")
    stage = partition_model(model, 2)[0]
    batch = {"input_ids": torch.randint(0, 128, (8, 64)),
             "attention_mask": torch.ones(8, 64, dtype=torch.long)}
    plain = _saved_bytes(stage, batch)
    assert checkpoint_blocks(stage) == 2
    kept = _saved_bytes(stage, batch)
    # two blocks: each keeps its input (plus the masks and rotary tables it is called with), not its dozens of
    # intermediates
    assert kept < plain / 5, (kept, plain)


def test_a_stage_without_blocks_is_refused():
    with pytest.raises(SpecError, match="--activation-checkpointing: Linear has no blocks"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
