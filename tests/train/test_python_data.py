"""Training on data given from Python: datasets passed to the trainer / driver, and tasks registered with
``register_task`` that the spawned stage processes of a distributed run also know."""

from __future__ import annotations

import json

import pytest
import torch

from aqsgd.data import DictDataset, TaskArgs, TaskSpec, register_task
from aqsgd.data.datasets import TASKS
from aqsgd.data.synthetic import SyntheticLM
from aqsgd.errors import SpecError
from aqsgd.train import run_training
from aqsgd.train.config import TrainConfig
from aqsgd.train.tasks import dataset_kind, effective_settings
from aqsgd.train.trainer import Trainer

_SEQ = 12


def _cfg(tmp_path, **kw):
    base = dict(model="tiny-llama", max_length=_SEQ, stages=2, micro_batches=2, micro_batch_size=4, epochs=2,
                lr=3e-3, output_dir=str(tmp_path), progress=False, tensorboard=False, forward="delta:q2",
                backward="direct:q4", cache_dir=str(tmp_path / "cache"), checkpoint_every=0)
    base.update(kw)
    return TrainConfig.of(**base)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def _synthetic_rows(args: TaskArgs) -> DictDataset:
    """A registered task's loader: the synthetic task's samples as a DictDataset (module level: picklable)."""
    n, seed = (32, 0) if args.split == "train" else (8, 10_000)
    ds = SyntheticLM(n, args.seq_len, 128, seed=seed)
    rows = [ds[i] for i in range(n)]
    cols = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}
    return DictDataset(cols, info={"kind": "causal-lm"})


@pytest.fixture
def registered():
    spec = register_task(TaskSpec("test-synthetic-rows", "causal-lm", True, "synthetic rows",
                                  _synthetic_rows))
    yield spec
    TASKS.pop(spec.name, None)


def test_datasets_from_python_train_like_the_named_task(tmp_path):
    """The synthetic task's own datasets handed over from Python give bit-identical losses."""
    named = _cfg(tmp_path, task="synthetic-lm", max_train_samples=48, max_eval_samples=16, run_name="named")
    Trainer(named).run()
    data = (SyntheticLM(48, _SEQ, 128, seed=0), SyntheticLM(16, _SEQ, 128, seed=10_000))
    summary = Trainer(_cfg(tmp_path, run_name="given"), data=data).run()
    assert _losses(tmp_path / "given") == _losses(tmp_path / "named")
    assert summary["task"] == "data" and summary["main_metric"] == "perplexity"


def test_python_data_caps_and_default_run_name(tmp_path):
    data = (SyntheticLM(48, _SEQ, 128, seed=0), SyntheticLM(16, _SEQ, 128, seed=1))
    trainer = Trainer(_cfg(tmp_path, max_train_samples=16, epochs=1), data=data)
    assert len(trainer.task.train) == 16 and len(trainer.task.eval) == 16
    assert trainer.run_dir.name == "data-delta-q2-direct-q4"


def test_python_data_refuses_a_task_too(tmp_path):
    data = (SyntheticLM(8, _SEQ, 128), SyntheticLM(8, _SEQ, 128))
    with pytest.raises(SpecError, match="data given from Python replace --task"):
        Trainer(_cfg(tmp_path, task="synthetic-lm"), data=data)


def test_dataset_kind_from_columns():
    ids = torch.arange(12).view(2, 6)
    assert dataset_kind(DictDataset({"input_ids": ids, "labels": ids})) == "causal-lm"
    assert (dataset_kind(DictDataset({"input_ids": ids, "labels": torch.tensor([0, 1])}))
            == "sequence-classification")
    assert dataset_kind(DictDataset({"pixel_values": torch.zeros(2, 1, 4, 4),
                                     "labels": torch.tensor([0, 1])})) \
        == "image-classification"
    with pytest.raises(SpecError, match="cannot tell the task kind"):
        dataset_kind(DictDataset({"input_ids": ids, "labels": torch.zeros(2, 3)}))


@pytest.mark.slow
def test_registered_task_reaches_the_spawned_stage_processes(tmp_path, registered):
    """A task registered in this process is known in the stage processes the driver spawns."""
    cfg = _cfg(tmp_path, task=registered.name, runtime="distributed", run_name="dist", timeout=120.0)
    summary = run_training(cfg)
    assert summary is not None and summary["task"] == registered.name and summary["steps"] == 8
    run_training(_cfg(tmp_path, task=registered.name, run_name="local"))
    assert _losses(tmp_path / "dist") == pytest.approx(_losses(tmp_path / "local"), rel=1e-5)


def test_register_task_errors(registered):
    with pytest.raises(SpecError, match="'bbc' is a built-in task"):
        register_task(TaskSpec("bbc", "causal-lm", True, "", _synthetic_rows))
    with pytest.raises(SpecError, match="already registered"):
        register_task(registered)
    with pytest.raises(SpecError, match="kind 'regression' is not one of"):
        register_task(TaskSpec("x-task", "regression", True, "", _synthetic_rows))


def test_unpicklable_data_is_one_line(tmp_path):
    class Local(SyntheticLM):  # a local class: pickling fails
        pass

    data = (Local(8, _SEQ, 128), Local(8, _SEQ, 128))
    with pytest.raises(SpecError, match="must be picklable to reach the stage processes") as e:
        run_training(_cfg(tmp_path, runtime="distributed"), data=data)
    assert "\n" not in str(e.value)


def test_checkpoints_from_before_the_moved_defaults_compare_equal():
    """Configs saved when --task defaulted to bbc and the caps to 600/200 equal today's defaults."""
    old = {**TrainConfig().flat(), "task": "bbc", "max_train_samples": 600, "max_eval_samples": 200}
    assert effective_settings(old) == effective_settings(TrainConfig().flat())
    own = TrainConfig.of(train_file="x.txt").flat()
    assert effective_settings(own)["max_train_samples"] is None and effective_settings(own)["task"] is None
