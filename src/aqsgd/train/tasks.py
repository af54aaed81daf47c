"""Tasks: which model and data a training run uses, prepared so that every stage process builds the same.

:func:`setup_task` returns the datasets (with stable sample ids) and a :class:`ModelRecipe` whose weights
file holds the complete starting model (pretrained weights plus a seeded head where the task adds one), so a
distributed stage materializes only its own slice and a local run loads the very same numbers.

The data come from one of four places, in this order:

* datasets given from Python (``Trainer(cfg, data=(train, eval))``, ``run_training(cfg, data=...)``);
* the user's files (``--train-file`` / ``--eval-file``) or a hub dataset (``--dataset``), read by
  :mod:`aqsgd.data.datasets.files` with the model's own tokenizer;
* a task by name (``--task``): the built-in ones and those added with :func:`aqsgd.data.register_task`;
* the default task, ``bbc``.

Built-in tasks keep their default sample caps (600 training / 200 evaluation samples); the user's data are
used whole unless ``--max-train-samples`` / ``--max-eval-samples`` cap them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from aqsgd.data import default_cache_dir, load_task, require
from aqsgd.data.datasets import TASKS
from aqsgd.data.synthetic import SyntheticLM
from aqsgd.errors import DataSourceError, SpecError, WeightsError
from aqsgd.models import family_for, get_family, tiny_recipe, truncate_config, with_dropout
from aqsgd.pipeline.materialize import ModelRecipe, init_weights_file, save_weights
from aqsgd.train.config import TrainConfig
from aqsgd.train.modelfiles import check_model_files, model_digest

__all__ = ["TaskSetup", "setup_task", "task_kind", "effective_settings", "dataset_kind",
           "BUILTIN_SAMPLE_CAPS"]

log = logging.getLogger(__name__)

_TINY_BLOCKS = 4  # blocks of the random tiny models unless --model-layers says otherwise
# random models of the given sizes (no weights file)
TINY_MODELS = {"tiny-llama": "llama", "tiny-gpt2": "gpt2"}
DEFAULT_MODEL = {"sequence-classification": "minilm", "causal-lm": "smollm2",
                 "image-classification": "resnet"}
BUILTIN_SAMPLE_CAPS = (600, 200)
"""Training and evaluation samples a built-in task uses unless --max-train-samples / --max-eval-samples
say."""
_SOURCE_MODELS = ("minilm", "smollm2")
# pretrained models prepared offline from package registries
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spm.model", "sentencepiece.bpe.model")


@dataclasses.dataclass
class TaskSetup:
    name: str
    kind: str  # causal-lm | sequence-classification | image-classification
    recipe: ModelRecipe
    train: Dataset
    eval: Dataset
    num_labels: int | None
    main_metric: str  # accuracy | perplexity | mcc
    data_info: dict[str, Any] = dataclasses.field(default_factory=dict)  # label names, files, fingerprint
    model_folder: Path | None = None  # the transformers folder the model (and its tokenizer) came from
    model_name: str | None = None  # the model as the run names it (--model, or the task's default)
    # SHA-256 of the folder's weights and config (modelfiles.model_digest): which base a LoRA run adapts
    base_sha256: str | None = None


def task_kind(name: str) -> str:
    """The kind of the task called ``name`` (built-in or registered)."""
    if name == "synthetic-lm":
        return "causal-lm"
    if name not in TASKS:
        raise SpecError(f"--task: unknown task {name!r}; valid: {', '.join([*TASKS, 'synthetic-lm'])}")
    return TASKS[name].kind


def sample_caps(cfg: TrainConfig) -> tuple[int | None, int | None]:
    """How many training and evaluation samples to keep (None: all): the options, else the built-in tasks'
    defaults (:data:`BUILTIN_SAMPLE_CAPS`); 0 means all."""
    t = cfg.task
    defaults = (None, None) if cfg.own_data else BUILTIN_SAMPLE_CAPS
    given = (t.max_train_samples, t.max_eval_samples)
    return tuple(d if g is None else (g or None) for g, d in zip(given, defaults))  # type: ignore[return-value]


def effective_settings(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` options with the defaults that depend on other options filled in (the task's name and sample
    caps), so that configs written before those defaults moved compare equal to today's."""
    out = dict(flat)
    own = out.get("train_file") is not None or out.get("dataset") is not None
    if out.get("task") is None and not own:
        out["task"] = "bbc"
    if not own:
        for key, cap in zip(("max_train_samples", "max_eval_samples"), BUILTIN_SAMPLE_CAPS):
            if out.get(key) is None:
                out[key] = cap
    if out.get("eval_file") is not None and out.get("train_file") is not None:
        out["eval_split"] = None  # nothing is held out of a training file that has its evaluation file
    return out


