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
import re
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from aqsgd.data import default_cache_dir, load_task, require
from aqsgd.data.datasets import TASKS
from aqsgd.data.synthetic import SyntheticLM
from aqsgd.errors import DataSourceError, SpecError
from aqsgd.pipeline.materialize import ModelRecipe, init_weights_file, save_weights
from aqsgd.train.config import TrainConfig

__all__ = ["TaskSetup", "setup_task", "TASK_KINDS"]

log = logging.getLogger(__name__)

TASK_KINDS = {**{n: t.kind for n, t in TASKS.items()}, "synthetic-lm": "causal-lm"}
_TINY_LLAMA_BLOCKS = 4  # the synthetic task's random model
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
    return Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()


def _atomic_weights(path: Path, build) -> Path:
    """Create a weights file once (concurrent stage processes may race: write aside, rename)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    build(tmp)
    os.replace(tmp, path)
    return path


def _truncate_config(kind: str, config: dict[str, Any], n: int | None) -> dict[str, Any]:
    if n is None:
        return config
    key = {"gpt2": "n_layer"}.get(kind, "num_hidden_layers")
    if n > config[key]:
        raise SpecError(f"--model-layers: the model has only {config[key]} blocks, asked for {n}")
    return {**config, key: n}


def _hf_recipe(kind: str, model_dir: Path, cfg: TrainConfig, *, num_labels: int | None, weights_dir: Path) -> ModelRecipe:
    """Recipe for a local Hugging Face folder; adds a seeded classification head when the task needs one."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config = _truncate_config(kind, config, cfg.model_layers)
    if num_labels is not None:
        config = {**config, "num_labels": num_labels}
        config.pop("id2label", None)
        config.pop("label2id", None)
    if num_labels is None and cfg.model_layers is None and (model_dir / "model.safetensors").exists():
        return ModelRecipe(kind, config, weights=str(model_dir))  # the folder is the complete model

    def build(path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        torch.manual_seed(cfg.seed)
        if num_labels is not None:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(model_dir), num_labels=num_labels, num_hidden_layers=config.get("num_hidden_layers"))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **(
                {"num_hidden_layers": cfg.model_layers} if cfg.model_layers else {}))
        save_weights(model, path)

    recipe = ModelRecipe(kind, config)
    name = f"{model_dir.name}-{recipe.fingerprint()}-seed{cfg.seed}.safetensors"
    return recipe.with_weights(_atomic_weights(weights_dir / name, build))


def _model_recipe(cfg: TrainConfig, kind: str, train: Dataset) -> ModelRecipe:
    weights_dir = _cache(cfg) / "weights"
    info = getattr(train, "info", {})
    model = cfg.model or ("tiny-llama" if cfg.task == "synthetic-lm" else DEFAULT_MODEL[kind])
    if model == "resnet":
        if cfg.model_layers is not None:
            raise SpecError("--model-layers keeps the first N blocks of a transformer; the resnet has no such "
                            "setting")
        if kind != "image-classification":
            raise SpecError(f"--model resnet needs an image task, not {cfg.task}")
        recipe = ModelRecipe("resnet", {"in_channels": int(info.get("channels", 1)), "num_classes": int(info["num_labels"]),
                                        "widths": [16, 32, 64], "blocks_per_group": 2, "norm": "group"})
        path = weights_dir / f"resnet-{recipe.fingerprint()}-seed{cfg.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path, lambda p: init_weights_file(recipe, p, cfg.seed)))
    if model == "tiny-llama":
        from aqsgd.train.job import tiny_lm_recipe

        if cfg.model_layers is not None and cfg.model_layers > _TINY_LLAMA_BLOCKS:
            raise SpecError(f"--model-layers: the model has only {_TINY_LLAMA_BLOCKS} blocks, asked for "
                            f"{cfg.model_layers}")
        recipe = tiny_lm_recipe("llama", layers=cfg.model_layers or _TINY_LLAMA_BLOCKS, hidden=64,
                                vocab=int(info.get("vocab_size", 128)), seq_len=cfg.max_length)
        path = weights_dir / f"tiny-llama-{recipe.fingerprint()}-seed{cfg.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path, lambda p: init_weights_file(recipe, p, cfg.seed)))
    num_labels = int(info["num_labels"]) if kind == "sequence-classification" else None
    if model in ("minilm", "smollm2"):
        folder = require(model, cfg.cache_dir)
    elif Path(model).is_dir():
        folder = Path(model)
    else:
        folder = _hub_model(model, kind, weights_dir)
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if kind == "causal-lm":
        if model_type not in ("llama", "gpt2"):
            raise SpecError(f"--model {model}: causal LM pipelines support llama and gpt2 models, not {model_type}")
        return _hf_recipe(model_type, folder, cfg, num_labels=None, weights_dir=weights_dir)
    if kind == "sequence-classification":
        return _hf_recipe("bert-cls", folder, cfg, num_labels=num_labels, weights_dir=weights_dir)
    raise SpecError(f"--model {model} does not fit the {kind} task {cfg.task}")


