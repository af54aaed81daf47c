"""Tasks: which model and data a training run uses, prepared so that every stage process builds the same.

:func:`setup_task` returns the datasets (with stable sample ids) and a :class:`ModelRecipe` whose weights
file holds the complete starting model (pretrained weights plus a seeded head where the task adds one), so a
distributed stage materializes only its own slice and a local run loads the very same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from aqsgd.data import default_cache_dir, load_task, require
from aqsgd.data.datasets import TASKS
from aqsgd.data.synthetic import SyntheticLM
from aqsgd.errors import DataSourceError, SpecError
from aqsgd.models import family_for, tiny_recipe, truncate_config, with_dropout
from aqsgd.pipeline.materialize import ModelRecipe, init_weights_file, save_weights
from aqsgd.train.config import TrainConfig

__all__ = ["TaskSetup", "setup_task", "TASK_KINDS"]

log = logging.getLogger(__name__)

TASK_KINDS = {**{n: t.kind for n, t in TASKS.items()}, "synthetic-lm": "causal-lm"}
_TINY_BLOCKS = 4  # blocks of the random tiny models unless --model-layers says otherwise
TINY_MODELS = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}  # random models of the given sizes (no weights file)
DEFAULT_MODEL = {"sequence-classification": "minilm", "causal-lm": "smollm2", "image-classification": "resnet"}


@dataclasses.dataclass
class TaskSetup:
    name: str
    kind: str  # causal-lm | sequence-classification | image-classification
    recipe: ModelRecipe
    train: Dataset
    eval: Dataset
    num_labels: int | None
    tokens_per_sample: int | None  # for tokens/s (LM and text tasks)
    main_metric: str  # accuracy | perplexity | mcc


def _cache(cfg: TrainConfig) -> Path:
    return Path(cfg.task.cache_dir) if cfg.task.cache_dir else default_cache_dir()


def _atomic_weights(path: Path, build) -> Path:
    """Create a weights file once (concurrent stage processes may race: write aside, rename)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    build(tmp)
    os.replace(tmp, path)
    return path


def _hf_recipe(kind: str, model_dir: Path, cfg: TrainConfig, *, num_labels: int | None, weights_dir: Path) -> ModelRecipe:
    """Recipe for a local Hugging Face folder; adds a seeded classification head when the task needs one."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config = _option("--model-layers", truncate_config, kind, config, cfg.model.layers)
    if num_labels is not None:
        config = {**config, "num_labels": num_labels}
        config.pop("id2label", None)
        config.pop("label2id", None)
    if num_labels is None and cfg.model.layers is None and (model_dir / "model.safetensors").exists():
        return ModelRecipe(kind, config, weights=str(model_dir))  # the folder is the complete model

    def build(path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        torch.manual_seed(cfg.optim.seed)
        if num_labels is not None:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), num_labels=num_labels, num_hidden_layers=config.get("num_hidden_layers"))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **(
                {"num_hidden_layers": cfg.model.layers} if cfg.model.layers else {}))
        save_weights(model, path)

    recipe = ModelRecipe(kind, config)
    name = f"{model_dir.name}-{recipe.fingerprint()}-seed{cfg.optim.seed}.safetensors"
    return recipe.with_weights(_atomic_weights(weights_dir / name, build))


def _model_recipe(cfg: TrainConfig, kind: str, train: Dataset) -> ModelRecipe:
    weights_dir = _cache(cfg) / "weights"
    info = getattr(train, "info", {})
    model = cfg.model.name or ("tiny-llama" if cfg.task.name == "synthetic-lm" else DEFAULT_MODEL[kind])
    if model == "resnet":
        if cfg.model.layers is not None:
            raise SpecError("--model-layers keeps the first N blocks of a transformer; the resnet has no such "
                            "setting")
        if kind != "image-classification":
            raise SpecError(f"--model resnet needs an image task, not {cfg.task.name}")
        recipe = ModelRecipe("resnet", {"in_channels": int(info.get("channels", 1)), "num_classes": int(info["num_labels"]),
                                        "widths": [16, 32, 64], "blocks_per_group": 2, "norm": "group"})
        path = weights_dir / f"resnet-{recipe.fingerprint()}-seed{cfg.optim.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path, lambda p: init_weights_file(recipe, p, cfg.optim.seed)))
    if model in TINY_MODELS:
        if kind != "causal-lm":
            raise SpecError(f"--model {model} is a causal LM; the {cfg.task.name} task needs a {kind} model")
        if cfg.model.layers is not None and cfg.model.layers > _TINY_BLOCKS:
            raise SpecError(f"--model-layers: the model has only {_TINY_BLOCKS} blocks, asked for {cfg.model.layers}")
        recipe = tiny_recipe(TINY_MODELS[model], layers=cfg.model.layers or _TINY_BLOCKS, hidden=cfg.model.hidden_size,
                             vocab=cfg.model.vocab_size, seq_len=cfg.task.max_length)
        path = weights_dir / f"{model}-{recipe.fingerprint()}-seed{cfg.optim.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path, lambda p: init_weights_file(recipe, p, cfg.optim.seed)))
    num_labels = int(info["num_labels"]) if kind == "sequence-classification" else None
    if model in ("minilm", "smollm2"):
        folder = require(model, cfg.task.cache_dir)
    elif Path(model).is_dir():
        folder = Path(model)
    else:
        folder = _hub_model(model, kind, weights_dir)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if kind not in ("causal-lm", "sequence-classification"):
        raise SpecError(f"--model {model} does not fit the {kind} task {cfg.task.name}")
    family = _option(f"--model {model}", family_for, model_type, kind)
    return _hf_recipe(family, folder, cfg, num_labels=num_labels if kind == "sequence-classification" else None,
                      weights_dir=weights_dir)


def _option(option: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its one-line SpecError prefixed with the option it is about."""
    try:
        return fn(*args)
    except SpecError as e:
        raise SpecError(f"{option}: {e}") from None