def dataset_kind(dataset: Dataset) -> str:
    """The task kind of a dataset given from Python: ``info["kind"]``, else read from its columns
    (``pixel_values``: images; ``labels`` shaped like ``input_ids``: causal LM; one label per sample: text
    classification)."""
    info = getattr(dataset, "info", {}) or {}
    if info.get("kind") in ("causal-lm", "sequence-classification", "image-classification"):
        return info["kind"]
    try:
        item = dataset[0]
    except Exception as e:  # noqa: BLE001 - any failure to read is the same bad input
        raise SpecError(f"data: cannot read the first training sample ({type(e).__name__}: {e})") from None
    if not isinstance(item, Mapping) or "labels" not in item:
        raise SpecError("data: a training sample must be a dict with 'labels' and 'input_ids' or "
                        "'pixel_values'")
    labels = torch.as_tensor(item["labels"])
    if "pixel_values" in item:
        return "image-classification"
    if "input_ids" in item and labels.shape == torch.as_tensor(item["input_ids"]).shape and labels.ndim == 1:
        return "causal-lm"
    if "input_ids" in item and labels.ndim == 0:
        return "sequence-classification"
    raise SpecError("data: cannot tell the task kind from the columns; set dataset.info['kind'] to one of "
                    "causal-lm, sequence-classification, image-classification")


def _num_labels(dataset: Dataset) -> int:
    info = getattr(dataset, "info", {}) or {}
    if info.get("num_labels"):
        return int(info["num_labels"])
    columns = getattr(dataset, "columns", None)
    labels = columns["labels"] if columns is not None else torch.stack(
        [torch.as_tensor(dataset[i]["labels"]) for i in range(len(dataset))])  # type: ignore[arg-type]
    return int(labels.max()) + 1


def _first(dataset: Dataset, n: int | None) -> Dataset:
    """The first ``n`` samples of a dataset given from Python (None or 0: all); their ids are unchanged."""
    if not n or n >= len(dataset):  # type: ignore[arg-type]
        return dataset
    if hasattr(dataset, "subset"):
        return dataset.subset(n)
    return torch.utils.data.Subset(dataset, range(n))


def _cache(cfg: TrainConfig) -> Path:
    return Path(cfg.task.cache_dir) if cfg.task.cache_dir else default_cache_dir()


def _atomic_weights(path: Path, build: Callable[[Path], None]) -> Path:
    """Create a weights file once (concurrent stage processes may race: write aside, rename)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    build(tmp)
    os.replace(tmp, path)
    return path


def _option(option: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its one-line SpecError prefixed with the option it is about."""
    try:
        return fn(*args)
    except SpecError as e:
        raise SpecError(f"{option}: {e}") from None


# -- models -----------------------------------------------------------------------------------------------


def _model_name(cfg: TrainConfig, kind: str) -> str:
    return cfg.model.name or ("tiny-llama" if cfg.task.name == "synthetic-lm" else DEFAULT_MODEL[kind])


def _named_model(cfg: TrainConfig, kind: str) -> str:
    """The model as the run names it: a hub name or an offline source as given, a local folder as an absolute
    path (what an adapter export records as its base)."""
    model = _model_name(cfg, kind)
    return str(Path(model).resolve()) if model not in _SOURCE_MODELS and Path(model).is_dir() else model


def _model_folder(cfg: TrainConfig, kind: str) -> Path | None:
    """The folder of a transformers model (a prepared source, a local folder or a hub download), or None for
    the bundled models (resnet, the random tiny ones)."""
    model = _model_name(cfg, kind)
    if model == "resnet" or model in TINY_MODELS:
        return None
    if model in _SOURCE_MODELS:
        return require(model, cfg.task.cache_dir)
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise SpecError(f"--model {model}: the folder has no config.json (save a model there with "
                            f"save_pretrained)")
        model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
        # an unsupported family: before anything loads
        _option(f"--model {model}", family_for, model_type, kind)
        check_model_files(Path(model), f"--model {model}")
        return Path(model)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or (os.sep != "/" and os.sep in model):
        raise SpecError(f"--model {model}: no such folder")  # a path, not a hub name (org/name)
    return _hub_model(model, kind, _cache(cfg) / "weights")