_DROPOUT_KEY = re.compile(r"dropout|pdrop")


def _with_dropout(recipe: ModelRecipe, p: float | None) -> ModelRecipe:
    """``recipe`` with every dropout probability of its transformers config set to ``p`` (None: unchanged).
    The weights stay the same file: dropout is not a parameter."""
    if p is None:
        return recipe
    if recipe.kind not in ("gpt2", "llama", "bert-cls"):
        raise SpecError(f"--dropout applies to transformers models; {recipe.kind} has no dropout setting")
    config = {k: (p if _DROPOUT_KEY.search(k) and (v is None or isinstance(v, (int, float))) else v)
              for k, v in recipe.config.items()}
    if recipe.kind == "bert-cls":
        config["classifier_dropout"] = p  # absent from most configs (then the hidden dropout applies)
    return dataclasses.replace(recipe, config=config)


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
    if cfg.task not in TASK_KINDS:
        raise SpecError(f"--task: unknown task {cfg.task!r}; valid: {', '.join(TASK_KINDS)}")
    kind = TASK_KINDS[cfg.task]
    limit = lambda n: None if not n else n  # noqa: E731  (0 / None: all)
    if cfg.task == "synthetic-lm":
        n = cfg.max_train_samples or 256
        train: Dataset = SyntheticLM(n, cfg.max_length, 128, seed=cfg.seed)
        evals: Dataset = SyntheticLM(cfg.max_eval_samples or 64, cfg.max_length, 128, seed=cfg.seed + 10_000)
        train.info = {"vocab_size": 128}  # type: ignore[attr-defined]
    else:
        tokenizer = None
        if kind == "causal-lm" and cfg.model and cfg.model not in ("smollm2",) and Path(cfg.model).is_dir():
            tokenizer = cfg.model
        common = dict(cache_dir=cfg.cache_dir, seq_len=cfg.max_length, max_length=cfg.max_length, seed=cfg.seed,
                      tokenizer=tokenizer)
        train = load_task(cfg.task, "train", max_samples=limit(cfg.max_train_samples), **common)
        evals = load_task(cfg.task, "eval", max_samples=limit(cfg.max_eval_samples), **common)
    recipe = _with_dropout(_model_recipe(cfg, kind, train), cfg.dropout)
    info = getattr(train, "info", {})
    num_labels = int(info["num_labels"]) if "num_labels" in info else None
    metric = {"causal-lm": "perplexity", "sequence-classification": "accuracy",
              "image-classification": "accuracy"}[kind]
    if cfg.task == "glue-cola":
        metric = "mcc"
    return TaskSetup(cfg.task, kind, recipe, train, evals, num_labels,
                     cfg.max_length if kind != "image-classification" else None, metric)