def _hub_model(name: str, kind: str, weights_dir: Path) -> Path:
    """Download a hub model once into the cache (only where the hub is reachable)."""
    target = weights_dir / "hub" / name.replace("/", "--")
    if (target / "config.json").exists():
        return target
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DataSourceError(f"--model {name}: the Hugging Face hub is offline (HF_HUB_OFFLINE=1); use the "
                              f"offline default (--model {DEFAULT_MODEL[kind]})")
    try:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForCausalLM if kind == "causal-lm" else AutoModelForSequenceClassification
        model = cls.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        raise DataSourceError(f"--model {name}: could not load it from the Hugging Face hub ({type(e).__name__}); "
                              f"offline, use --model {DEFAULT_MODEL[kind]}") from None
    model.save_pretrained(str(target))
    return target


def setup_task(cfg: TrainConfig) -> TaskSetup:
    if cfg.task.name not in TASK_KINDS:
        raise SpecError(f"--task: unknown task {cfg.task.name!r}; valid: {', '.join(TASK_KINDS)}")
    kind = TASK_KINDS[cfg.task.name]
    limit = lambda n: None if not n else n  # noqa: E731  (0 / None: all)
    if cfg.task.name == "synthetic-lm":
        n = cfg.task.max_train_samples or 256
        vocab = cfg.model.vocab_size
        train: Dataset = SyntheticLM(n, cfg.task.max_length, vocab, seed=cfg.optim.seed)
        evals: Dataset = SyntheticLM(cfg.task.max_eval_samples or 64, cfg.task.max_length, vocab,
                                     seed=cfg.optim.seed + 10_000)
    else:
        tokenizer = None
        if kind == "causal-lm" and cfg.model.name and cfg.model.name not in ("smollm2",) and Path(cfg.model.name).is_dir():
            tokenizer = cfg.model.name
        common = dict(cache_dir=cfg.task.cache_dir, seq_len=cfg.task.max_length, max_length=cfg.task.max_length, seed=cfg.optim.seed,
                      tokenizer=tokenizer)
        train = load_task(cfg.task.name, "train", max_samples=limit(cfg.task.max_train_samples), **common)
        evals = load_task(cfg.task.name, "eval", max_samples=limit(cfg.task.max_eval_samples), **common)
    recipe = _option("--dropout", with_dropout, _model_recipe(cfg, kind, train), cfg.model.dropout)
    info = getattr(train, "info", {})
    num_labels = int(info["num_labels"]) if "num_labels" in info else None
    metric = {"causal-lm": "perplexity", "sequence-classification": "accuracy",
              "image-classification": "accuracy"}[kind]
    if cfg.task.name == "glue-cola":
        metric = "mcc"
    return TaskSetup(cfg.task.name, kind, recipe, train, evals, num_labels,
                     cfg.task.max_length if kind != "image-classification" else None, metric)