def _tokenizer(folder: Path, model: str) -> Any:
    """The tokenizer saved next to a model."""
    from transformers import AutoTokenizer

    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):  # transformers 5 would build an empty one
        raise DataSourceError(f"--model {model}: no tokenizer in {folder} (none of "
                              f"{', '.join(_TOKENIZER_FILES)}); save one there with "
                              f"tokenizer.save_pretrained(...)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - a folder without a usable tokenizer: one clear line
        raise DataSourceError(f"--model {model}: no tokenizer in {folder} ({type(e).__name__}); save one "
                              f"there with tokenizer.save_pretrained(...)") from None


def _hf_recipe(kind: str, model_dir: Path, cfg: TrainConfig, *, num_labels: int | None, weights_dir: Path,
               labels: list[str] | None = None, pad_token_id: int | None = None) -> ModelRecipe:
    """Recipe for a local Hugging Face folder; adds a seeded classification head when the task needs one."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config = _option("--model-layers", truncate_config, kind, config, cfg.model.layers)
    extra: dict[str, Any] = {}
    if num_labels is not None:
        config = {**config, "num_labels": num_labels}
        config.pop("id2label", None)
        config.pop("label2id", None)
        if labels is not None:  # the user's label names travel with the model
            extra = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
            config.update({"id2label": {str(i): n for i, n in enumerate(labels)},
                           "label2id": extra["label2id"]})
        if config.get("pad_token_id") is None and pad_token_id is not None:
            config["pad_token_id"] = extra["pad_token_id"] = pad_token_id
    whole = ((model_dir / "model.safetensors").exists()
             or (model_dir / "model.safetensors.index.json").exists())
    if num_labels is None and cfg.model.layers is None and whole:
        return ModelRecipe(kind, config, weights=str(model_dir))  # the folder is the complete model
    family = get_family(kind)

    def build(path: Path) -> None:
        import transformers

        torch.manual_seed(cfg.optim.seed)
        auto = getattr(transformers, getattr(family, "auto_class", None) or (
            "AutoModelForSequenceClassification" if num_labels is not None else "AutoModelForCausalLM"))
        kwargs: dict[str, Any] = {}
        if cfg.model.layers:
            kwargs[family.blocks_key or "num_hidden_layers"] = cfg.model.layers
        # a classifier saved with other labels gets a new (seeded) head, as run_glue does
        if num_labels is not None:
            kwargs.update(num_labels=num_labels, ignore_mismatched_sizes=True, **extra)
        try:
            model = auto.from_pretrained(str(model_dir), **kwargs)
        except Exception as e:  # noqa: BLE001 - damaged or unreadable weights: one line naming the folder
            detail = " ".join(str(e).split())[:300] or type(e).__name__
            raise WeightsError(f"--model {model_dir}: cannot load its weights ({type(e).__name__}: "
                               f"{detail})") from None
        save_weights(model, path)

    recipe = ModelRecipe(kind, config)
    # named by the folder's contents: a folder saved again (or another of the same name) is never served stale
    digest = model_digest(model_dir, weights_dir)[:16]
    name = f"{model_dir.name}-{recipe.fingerprint()}-{digest}-seed{cfg.optim.seed}.safetensors"
    return recipe.with_weights(_atomic_weights(weights_dir / name, build))


def _model_recipe(cfg: TrainConfig, kind: str, train: Dataset, folder: Path | None,
                  evals: Dataset | None = None) -> ModelRecipe:
    weights_dir = _cache(cfg) / "weights"
    info = getattr(train, "info", {}) or {}
    model = _model_name(cfg, kind)
    if model == "resnet":
        if cfg.model.layers is not None:
            raise SpecError("--model-layers keeps the first N blocks of a transformer; the resnet has no "
                            "such setting")
        if kind != "image-classification":
            raise SpecError(f"--model resnet needs an image task, not {cfg.task_name}")
        recipe = ModelRecipe("resnet", {"in_channels": int(info.get("channels", 1)),
                                        "num_classes": _num_labels(train),
                                        "widths": [16, 32, 64], "blocks_per_group": 2, "norm": "group"})
        path = weights_dir / f"resnet-{recipe.fingerprint()}-seed{cfg.optim.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path,
                                                   lambda p: init_weights_file(recipe, p, cfg.optim.seed)))
    if model in TINY_MODELS:
        if kind != "causal-lm":
            raise SpecError(f"--model {model} is a causal LM; the {cfg.task_name} task needs a {kind} model")
        if cfg.model.layers is not None and cfg.model.layers > _TINY_BLOCKS:
            raise SpecError(f"--model-layers: the model has only {_TINY_BLOCKS} blocks, asked for "
                            f"{cfg.model.layers}")
        recipe = tiny_recipe(TINY_MODELS[model], layers=cfg.model.layers or _TINY_BLOCKS,
                             hidden=cfg.model.hidden_size, vocab=cfg.model.vocab_size,
                             seq_len=cfg.task.max_length)
        path = weights_dir / f"{model}-{recipe.fingerprint()}-seed{cfg.optim.seed}.safetensors"
        return recipe.with_weights(_atomic_weights(path,
                                                   lambda p: init_weights_file(recipe, p, cfg.optim.seed)))
    if kind not in ("causal-lm", "sequence-classification"):
        raise SpecError(f"--model {model} does not fit the {kind} task {cfg.task_name}")
    assert folder is not None
    config = json.loads((folder / "config.json").read_text())
    family = _option(f"--model {model}", family_for, config.get("model_type"), kind)
    _check_vocab(model, config, info, [train] if evals is None else [train, evals])
    num_labels = _num_labels(train) if kind == "sequence-classification" else None
    labels = info.get("label_names") if cfg.own_data else None
    return _hf_recipe(family, folder, cfg, num_labels=num_labels, weights_dir=weights_dir, labels=labels,
                      pad_token_id=info.get("pad_token_id"))


def _largest_token_id(datasets: list[Dataset]) -> int | None:
    """The largest ``input_ids`` value of datasets that hold their columns as tensors (None if any does not:
    a dataset given from Python may compute its items)."""
    largest = -1
    for ds in datasets:
        # padded columns, or the flat token columns of examples of their own lengths
        ids = (getattr(ds, "columns", None) or getattr(ds, "tokens", None) or {}).get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return None
        if ids.numel():
            largest = max(largest, int(ids.max()))
    return largest if largest >= 0 else None


def _check_vocab(model: str, config: Mapping[str, Any], info: Mapping[str, Any],
                 datasets: list[Dataset]) -> None:
    """The data's token ids must fit the model's embedding table (an id beyond it is an index error on the
    CPU and a device-side assert on a GPU). Where the ids themselves can be read, they are checked (a
    tokenizer may list more tokens than the data use); else the tokenizer's size."""
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not vocab:
        return
    vocab, used, largest = int(vocab), info.get("vocab_size"), _largest_token_id(datasets)
    if largest is not None:
        if largest < vocab:
            return
        what = f"the data hold token id {largest}"
    elif used and int(used) > vocab:
        what = f"the data's tokenizer has {used} tokens"
    else:
        return
    sized = f" (its tokenizer has {used})" if used and largest is not None else ""
    raise SpecError(f"--model {model}: {what}, but its embedding has only {vocab} rows (vocab_size in "
                    f"config.json){sized}: tokens added to the tokenizer need rows of their own; give the "
                    "model them (model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or "
                    "tokenize without the added tokens")


def _hub_model(name: str, kind: str, weights_dir: Path) -> Path:
    """Download a hub model and its tokenizer once into the cache (only where the hub is reachable)."""
    target = weights_dir / "hub" / name.replace("/", "--")
    if (target / "config.json").exists():
        return target
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DataSourceError(f"--model {name}: the Hugging Face hub is offline (HF_HUB_OFFLINE=1); use a "
                              f"local folder or the offline default (--model {DEFAULT_MODEL[kind]})")
    try:
        import transformers
        from transformers import AutoConfig, AutoTokenizer

        model_type = AutoConfig.from_pretrained(name).model_type
        family = get_family(family_for(model_type, kind))
        cls = getattr(transformers, family.auto_class or "AutoModelForCausalLM")
        model = cls.from_pretrained(name)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except SpecError as e:
        raise SpecError(f"--model {name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        raise DataSourceError(f"--model {name}: could not load it from the Hugging Face hub "
                              f"({type(e).__name__}); use a local folder, or offline --model "
                              f"{DEFAULT_MODEL[kind]}") from None
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, target)
    return target


# -- data -------------------------------------------------------------------------------------------------


def _own_data(cfg: TrainConfig) -> tuple[Dataset, Dataset, str, Path | None]:
    """The user's files or hub dataset, tokenized with the model's tokenizer: (train, eval, kind, model
    folder)."""
    from aqsgd.data.datasets import files

    t = cfg.task
    n_train, n_eval = sample_caps(cfg)
    common = dict(max_length=t.max_length, text_column=t.text_column, text_pair_column=t.text_pair_column,
                  label_column=t.label_column, eval_split=t.eval_split, seed=cfg.optim.seed,
                  max_train_samples=n_train, max_eval_samples=n_eval, prompt_column=t.prompt_column,
                  response_column=t.response_column, messages_column=t.messages_column,
                  chat_template=t.chat_template)
    folders: dict[str, Path | None] = {}

    def tokenizer_for(kind: str) -> Any:  # the model's own tokenizer, once the data say which kind of model
        folders[kind] = folder = _model_folder(cfg, kind)
        if folder is None:
            raise SpecError(f"--model {_model_name(cfg, kind)} has no tokenizer for your text; use a "
                            f"transformers model (a hub name, or a folder saved with its tokenizer)")
        return _tokenizer(folder, _model_name(cfg, kind))

    if t.train_file is not None:
        train, evals = files.load_text_files(t.train_file, t.eval_file, tokenizer_for=tokenizer_for,
                                             txt_unit=t.txt_unit, **common)
    else:
        train, evals = files.load_hub_dataset(t.dataset, tokenizer_for=tokenizer_for, **common)  # type: ignore[arg-type]
    kind = train.info["kind"]
    return train, evals, kind, folders.get(kind)


def _named_task(cfg: TrainConfig, kind: str) -> tuple[Dataset, Dataset, Path | None]:
    """A built-in or registered task; text tasks use the model's tokenizer where the model brings one."""
    name = cfg.task_name
    n_train, n_eval = sample_caps(cfg)
    if name == "synthetic-lm":
        vocab = cfg.model.vocab_size
        train = SyntheticLM(n_train or 256, cfg.task.max_length, vocab, seed=cfg.optim.seed)
        evals = SyntheticLM(n_eval or 64, cfg.task.max_length, vocab, seed=cfg.optim.seed + 10_000)
        return train, evals, _model_folder(cfg, kind)
    folder = _model_folder(cfg, kind) if kind != "image-classification" else None
    # the task's own tokenizer goes with the task's default model; any other transformers model brings its own
    tokenizer = str(folder) if folder is not None and cfg.model.name not in (None, *_SOURCE_MODELS) else None
    if tokenizer is None and cfg.model.name in _SOURCE_MODELS:
        tokenizer = cfg.model.name
    common = dict(cache_dir=cfg.task.cache_dir, seq_len=cfg.task.max_length, max_length=cfg.task.max_length,
                  seed=cfg.optim.seed, tokenizer=tokenizer)
    train = load_task(name, "train", max_samples=n_train, **common)
    evals = load_task(name, "eval", max_samples=n_eval, **common)
    return train, evals, folder


def setup_task(cfg: TrainConfig, *, data: tuple[Dataset, Dataset] | None = None) -> TaskSetup:
    """The data and model of a run (see the module docstring); ``data`` = (train, eval) datasets given from
    Python, whose items are dicts of tensors with a stable ``sample_id`` (e.g. a
    :class:`~aqsgd.data.DictDataset`)."""
    if data is not None:
        if cfg.own_data or cfg.task.name is not None:
            raise SpecError("data given from Python replace --task / --train-file / --dataset; "
                            "leave those unset")
        train, evals = (_first(d, n)
                        for d, n in zip(data, (cfg.task.max_train_samples, cfg.task.max_eval_samples)))
        if len(train) == 0 or len(evals) == 0:  # type: ignore[arg-type]
            raise SpecError(f"data: {len(train)} training and {len(evals)} evaluation samples; "  # type: ignore[arg-type]
                            f"both need some")
        kind = dataset_kind(train)
        folder = _model_folder(cfg, kind) if kind != "image-classification" else None
        name = str((getattr(train, "info", {}) or {}).get("task") or "data")
    elif cfg.own_data:
        train, evals, kind, folder = _own_data(cfg)
        name = cfg.task_name
    else:
        kind = task_kind(cfg.task_name)
        train, evals, folder = _named_task(cfg, kind)
        name = cfg.task_name
    recipe = _option("--dropout", with_dropout, _model_recipe(cfg, kind, train, folder, evals),
                     cfg.model.dropout)
    info = getattr(train, "info", {}) or {}
    num_labels = _num_labels(train) if kind != "causal-lm" else None
    metric = {"causal-lm": "perplexity", "sequence-classification": "accuracy",
              "image-classification": "accuracy"}[kind]
    if name == "glue-cola":
        metric = "mcc"
    data_info = {k: info[k] for k in ("label_names", "train_file", "eval_file", "dataset", "fingerprint",
                                       "fingerprints", "text_column", "text_pair_column", "label_column",
                                       "txt_unit", "rows_read", "format", "prompt_column", "response_column",
                                       "messages_column", "chat_template", "truncated", "dropped")
                 if info.get(k) is not None}
    digest = None if folder is None else model_digest(folder, _cache(cfg) / "weights")
    return TaskSetup(name, kind, recipe, train, evals, num_labels, metric, data_info, folder,
                     _named_model(cfg, kind), digest)
